"""fp8 storage (job dtype "fp8": e4m3 with a float32 scale per token and layer) through the real ShardWriter, and
back through the reader, the statistics, the training loader and the SAELens export; with and without sampling."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import objectstore
from activations.format import FP8, LayerStats, quantize_per_token
from activations.loader import ActivationLoader
from activations.reader import open_activations
from activations.sampling import TokenSampling
from extract.batching import TokenizedSample, make_batches
from extract.writer import ProgressLog, ShardWriter

HIDDEN, LAYERS = 32, (2, 5)
MASSIVE = 3000.0


def activations_for(rng: np.random.Generator, n: int, layer: int) -> np.ndarray:
    """Ordinary values of about 1, an outlier dimension 20 times larger, and a massive one on the first token."""
    rows = rng.standard_normal((n, HIDDEN)).astype(np.float32) * (1 + layer)
    rows[:, 3] *= 20
    if n:
        rows[0, 7] = MASSIVE
    return rows


def write(root, lengths: list[int], sampling: TokenSampling | None = None) -> dict[int, dict[int, np.ndarray]]:
    """A task of documents of `lengths` tokens written in fp8 (bf16 in, as the engine hands it); sample id -> layer
    -> the bf16 rows the writer was given, as float32."""
    rng = np.random.default_rng(5)
    queue = objectstore.open_store(str(root))
    samples = [TokenizedSample(i, 100 + i, rng.integers(0, 50, n).astype(np.int32)) for i, n in enumerate(lengths)]
    given = {s.sample_id: {layer: activations_for(rng, s.n_tokens, layer) for layer in LAYERS} for s in samples}
    bf16 = np.dtype(ml_dtypes.bfloat16)
    writer = ShardWriter(store=queue.child("out/t1"), layers=LAYERS, out_dtype=FP8, start=0, end=len(lengths),
                         shard_size=4, metadata={"format": "activations/v1", "hidden_size": str(HIDDEN),
                                                 "layers": json.dumps(list(LAYERS)), "num_hidden_layers": "6"},
                         progress=ProgressLog(None), streams=2, sampling=sampling)  # fmt: skip
    for batch in make_batches(samples, batch_size=3, buckets=(8, 64), pad_id=0):
        hidden = {}
        for layer in LAYERS:
            out = np.zeros((*batch.token_ids.shape, HIDDEN), bf16)
            for row, s in enumerate(batch.samples):
                out[row, : s.n_tokens] = given[s.sample_id][layer]
            hidden[layer] = out
        writer.submit(batch, hidden)
    records = writer.finish()
    queue.create("done/t1.json", json.dumps({"task": "t1", "outputs": records}).encode())
    return {sid: {k: np.asarray(v.astype(bf16), np.float32) for k, v in layers.items()} for sid, layers in given.items()}


def test_fp8_shards_hold_e4m3_and_a_scale_per_token_within_e4m3_rounding(tmp_path):
    given = write(tmp_path, [9, 0, 17, 4, 30, 1])
    acts = open_activations(str(tmp_path))
    for sample in acts.samples():
        for layer, rows in sample.layers.items():
            truth = given[sample.sample_id][layer]
            assert rows.dtype == np.float32 and rows.shape == truth.shape
            values, scale = quantize_per_token(truth)
            assert np.array_equal(rows, values.astype(np.float32) * scale[:, None])
            # e4m3 keeps 3 mantissa bits: a normal value is within 2^-4 of itself; below 2^-6 of the scale's range,
            # subnormals are spaced 2^-9 apart. The massive value sets its token's scale and survives exactly.
            bound = np.maximum(np.abs(truth) * 2.0**-4, scale[:, None] * 2.0**-10)
            assert np.all(np.abs(rows - truth) <= bound * 1.0001)
            if len(rows):
                assert rows[0, 7] == pytest.approx(truth[0, 7], rel=1e-6) and truth[0, 7] == pytest.approx(MASSIVE, rel=0.01)
    shard = next(acts.iter_shards())
    assert shard.tensors["layer_2"].dtype == FP8 and shard.tensors["scale.layer_2"].dtype == np.float32


def test_fp8_statistics_loader_and_kept_stats_see_the_dequantised_values(tmp_path):
    write(tmp_path, [9, 0, 17, 4, 30, 1])
    acts = open_activations(str(tmp_path))
    for layer in LAYERS:
        rows = acts.layer(layer)
        stored = acts.stats()[layer]
        direct = LayerStats.of(rows)
        assert stored.tokens == direct.tokens
        np.testing.assert_allclose(stored.sum_sq, direct.sum_sq, rtol=1e-6)  # float32 chunks summed per shard
        with ActivationLoader(str(tmp_path), layers=layer, batch_size=5, shuffle=False) as loader:
            streamed = np.concatenate(list(loader))
        assert np.array_equal(streamed, rows)
    # Both layers at once, shuffled, without each document's first token (which holds the massive value).
    with ActivationLoader(str(tmp_path), layers=list(LAYERS), batch_size=8, shuffle_tokens=16, seed=3,
                          drop_first=1) as loader:  # fmt: skip
        kept = loader.kept_stats()
        shuffled = np.concatenate(list(loader))
    later = acts.positions() > 0
    both = np.stack([acts.layer(layer)[later] for layer in LAYERS], axis=1)
    for i, layer in enumerate(LAYERS):
        np.testing.assert_allclose(kept[layer].sum, LayerStats.of(both[:, i]).sum, rtol=1e-6, atol=1e-4)
    # The same rows come out (as a multiset), each token's two layers together.
    assert sorted(map(lambda r: r.tobytes(), shuffled)) == sorted(map(lambda r: r.tobytes(), both))


def test_fp8_with_sampling_and_the_saelens_export(tmp_path):
    sampling = TokenSampling(0.5, 1, 2)
    given = write(tmp_path, [9, 0, 17, 4, 30, 1], sampling)
    acts = open_activations(str(tmp_path))
    for sample in acts.samples():
        kept = sampling.kept(sample.sample_id, len(given[sample.sample_id][2]))
        assert np.array_equal(sample.positions, kept)
        values, scale = quantize_per_token(given[sample.sample_id][2][kept])
        assert np.array_equal(sample.layers[2], values.astype(np.float32) * scale[:, None])
    pytest.importorskip("datasets")
    from activations.saelens import export_cached_activations

    summary = export_cached_activations(str(tmp_path), tmp_path / "saelens", layer=2, context_size=4)
    assert summary["sampled"] and summary["rows"] == acts.num_tokens // 4
    import datasets

    first = np.asarray(datasets.load_from_disk(str(tmp_path / "saelens"))[0][summary["hook"]], np.float32)
    assert np.array_equal(first, acts.layer(2)[:4])


def test_encode_safetensors_keeps_a_scalar_statistic_scalar():
    """A shard encoded by encode_safetensors (tools and benches do) must hold norm_sum as [] for read_stats."""
    from activations.format import decode_safetensors, encode_safetensors

    tensors = LayerStats.of(np.ones((3, 4), np.float32)).tensors(1)
    decoded, _ = decode_safetensors(encode_safetensors(tensors, {}))
    assert decoded["stats.layer_1.norm_sum"].shape == () and float(decoded["stats.layer_1.norm_sum"]) == 6.0

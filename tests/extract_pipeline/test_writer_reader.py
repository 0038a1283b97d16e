"""Shards on disk and back: safetensors bytes, slice order, progress records, crc32c, errors in the writer's threads."""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np
import pytest

import objectstore
from extract.batching import TokenizedSample, make_batches
from extract.cli import EX_TEMPFAIL, exit_code_for
from activations.reader import ActivationsError, open_activations
from extract.writer import ProgressLog, ShardWriter, crc32c_b64, decode_safetensors, encode_safetensors

BF16 = np.dtype(ml_dtypes.bfloat16)
HIDDEN = 8
LAYERS = (1, 3)


def test_bf16_shard_bytes_are_standard_safetensors(tmp_path):
    """The real safetensors library (torch backend, which has bfloat16) reads what we write."""
    import torch
    from safetensors.torch import load_file

    values = np.linspace(-3, 3, 24, dtype=np.float32).reshape(3, HIDDEN)
    tensors = {"layer_1": values.astype(BF16), "token_ids": np.array([5, 6, 7], np.int32), "offsets": np.array([0, 3])}
    path = tmp_path / "s.safetensors"
    path.write_bytes(encode_safetensors(tensors, {"format": "activations/v1"}))
    loaded = load_file(str(path))
    assert loaded["layer_1"].dtype == torch.bfloat16
    assert np.array_equal(loaded["layer_1"].float().numpy(), values.astype(BF16).astype(np.float32))
    assert loaded["token_ids"].tolist() == [5, 6, 7] and loaded["offsets"].dtype == torch.int64
    decoded, metadata = decode_safetensors(path.read_bytes())
    assert metadata == {"format": "activations/v1"} and decoded["layer_1"].dtype == BF16


def test_crc32c_matches_gcs_published_value():
    # GCS documents the CRC32C of b"" as "AAAAAA==" and RFC 3720's check value 0xE3069283 for "123456789".
    assert crc32c_b64(b"") == "AAAAAA=="
    assert crc32c_b64(b"123456789") == "4waSgw=="


def fake_hidden(batch, layer: int) -> np.ndarray:
    """Activations that encode (token id, layer, column), so a misplaced row is visible."""
    ids = batch.token_ids.astype(np.float32)[:, :, None]
    return (ids * 10 + layer + np.arange(HIDDEN, dtype=np.float32) / 16).astype(BF16)


def windows_of(lengths: list[int], start: int, window: int) -> list:
    samples = [
        TokenizedSample(start + i, 500 + start + i, np.arange(1, n + 1, dtype=np.int32) + i)
        for i, n in enumerate(lengths)
    ]
    batches = []
    for lo in range(0, len(samples), window):
        batches += make_batches(samples[lo : lo + window], batch_size=2, buckets=(4, 8), pad_id=0)
    return batches


def write_all(store, lengths, *, start=0, shard_size=4, progress=None):
    writer = ShardWriter(
        store=store, layers=LAYERS, out_dtype=BF16, start=start, end=start + len(lengths), shard_size=shard_size,
        metadata={"format": "activations/v1", "hidden_size": str(HIDDEN), "layers": json.dumps(list(LAYERS))},
        progress=progress or ProgressLog(None), flops_per_token=lambda n: 100.0, peak_flops=1e6,
    )  # fmt: skip
    for batch in windows_of(lengths, start, window=4):
        hidden = {layer: fake_hidden(batch, layer) for layer in LAYERS} if batch.token_ids is not None else {}
        writer.submit(batch, hidden)
    return writer.finish()


LENGTHS = [3, 8, 0, 1, 5, 2, 7, 0, 4, 6]


def test_writer_stores_samples_in_slice_order_without_padding(tmp_path):
    store = objectstore.open_store(str(tmp_path / "out"))
    progress_file = tmp_path / "progress.jsonl"
    records = write_all(store, LENGTHS, progress=ProgressLog(progress_file))
    assert [(r["sample_start"], r["sample_end"]) for r in records] == [(0, 4), (4, 8), (8, 10)]
    assert [json.loads(line) for line in progress_file.read_text().splitlines()] == records
    assert records[-1]["final"] is True and "final" not in records[0]
    stats = records[-1]["stats"]
    assert stats["samples"] == 10 and stats["tokens"] == sum(LENGTHS) and stats["mfu"] > 0
    for r in records:
        payload = pathlib.Path(r["shard"]).read_bytes()
        assert r["bytes"] == len(payload) and r["crc32c"] == crc32c_b64(payload)

    acts = open_activations(str(tmp_path / "out"))
    assert acts.layers == LAYERS and acts.num_samples == 10 and acts.num_tokens == sum(LENGTHS)
    samples = list(acts.samples())
    assert [s.sample_id for s in samples] == [500 + i for i in range(10)]
    for i, s in enumerate(samples):
        expected_ids = np.arange(1, LENGTHS[i] + 1, dtype=np.int32) + i
        assert np.array_equal(s.token_ids, expected_ids)
        for layer in LAYERS:
            assert s.layers[layer].shape == (LENGTHS[i], HIDDEN)
            expected = (expected_ids[:, None] * 10 + layer + np.arange(HIDDEN) / 16).astype(BF16)
            assert np.array_equal(s.layers[layer], expected)
    assert acts.layer(3).shape == (sum(LENGTHS), HIDDEN)
    assert list(acts.offsets()) == [0, *np.cumsum(LENGTHS)]


def test_reader_accepts_done_marker_prefix_and_single_shard(tmp_path):
    store = objectstore.open_store(str(tmp_path / "out"))
    records = write_all(store, LENGTHS)
    marker = tmp_path / "done" / "t1.json"
    marker.parent.mkdir()
    marker.write_text(json.dumps({"task": "t1", "fencing_token": 1, "worker": "w", "attempt": 1, "outputs": records,
                                  "completed_at": "2025-01-01T00:00:00Z"}))  # fmt: skip
    by_marker = open_activations(str(marker))
    by_prefix = open_activations(str(tmp_path / "out"))
    single = open_activations(records[1]["shard"])
    assert np.array_equal(by_marker.sample_ids(), by_prefix.sample_ids())
    assert list(single.sample_ids()) == [504, 505, 506, 507]
    assert by_marker.metadata["layers"] == list(LAYERS)


def test_reader_rejects_a_shard_whose_bytes_differ_from_its_record(tmp_path):
    store = objectstore.open_store(str(tmp_path / "out"))
    records = write_all(store, LENGTHS)
    shard = pathlib.Path(records[0]["shard"])
    payload = bytearray(shard.read_bytes())
    payload[-1] ^= 0xFF
    shard.write_bytes(bytes(payload))
    marker = tmp_path / "t1.json"
    marker.write_text(json.dumps({"task": "t1", "outputs": records}))
    with pytest.raises(ActivationsError, match="crc32c"):
        list(open_activations(str(marker)).samples())


def test_writer_resumed_mid_slice_cuts_shards_at_the_same_boundaries(tmp_path):
    store = objectstore.open_store(str(tmp_path / "out"))
    records = write_all(store, LENGTHS[4:], start=4)
    assert [(r["sample_start"], r["sample_end"]) for r in records] == [(4, 8), (8, 10)]


def test_upload_failure_in_the_writer_thread_fails_the_run_as_transient(gcs, gcs_bucket, gcs_client):
    """A store that stays unavailable: the uploader's error reaches the main thread with its type, so exit 75."""
    from objectstore.gcs import GCSStore, RetryPolicy

    gcs.faults.fail_fraction(1.0, 503, kind="write")
    policy = RetryPolicy(initial_s=0.01, cap_s=0.05, deadline_s=0.5)
    store = GCSStore(gcs_bucket, "out", client=gcs_client, policy=policy)
    with pytest.raises(objectstore.StoreUnavailable) as failure:
        write_all(store, LENGTHS)
    assert exit_code_for(failure.value) == EX_TEMPFAIL
    assert gcs.counts()["faults_injected"] >= 1

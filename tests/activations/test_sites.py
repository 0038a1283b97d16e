"""Hook sites through the shard format, the reader, the loader, the statistics and the job index; old shards still read.

Shards are written by the real ShardWriter from known activations whose first two columns number the token, so a
row read back names the token it belongs to, whatever the output.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import objectstore
from activations.format import HookPoint, LayerStats, encode_safetensors
from activations.loader import ActivationLoader, LoaderConfigError
from activations.reader import open_activations
from extract.batching import TokenizedSample, make_batches
from extract.writer import ProgressLog, ShardWriter
from tests.activations.conftest import BF16, activation_of
from tests.workers import REPO

HIDDEN, INTERMEDIATE = 16, 24
OUTPUTS = (1, HookPoint("mlp_in", 0), HookPoint("mlp_out", 0), HookPoint("mlp_hidden", 2))
WIDTHS = {HookPoint("mlp_hidden", 2): INTERMEDIATE}


def _values(output, numbers: np.ndarray, rng) -> np.ndarray:
    """Known activations: columns 0 and 1 number the token; the rest differ by output."""
    width = WIDTHS.get(output, HIDDEN)
    salt = output if isinstance(output, int) else 10 + output.layer + 3 * len(output.site)
    rows = np.concatenate([np.asarray(activation_of(numbers, salt, rng), np.float32),
                           rng.standard_normal((len(numbers), width - HIDDEN)).astype(np.float32)], axis=1)  # fmt: skip
    return rows[:, :width].astype(BF16)


@pytest.fixture(scope="module")
def sites_job(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    """A queue of one task (17 documents, shards of 4) keeping a hidden state and three hook sites; the truth."""
    root = tmp_path_factory.mktemp("sites")
    rng = np.random.default_rng(3)
    lengths = [int(n) for n in rng.integers(0, 10, 17)]
    samples = [TokenizedSample(i, 100 + i, rng.integers(0, 50, n).astype(np.int32)) for i, n in enumerate(lengths)]
    start = np.cumsum([0] + lengths)
    numbers = {s.position: np.arange(start[i], start[i + 1]) for i, s in enumerate(samples)}
    truth = {output: [] for output in OUTPUTS}
    store = objectstore.open_store(str(root)).child("out/t0")
    writer = ShardWriter(
        store=store, layers=OUTPUTS, widths=WIDTHS, out_dtype=BF16, start=0, end=len(samples), shard_size=4,
        metadata={"format": "activations/v1", "hidden_size": str(HIDDEN), "layers": "[1]", "num_hidden_layers": "3"},
        progress=ProgressLog(None), streams=2,
    )  # fmt: skip
    per_sample = {s.position: {o: _values(o, numbers[s.position], rng) for o in OUTPUTS} for s in samples}
    for batch in make_batches(samples, batch_size=4, buckets=(16,), pad_id=0):
        hidden = {}
        if batch.token_ids is not None:
            for output in OUTPUTS:
                out = np.zeros((*batch.token_ids.shape, WIDTHS.get(output, HIDDEN)), BF16)
                for row, s in enumerate(batch.samples):
                    out[row, : s.n_tokens] = per_sample[s.position][output]
                hidden[output] = out
        writer.submit(batch, hidden)
    records = writer.finish()
    objectstore.open_store(str(root)).create("done/t0.json", json.dumps({"task": "t0", "outputs": records}).encode())
    for output in OUTPUTS:
        truth[output] = np.concatenate([per_sample[p][output] for p in sorted(per_sample)])
    return root, {"records": records, "values": truth}


def test_shards_name_their_hook_sites_and_the_reader_selects_by_site_and_layer(sites_job):
    root, truth = sites_job
    acts = open_activations(str(root))
    assert acts.layers == (1,) and acts.outputs == OUTPUTS
    assert acts.sites == {"mlp_in": (0,), "mlp_out": (0,), "mlp_hidden": (2,)}
    assert acts.metadata["sites"] == {"mlp_in": [0], "mlp_hidden": [2], "mlp_out": [0]}
    for output in OUTPUTS:
        layer, site = (output, "hidden") if isinstance(output, int) else (output.layer, output.site)
        got = acts.layer(layer, site=site)
        assert got.shape == (acts.num_tokens, WIDTHS.get(output, HIDDEN))
        assert np.array_equal(got.view(np.uint16), truth["values"][output].view(np.uint16))
    sample = next(s for s in acts.samples() if len(s.token_ids))
    assert set(sample.outputs) == set(OUTPUTS) and set(sample.layers) == {1}
    assert all(r["activations"] == ["layer_1", "mlp_in_0", "mlp_out_0", "mlp_hidden_2"] for r in truth["records"])
    with pytest.raises(Exception, match="mlp_out_1 was not extracted; these shards hold layer_1, mlp_in_0"):
        acts.layer(1, site="mlp_out")
    with pytest.raises(Exception, match="site='mlp_outs'"):
        acts.layer(0, site="mlp_outs")


def test_the_loader_reads_a_site_and_a_transcoders_pairs_of_one_token(sites_job):
    root, truth = sites_job
    with ActivationLoader(str(root), site="mlp_out", layers=0, batch_size=8, shuffle_tokens=32, seed=1) as loader:
        rows = np.concatenate([np.asarray(b) for b in loader])
    expected = np.asarray(truth["values"][HookPoint("mlp_out", 0)], np.float32)
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, expected.tolist()))
    pair = [HookPoint("mlp_in", 0), HookPoint("mlp_out", 0)]
    with ActivationLoader(str(root), layers=pair, batch_size=8, shuffle_tokens=32, seed=2) as loader:
        batch = next(loader)
    assert batch.shape == (8, 2, HIDDEN)
    assert np.array_equal(np.rint(batch[:, 0, :2]), np.rint(batch[:, 1, :2]))  # both rows number the same token
    with pytest.raises(LoaderConfigError, match="differ in width"):
        ActivationLoader(str(root), layers=[HookPoint("mlp_out", 0), HookPoint("mlp_hidden", 2)])
    with pytest.raises(LoaderConfigError, match=r"mlp_out_2.*not in the shards, which hold layer_1, mlp_in_0"):
        ActivationLoader(str(root), site="mlp_out", layers=2)
    with ActivationLoader(str(root), site="mlp_hidden", batch_size=4, shuffle=False) as loader:  # every layer of it
        assert loader.outputs == (HookPoint("mlp_hidden", 2),) and next(loader).shape == (4, INTERMEDIATE)


def test_merge_indexes_each_sites_statistics_and_names_the_activations(sites_job, tmp_path):
    root, truth = sites_job
    queue = tmp_path / "queue"
    shutil.copytree(root, queue)
    for marker in (queue / "done").glob("*.json"):
        marker.write_text(marker.read_text().replace(str(root), str(queue)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "tools/merge.py", str(queue)], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    index = json.loads((queue / "index.json").read_text())
    assert index["activations"] == ["layer_1", "mlp_in_0", "mlp_out_0", "mlp_hidden_2"]
    assert sorted(index["stats"]) == sorted(index["activations"])
    for output in OUTPUTS:
        x = np.asarray(truth["values"][output], np.float64)
        key = output if isinstance(output, int) else output.key
        stats = LayerStats.from_json(index["stats"][f"layer_{key}" if isinstance(output, int) else key], "index")
        np.testing.assert_allclose(stats.mean, x.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats.mean_norm, np.linalg.norm(x, axis=1).mean(), rtol=1e-6)
    loader = ActivationLoader(str(queue), site="mlp_hidden", layers=2, batch_size=4, normalize="standardize")
    assert loader.stats()[HookPoint("mlp_hidden", 2)].norm_sum == index["stats"]["mlp_hidden_2"]["norm_sum"]
    standardized = np.concatenate(list(loader))
    np.testing.assert_allclose(standardized.mean(0), 0, atol=0.02)  # bf16 outputs of float32 maths


def test_merge_refuses_shards_of_one_job_that_hold_different_activations(tmp_path):
    from reporting import jobindex

    store = objectstore.open_store(str(tmp_path / "queue"))
    record = {"bytes": 1, "crc32c": "x", "sample_start": 0, "sample_end": 1, "samples": 1, "tokens": 1}
    for task, names in (("a", ["layer_1"]), ("b", ["layer_1", "mlp_out_0"])):
        store.create(f"done/{task}.json", json.dumps({"task": task, "outputs": [
            {**record, "shard": f"{task}.safetensors", "activations": names}]}).encode())  # fmt: skip
    with pytest.raises(jobindex.JobIndexError, match=r"different activations: a\.safetensors holds \['layer_1'\]"):
        jobindex.build_index(store, stats=False)


def test_shards_and_records_written_before_hook_sites_still_read(tmp_path):
    """An old shard: `layer_<L>` tensors, no `sites` metadata, no statistics; its record names no activations."""
    from reporting import jobindex

    store = objectstore.open_store(str(tmp_path / "queue"))
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    # The metadata the v1 writer wrote (extract/consumer.py's shard_metadata before hook sites): no `sites`.
    v1 = {"format": "activations/v1", "task": "t", "attempt": "1", "model": "m", "model_type": "qwen2",
          "num_hidden_layers": "4", "hidden_size": "4", "layers": "[2]", "dtype": "fp32", "compute_dtype": "fp32",
          "max_seq_len": "8"}  # fmt: skip
    shard = encode_safetensors({"layer_2": x, "token_ids": np.arange(3, dtype=np.int32),
                                "sample_ids": np.array([7]), "offsets": np.array([0, 3])}, v1)  # fmt: skip
    store.put("out/t/1/shard-0.safetensors", shard)
    record = {"shard": store.url("out/t/1/shard-0.safetensors"), "bytes": len(shard), "crc32c": "x",
              "sample_start": 0, "sample_end": 1, "samples": 1, "tokens": 3}  # fmt: skip
    store.create("done/t.json", json.dumps({"task": "t", "outputs": [record]}).encode())
    acts = open_activations(store.url("out/t/1/shard-0.safetensors"))
    assert acts.layers == (2,) and acts.outputs == (2,) and acts.sites == {}
    sample = next(acts.samples())
    assert np.array_equal(acts.layer(2), x) and list(sample.outputs) == [2] and np.array_equal(sample.layers[2], x)
    with ActivationLoader(str(tmp_path / "queue" / "out"), layers=2, batch_size=3, shuffle=False) as loader:
        assert np.array_equal(next(loader), x)
    from activations.saelens import export_cached_activations

    summary = export_cached_activations(str(tmp_path / "queue" / "out"), tmp_path / "saelens", layer=2, context_size=3)
    assert summary["hook"] == "blocks.1.hook_resid_post" and summary["rows"] == 1
    index = jobindex.build_index(store)
    assert index["activations"] is None and index["stats"] is None and "statistics" in index["stats_error"]

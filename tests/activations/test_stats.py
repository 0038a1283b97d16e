"""Normalisation statistics: tools/merge.py sums the shards' own into the job index; the loader takes them from it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np

from activations.format import LayerStats
from activations.loader import ActivationLoader
from tests.activations.conftest import LAYERS
from tests.workers import REPO


def test_merge_sums_shard_statistics_into_the_index_and_the_loader_uses_them(written, tmp_path):
    queue = tmp_path / "queue"
    shutil.copytree(written.root, queue)
    for marker in (queue / "done").glob("*.json"):  # the copied markers name the copied shards
        marker.write_text(marker.read_text().replace(str(written.root), str(queue)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's packages, not the venv's editable install
    result = subprocess.run([sys.executable, "tools/merge.py", str(queue)], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    index = json.loads((queue / "index.json").read_text())
    assert index["stats_error"] is None
    for layer in LAYERS:
        x = np.asarray(written.layers[layer], np.float64)
        stats = LayerStats.from_json(index["stats"][f"layer_{layer}"], "index")
        assert stats.tokens == len(x) == index["totals"]["tokens"]
        np.testing.assert_allclose(stats.mean, x.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats.std, x.std(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats.mean_norm, np.linalg.norm(x, axis=1).mean(), rtol=1e-6)
    loader = ActivationLoader(str(queue), layers=3, batch_size=8, normalize="mean_norm")
    from_index = loader.stats()[3]
    assert from_index.norm_sum == index["stats"]["layer_3"]["norm_sum"]


def test_merge_leaves_stats_null_with_the_reason_when_a_shard_predates_them(tmp_path):
    from activations.format import encode_safetensors
    from reporting import jobindex
    from objectstore import open_store

    store = open_store(str(tmp_path / "queue"))
    shard = encode_safetensors({"layer_1": np.zeros((2, 4), np.float32), "token_ids": np.zeros(2, np.int32),
                                "sample_ids": np.zeros(1, np.int64), "offsets": np.array([0, 2])}, {"layers": "[1]"})  # fmt: skip
    store.put("out/t/1/shard-0.safetensors", shard)
    record = {"shard": store.url("out/t/1/shard-0.safetensors"), "bytes": len(shard), "crc32c": "AAAAAA==",
              "sample_start": 0, "sample_end": 1, "samples": 1, "tokens": 2}  # fmt: skip
    store.create("done/t.json", json.dumps({"task": "t", "outputs": [record]}).encode())
    index = jobindex.build_index(store)
    assert index["stats"] is None and "no normalisation statistics" in index["stats_error"]
    assert index["totals"]["shards"] == 1

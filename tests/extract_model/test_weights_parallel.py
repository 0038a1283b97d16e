"""Weights read in place from gs:// by parallel ranged reads: the same bytes as the local files, no local copy."""

from __future__ import annotations

import numpy as np

import objectstore
from extract import weights
from extract.weights import Checkpoint, fetch_from_store, upload_model_dir


def test_ranged_reads_from_gcs_return_every_tensor_bitwise(qwen2_untied, gcs_client, gcs_bucket, monkeypatch):
    url = f"gs://{gcs_bucket}/models/q2"
    upload_model_dir(qwen2_untied.path, url)
    monkeypatch.setattr(weights, "READ_PIECE_BYTES", 4096)  # several pieces per large tensor, read out of order
    local, remote = Checkpoint(qwen2_untied.path), Checkpoint.from_store(url, streams=4)
    assert set(remote.tensors) == set(local.tensors)
    pieces = 0
    for name, location in local.tensors.items():
        got, want = remote.read(name), np.asarray(local.read(name))
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), name
        pieces += -(-got.nbytes // 4096)
        # Parts of a fused tensor: row ranges, out of order and of unequal lengths, read as ranges of bytes.
        n = location.shape[0]
        rows = [(n // 2, n), (0, 1), (1, max(2, n // 3))] if n > 2 else [(0, n)]
        got = remote.read(name, rows)
        assert np.array_equal(got.view(np.uint8), np.concatenate([want[a:b] for a, b in rows]).view(np.uint8)), name
        assert np.array_equal(np.asarray(local.read(name, rows)).view(np.uint8), got.view(np.uint8)), name
    remote.close()
    assert pieces > len(local.tensors)  # some tensors really were split


def test_gcs_read_range_returns_exactly_the_bytes_asked_for(gcs_client, gcs_bucket):
    store = objectstore.open_store(f"gs://{gcs_bucket}/x", client=gcs_client)
    payload = bytes(range(256)) * 100
    store.put("obj", payload)
    assert store.read_range("obj", 10, 20) == payload[10:20]
    assert store.read_range("obj", 0, len(payload)) == payload
    assert store.read_range("obj", 5, 5) == b""


def test_fetch_without_weights_caches_only_the_small_files(qwen2_untied, gcs_client, gcs_bucket, tmp_path):
    url = f"gs://{gcs_bucket}/models/q2"
    upload_model_dir(qwen2_untied.path, url)
    cache = fetch_from_store(url, tmp_path / "cache", weights=False)
    assert (cache / "config.json").is_file()
    assert not list(cache.glob("*.safetensors"))

"""tools/merge.py and reporting.jobindex: the job index built from hand-written done markers, on a
local directory queue and on the fake GCS server."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import google_crc32c
import pytest

from reporting import jobindex
from objectstore import open_store

REPO = Path(__file__).resolve().parents[2]


def _record(queue_url: str, task: str, token: int, k: int, start: int, end: int, tokens_per_sample: int) -> dict:
    payload = f"{task}:{k}".encode() * 10
    return {
        "shard": f"{queue_url}/out/{task}/{token}/shard-{k:05d}.safetensors",
        "bytes": len(payload),
        "crc32c": base64.b64encode(google_crc32c.Checksum(payload).digest()).decode(),
        "sample_start": start,
        "sample_end": end,
        "samples": end - start,
        "tokens": (end - start) * tokens_per_sample,
    }


def _marker(queue_url: str, task: str, shard_sizes: list[int], tokens_per_sample: int = 7, resend_last: bool = True) -> dict:
    # Shards of two holders: the first was preempted after its first shard; the second resumed.
    outputs, start = [], 0
    for k, size in enumerate(shard_sizes):
        token = 11 if k == 0 else 12
        outputs.append(_record(queue_url, task, token, k, start, start + size, tokens_per_sample))
        start += size
    if outputs and resend_last:
        last = dict(outputs[-1], final=True, stats={"samples": start, "tokens": start * tokens_per_sample, "seconds": 1.5,
                                                      "tokens_per_s": 100.0, "mfu": None})
        outputs = [*outputs, last]  # a last record re-sent on SIGTERM counts once
    return {"task": task, "fencing_token": 12, "worker": "w-1", "attempt": 1, "outputs": outputs,
            "completed_at": "2025-01-01T00:00:00+00:00"}


TASKS = {"t-002": [5, 3], "t-001": [4], "t-003": []}


def _write_markers(store, queue_url: str) -> None:
    for task, sizes in TASKS.items():
        store.create(f"done/{task}.json", json.dumps(_marker(queue_url, task, sizes)).encode())
    store.put("done/README.txt", b"not a marker")
    store.put("leases/t-004.json", b"{}")


def _check(index: dict, queue_url: str) -> None:
    assert index["queue"] == queue_url
    assert index["totals"] == {"tasks": 3, "shards": 3, "samples": 12, "tokens": 84, "bytes": sum(s["bytes"] for s in index["shards"])}
    assert [(s["task"], s["sample_start"], s["sample_end"]) for s in index["shards"]] == [
        ("t-001", 0, 4), ("t-002", 0, 5), ("t-002", 5, 8),
    ]
    first = index["shards"][0]
    assert first["url"] == f"{queue_url}/out/t-001/11/shard-00000.safetensors"
    assert set(first) == {"url", "bytes", "crc32c", "task", "sample_start", "sample_end", "samples", "tokens"}


def test_merge_tool_writes_the_index_under_a_local_queue(tmp_path: Path):
    queue = tmp_path / "queue"
    store = open_store(str(queue))
    _write_markers(store, store.root_url)
    result = subprocess.run([sys.executable, "tools/merge.py", str(queue)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "tasks=3 shards=3 samples=12 tokens=84" in result.stderr
    _check(json.loads(store.read("index.json").data), store.root_url)


def test_merge_tool_reads_done_markers_from_gcs(gcs_bucket: str, gcs_client, tmp_path: Path):
    url = f"gs://{gcs_bucket}/jobs/j1"
    store = open_store(url, client=gcs_client)
    _write_markers(store, url)
    out = tmp_path / "index.json"
    result = subprocess.run([sys.executable, "tools/merge.py", url, "-o", str(out)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    _check(json.loads(out.read_text()), url)
    with pytest.raises(Exception, match="index.json"):
        store.read("index.json")  # -o wrote a local file, not the bucket


def test_index_spans_more_than_one_listing_page(tmp_path: Path):
    store = open_store(str(tmp_path / "queue"))
    count = 1003
    for i in range(count):
        store.create(f"done/t{i:05d}.json", json.dumps(_marker(store.root_url, f"t{i:05d}", [2])).encode())
    index = jobindex.build_index(store)
    assert index["totals"]["tasks"] == count and index["totals"]["samples"] == 2 * count
    assert index["shards"][-1]["task"] == f"t{count - 1:05d}"


def test_overlapping_shards_in_one_task_are_refused_naming_both(tmp_path: Path):
    store = open_store(str(tmp_path / "queue"))
    marker = _marker(store.root_url, "t-9", [4, 4], resend_last=False)
    marker["outputs"][1]["sample_start"] = 2
    store.create("done/t-9.json", json.dumps(marker).encode())
    with pytest.raises(jobindex.JobIndexError, match=r"done/t-9.json.*shard-00000.*shard-00001.*overlapping"):
        jobindex.build_index(store)


def test_one_shard_described_two_ways_is_refused(tmp_path: Path):
    store = open_store(str(tmp_path / "queue"))
    marker = _marker(store.root_url, "t-5", [4, 4])
    marker["outputs"][-1]["bytes"] += 1
    store.create("done/t-5.json", json.dumps(marker).encode())
    with pytest.raises(jobindex.JobIndexError, match=r"done/t-5.json.*outputs\[2\] describes shard .*shard-00001.* differently"):
        jobindex.build_index(store)


def test_malformed_record_is_named(tmp_path: Path):
    store = open_store(str(tmp_path / "queue"))
    marker = _marker(store.root_url, "t-1", [3])
    del marker["outputs"][0]["tokens"]
    store.create("done/t-1.json", json.dumps(marker).encode())
    with pytest.raises(jobindex.JobIndexError, match=r"done/t-1.json.*outputs\[0\] field 'tokens' must be int, got None"):
        jobindex.build_index(store)

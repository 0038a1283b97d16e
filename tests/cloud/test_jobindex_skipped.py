"""reporting.jobindex with records of skipped rows: counters are summed once per shard, listed rows are kept."""

from __future__ import annotations

import json

import pytest

from reporting import jobindex
from objectstore import open_store


def record(task: str, k: int, start: int, end: int, skipped_ids: list[int], **extra) -> dict:
    out = {
        "shard": f"/q/out/{task}/1/shard-{k}.safetensors", "bytes": 10, "crc32c": "AAAAAA==",
        "sample_start": start, "sample_end": end, "samples": end - start - len(skipped_ids), "tokens": 3, **extra,
    }  # fmt: skip
    if skipped_ids:
        out["counters"] = {"skipped_rows": len(skipped_ids)}
        out["skipped"] = [{"sample_id": i, "file": "f.parquet", "row": i, "reason": "null", "detail": "x"} for i in skipped_ids]
    return out


def test_skipped_rows_are_summed_once_per_shard_and_listed_by_task(tmp_path):
    store = open_store(str(tmp_path / "queue"))
    first = record("t-1", 0, 0, 4, [1, 2])
    outputs = [first, record("t-1", 1, 4, 8, []), dict(first)]  # the first record re-sent: it counts once
    store.create("done/t-1.json", json.dumps({"task": "t-1", "outputs": outputs}).encode())
    store.create("done/t-0.json", json.dumps({"task": "t-0", "outputs": [record("t-0", 0, 0, 2, [0, 1])]}).encode())
    index = jobindex.build_index(store)
    assert index["totals"]["skipped_rows"] == 4 and index["totals"]["samples"] == 0 + 2 + 4
    assert [(e["task"], e["sample_id"]) for e in index["skipped"]] == [("t-0", 0), ("t-0", 1), ("t-1", 1), ("t-1", 2)]


def test_a_clean_job_has_no_skipped_rows_total(tmp_path):
    store = open_store(str(tmp_path / "queue"))
    store.create("done/t-0.json", json.dumps({"task": "t-0", "outputs": [record("t-0", 0, 0, 2, [])]}).encode())
    index = jobindex.build_index(store)
    assert "skipped_rows" not in index["totals"] and index["skipped"] == []


def test_malformed_counters_name_the_marker_and_the_record(tmp_path):
    store = open_store(str(tmp_path / "queue"))
    bad = {**record("t-0", 0, 0, 2, [1]), "counters": {"skipped_rows": "one"}}
    store.create("done/t-0.json", json.dumps({"task": "t-0", "outputs": [bad]}).encode())
    with pytest.raises(jobindex.JobIndexError, match=r"done/t-0.json'?: outputs\[0\] field 'counters'"):
        jobindex.build_index(store)

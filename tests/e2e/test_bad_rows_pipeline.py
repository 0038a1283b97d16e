"""Bad rows through the whole pipeline: spawn.py workers run consume.py over files with bad rows; the tasks
finish, and status and merge report the job's skipped rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from objectstore import open_store
from taskqueue import layout
from tests.e2e.conftest import CONSUMER, make_job, plan_and_submit
from tests.extract_pipeline.test_bad_rows import write_invalid_utf8_parquet
from tests.workers import REPO, Workers, markers

MIXED = [b"first good row", None, b"caf\xe9", b"good three", b"good four", None]  # bad: ids 1, 2, 5
ALL_BAD = [None, b"\xff", None, b"\xc3"]  # ids 6..9: a task of which every row is bad


def run_tool(*args: str) -> subprocess.CompletedProcess:
    # PYTHONPATH: a script under tools/ must import this checkout's packages, not an installed copy's.
    result = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert result.returncode == 0, f"{args[0]} failed:\n{result.stdout}\n{result.stderr}"
    return result


def test_tasks_with_bad_rows_finish_and_status_and_merge_count_the_skipped_rows(tmp_path, tiny_model):
    from activations.reader import open_activations

    data = [
        write_invalid_utf8_parquet(tmp_path / "a-mixed.parquet", MIXED),
        write_invalid_utf8_parquet(tmp_path / "b-all-bad.parquet", ALL_BAD),
    ]
    queue = str(tmp_path / "queue")
    job_file = make_job(tmp_path, tiny_model, [str(p) for p in data])
    tasks = plan_and_submit(queue, job_file, rows_per_task=len(MIXED))
    assert [t["files"][0]["path"] for t in tasks] == [str(p) for p in data]
    workers = Workers(queue, tmp_path)
    try:
        workers.start("w", "--idle-timeout", "10", consumer=CONSUMER)
        assert workers.wait(timeout=400) == {"w": 0}, workers.log("w")
    finally:
        workers.kill_all()

    done = markers(queue, layout.DONE)
    assert sorted(done) == sorted(t["id"] for t in tasks) and not markers(queue, layout.FAILED)
    all_bad = done[tasks[1]["id"]]
    mixed_acts, empty = (open_activations(os.path.join(queue, layout.done_object(t["id"]))) for t in tasks)
    assert sorted(s.sample_id for s in mixed_acts.samples()) == [0, 3, 4]
    assert empty.num_samples == 0 and list(empty.samples()) == []
    assert sum(r["samples"] for r in all_bad["outputs"]) == 0
    assert {e["sample_id"] for r in all_bad["outputs"] for e in r["skipped"]} == {6, 7, 8, 9}

    view = json.loads(run_tool("tools/status.py", queue, "--json").stdout)
    assert view["complete"] and view["counters"] == {"skipped_rows": 7}
    assert "counted skipped_rows=7" in run_tool("tools/status.py", queue).stdout

    merged = run_tool("tools/merge.py", queue)
    assert "skipped_rows=7" in merged.stderr
    index = json.loads(open_store(queue).read("index.json").data)
    assert index["totals"]["samples"] == 3 and index["totals"]["skipped_rows"] == 7
    assert [(e["task"], e["sample_id"], e["reason"]) for e in index["skipped"]] == [
        (tasks[0]["id"], 1, "null"), (tasks[0]["id"], 2, "invalid_utf8"), (tasks[0]["id"], 5, "null"),
        (tasks[1]["id"], 6, "null"), (tasks[1]["id"], 7, "invalid_utf8"), (tasks[1]["id"], 8, "null"),
        (tasks[1]["id"], 9, "invalid_utf8"),
    ]  # fmt: skip

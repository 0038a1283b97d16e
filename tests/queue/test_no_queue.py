"""A queue is where its job is (docs/PROTOCOL.md): a worker pointed at a prefix with no job.json never
takes it for drained and writes nothing there; one started before its submit waits for it; a bucket
that does not exist is one line naming it, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from objectstore import open_store
from tests.queue.conftest import submit_tasks
from tests.workers import REPO


def _spawn(url: str, *flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "spawn.py", url, "--consumer", "true", "--preemption-watch", "off", "--poll", "0.05",
         "--idle-timeout", "1", *flags],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_a_prefix_without_a_job_is_never_drained_and_gets_no_queue_object(tmp_path):
    """`spawn.py --consumer true EMPTY_DIR` used to exit 0 `reason=drained` in under a second, having
    written a swept marker: a typo in the queue prefix looked like a finished job."""
    url = str(tmp_path / "jobs" / "j1x")
    result = _spawn(url, "--job-wait", "0.2")
    assert result.returncode == 65, result.stderr
    assert f"spawn.py: no job at {open_store(url).root_url}: check the queue URL" in result.stderr
    assert "reason=drained" not in result.stderr and "Traceback" not in result.stderr
    assert open_store(url).list_page("").entries == []  # no swept marker, no lease: nothing


def test_a_worker_started_before_its_submit_waits_for_the_job_then_drains_it(tmp_path):
    url = str(tmp_path / "queue")
    submitter = threading.Timer(1.5, lambda: submit_tasks(url, [{"id": "t1"}, {"id": "t2"}]))
    submitter.start()
    started = time.monotonic()
    try:
        result = _spawn(url, "--job-wait", "30")
    finally:
        submitter.join()
    assert result.returncode == 0, result.stderr
    assert "event=waiting_for_job" in result.stderr and "reason=drained" in result.stderr
    assert time.monotonic() - started >= 1.5
    store = open_store(url)
    assert sorted(e.name for e in store.list_page("done/").entries) == ["done/t1.json", "done/t2.json"]


def test_a_missing_bucket_is_one_line_naming_it_and_no_traceback(gcs_client):
    url = "gs://no-such-bucket-h36/jobs/j1"
    result = _spawn(url, "--job-wait", "30")  # no wait: a bucket never appears by itself
    assert result.returncode == 65, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("spawn.py:")]
    assert lines == [f"spawn.py: bucket gs://no-such-bucket-h36 does not exist: check the queue URL {url} "
                     f"(spawn-queue, --queue)"]  # fmt: skip
    assert "Traceback" not in result.stderr and "event=waiting_for_job" not in result.stderr


def test_a_job_whose_tasks_are_all_finished_is_drained_at_once(tmp_path):
    url = str(tmp_path / "queue")
    submit_tasks(url, [{"id": "t1"}])
    first = _spawn(url)
    assert first.returncode == 0 and "reason=drained" in first.stderr
    started = time.monotonic()
    again = _spawn(url)  # nothing left: drained without waiting (job and task are there)
    assert again.returncode == 0 and "reason=drained" in again.stderr
    assert time.monotonic() - started < 20 and "event=waiting_for_job" not in again.stderr
    assert json.loads(open_store(url).read("done/t1.json").data)["task"] == "t1"


def test_a_job_gone_after_start_is_an_error_naming_it_never_an_empty_job(tmp_path):
    """What the spawner and a slice follower hand their consumer (`completion.read_job`): job.json as
    submitted, and, were it deleted under a running worker, an error naming it. An empty `{}` job would
    dead-letter the task for a fault that is not the task's."""
    from taskqueue.completion import QueueMissing, read_job

    url = str(tmp_path / "queue")
    submit_tasks(url, [{"id": "t1"}])
    store = open_store(url)
    assert json.loads(read_job(store)) == json.loads(store.read("job.json").data)
    store.delete("job.json")
    with pytest.raises(QueueMissing) as err:
        read_job(store)
    assert f"{store.url('job.json')} is missing" in str(err.value) and "gcs-spawner submit" in str(err.value)

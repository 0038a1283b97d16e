"""A queue is where its job is (docs/PROTOCOL.md): a worker pointed at a prefix with no job.json never
takes it for drained and writes nothing there; one started before its submit waits for it; a bucket
that does not exist is one line naming it, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
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
    """The submit comes once the worker has said it waits for the job (ordered by that event, not by a
    timer: a timer raced the worker's start on a loaded machine and submitted before it looked)."""
    url = str(tmp_path / "queue")
    worker = subprocess.Popen(
        [sys.executable, "spawn.py", url, "--consumer", "true", "--preemption-watch", "off", "--poll", "0.05",
         "--idle-timeout", "1", "--job-wait", "60"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        for line in worker.stderr:
            lines.append(line)
            if "event=waiting_for_job" in line:
                submit_tasks(url, [{"id": "t1"}, {"id": "t2"}])
                break
        lines += worker.stderr.readlines()
        assert worker.wait(timeout=60) == 0, "".join(lines)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    log = "".join(lines)
    assert "event=waiting_for_job" in log and "reason=drained" in log, log
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

def test_a_worker_refused_by_the_store_says_so_in_one_line_naming_permission_object_and_account(gcs, gcs_client, gcs_bucket):
    """A service account without storage roles on the queue: every request is a 403. The worker says
    it in one line (the permission, the object, the account), without a traceback, and exits 65, which
    its unit does not restart (it died five times with a 65-line Forbidden traceback, issue 48)."""
    from tests.fakegcs.server import CALLER

    gcs.faults.fail_fraction(1.0, 403)
    url = f"gs://{gcs_bucket}/jobs/j1"
    result = _spawn(url, "--job-wait", "30")
    assert result.returncode == 65, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("spawn.py:")]
    assert lines == [f"spawn.py: permission denied: {CALLER} lacks storage.objects.get on gs://{gcs_bucket}/jobs/j1/job.json: "
                     f"grant it a role with that permission on the queue's bucket (roles/storage.objectUser; "
                     f"docs/CLOUD.md, IAM and scopes)"], result.stderr  # fmt: skip
    assert "Traceback" not in result.stderr

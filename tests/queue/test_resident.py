"""Resident consumers (docs/PROTOCOL.md, "Resident consumers"): one consumer process serving a worker's tasks,
under real `spawn.py --resident` workers, the queue tests' consumer speaking the protocol, and real signals."""

from __future__ import annotations

import os
import re
import signal

from taskqueue import layout
from tests.queue.conftest import assert_outputs_exact, submit_tasks
from tests.workers import lease_body, markers, wait_for

RESIDENT = ("--resident", "--idle-timeout", "1")


def pids(done: dict) -> set[int]:
    return {record["pid"] for marker in done.values() for record in marker["outputs"]}


def test_one_resident_consumer_serves_every_task_of_its_worker(local_queue_url, local_workers):
    submit_tasks(local_queue_url, [{"id": f"t{k}", "outputs": 2} for k in range(6)])
    local_workers.start("w", *RESIDENT)
    assert local_workers.wait(timeout=60) == {"w": 0}
    done = markers(local_queue_url, layout.DONE)
    assert sorted(done) == [f"t{k}" for k in range(6)]
    assert_outputs_exact(local_queue_url, done, 2)
    assert len(pids(done)) == 1, "every task's outputs come from one process"
    log = local_workers.log("w")
    assert log.count("event=resident_start") == 1
    # Each task had its own lease and token: its outputs are under its own token's prefix.
    assert {marker["fencing_token"] for marker in done.values()} and all(
        f"/out/{task}/{marker['fencing_token']}/" in marker["outputs"][0]["output"] for task, marker in done.items()
    )
    assert "event=resident_exit exit_code=0" in log  # end of input at the worker's exit: a clean leave


def test_bad_input_task_is_dead_lettered_and_the_resident_consumer_serves_on(local_queue_url, local_workers):
    submit_tasks(local_queue_url, [{"id": "a"}, {"id": "bad", "exit": 65}, {"id": "c"}, {"id": "d"}])
    local_workers.start("w", *RESIDENT)
    assert local_workers.wait(timeout=60) == {"w": 0}
    assert sorted(markers(local_queue_url, layout.DONE)) == ["a", "c", "d"]
    failed = markers(local_queue_url, layout.FAILED)
    assert list(failed) == ["bad"] and "bad input" in failed["bad"]["reason"]
    assert local_workers.log("w").count("event=resident_start") == 1


def test_failed_attempt_restarts_the_resident_consumer_and_the_retry_succeeds(local_queue_url, local_workers):
    submit_tasks(local_queue_url, [{"id": "flaky", "fail_attempts": 1, "outputs": 2}])
    local_workers.start("w", *RESIDENT)
    assert local_workers.wait(timeout=60) == {"w": 0}
    done = markers(local_queue_url, layout.DONE)
    assert list(done) == ["flaky"]
    assert [e["exit_code"] for e in lease_body(local_queue_url, "flaky")["errors"]] == [1]
    log = local_workers.log("w")
    assert log.count("event=resident_start") == 2, "exit 1 leaves the loaded state suspect: a fresh process"
    assert "why=its state is not sound" in log


def test_resident_consumer_dying_without_a_reply_fails_the_attempt_not_other_tasks(local_queue_url, local_workers):
    # A process that exits 0 without a reply has not done the task: a failed attempt (70), never a success.
    submit_tasks(local_queue_url, [{"id": "dies", "die": 0}, {"id": "ok1"}, {"id": "ok2"}])
    local_workers.start("w", *RESIDENT, "--max-attempts", "2")
    assert local_workers.wait(timeout=60) == {"w": 0}
    assert sorted(markers(local_queue_url, layout.DONE)) == ["ok1", "ok2"]
    failed = markers(local_queue_url, layout.FAILED)
    assert list(failed) == ["dies"]
    assert [a["exit_code"] for a in failed["dies"]["errors"]] == [70, 70]
    assert "failed 2 attempts" in failed["dies"]["reason"]


def test_sigterm_stops_the_resident_consumer_and_releases_the_task(local_queue_url, local_workers):
    submit_tasks(local_queue_url, [{"id": "long", "outputs": 40, "sleep": 0.2}])
    worker = local_workers.start("w", *RESIDENT, "--heartbeat", "0.5")
    wait_for(lambda: (lease_body(local_queue_url, "long") or {}).get("progress"), 30, "a first committed output")
    pid = int(re.search(r"event=resident_start pid=(\d+)", local_workers.log("w")).group(1))
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert lease_body(local_queue_url, "long")["state"] == "released"
    assert markers(local_queue_url, layout.DONE) == {}
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
    assert re.search(r"event=resident_exit task=long exit_code=-15 why=stopping", local_workers.log("w"))


def test_every_line_protocol_refuses_a_line_by_the_one_rule_naming_its_own_object():
    # Progress lines, resident replies and resident requests: one parse (jsonline), each protocol's own error type.
    import pytest

    from extract.resident import MAX_REQUEST, ProtocolError, parse_request
    from taskqueue.process import MAX_REPLY_LINE, ReplyError, parse_reply
    from taskqueue.spawner import MAX_PROGRESS_LINE, ProgressError, ProgressFile

    def progress(tmp: bytes):
        import pathlib
        import tempfile

        path = pathlib.Path(tempfile.mkdtemp()) / "progress.jsonl"
        path.write_bytes(tmp + b"\n")
        return ProgressFile(path).new_records()

    cases = [(parse_reply, ReplyError, "reply", MAX_REPLY_LINE),
             (lambda line: parse_request(line, 0.0), ProtocolError, "request", MAX_REQUEST),
             (progress, ProgressError, "progress line", MAX_PROGRESS_LINE)]  # fmt: skip
    for parse, error, what, limit in cases:
        for line, problem in ((b"[1, 2]", "is not a JSON object"), (b"{oops", "is not JSON"),
                              (b"{" + b" " * limit + b"}", f"over {limit}")):  # fmt: skip
            with pytest.raises(error, match=problem) as caught:
                parse(line)
            assert what in str(caught.value)

"""The slice protocol at queue level, with the queue tests' consumer (no JAX): fast, and it pins the contract
of docs/PROTOCOL.md "Slices" (who writes the assignment, when a follower may start, when it must stop)."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from objectstore import open_store
from taskqueue import layout
from taskqueue.clock import Clock
from taskqueue.slice import ASSIGNED, AssignmentBoard, SliceConflict, SliceOptions, assignment_object
from taskqueue.submit import submit
from tests.workers import Workers, lease_body, markers, wait_for

SLICE_FLAGS = ("--slice-id", "s1", "--slice-hosts", "2", "--coordinator", "127.0.0.1:1")


def queue_with(tmp_path, tasks: list[dict]) -> str:
    url = str(tmp_path / "queue")
    submit(open_store(url), b"{}", [(t["id"], json.dumps(t).encode()) for t in tasks])
    return url


def test_follower_runs_each_task_the_leader_holds_and_exits_with_it(tmp_path):
    url = queue_with(tmp_path, [{"id": f"t{i}", "outputs": 2, "sleep": 0.3} for i in range(3)])
    workers = Workers(url, tmp_path)
    try:
        workers.start("leader", *SLICE_FLAGS, "--host-index", "0")
        workers.start("follower", *SLICE_FLAGS, "--host-index", "1")
        codes = workers.wait(timeout=60)
    finally:
        workers.kill_all()
    assert codes == {"leader": 0, "follower": 0}, workers.all_logs()
    assert sorted(markers(url, layout.DONE)) == ["t0", "t1", "t2"]
    follower = workers.log("follower")
    started = re.findall(r"event=follower_consumer_start task=(\S+)", follower)
    assert sorted(started) == ["t0", "t1", "t2"]  # one run per claim, never a task twice
    assert "reason=leader_exit" in follower
    # The consumer saw its role in the slice.
    assert all(m["worker"] == "leader" for m in markers(url, layout.DONE).values())


def test_follower_never_starts_an_assignment_whose_lease_the_leader_does_not_hold(tmp_path):
    url = queue_with(tmp_path, [{"id": "t0", "outputs": 1}])
    store = open_store(url)
    # An assignment naming a claim (nonce) that no lease carries: a stale or forged one.
    store.create(
        assignment_object("s1"),
        json.dumps({"state": ASSIGNED, "task": "t0", "fencing_token": 7, "nonce": "not-the-lease", "leader": "ghost",
                    "attempt": 1, "manifest": {"id": "t0"}, "resume": {"progress": []}, "output": url}).encode(),
    )  # fmt: skip
    workers = Workers(url, tmp_path)
    try:
        workers.start("follower", *SLICE_FLAGS, "--host-index", "1", "--idle-timeout", "0.5")
        time.sleep(2)  # a window of many polls in which nothing may start: that none does is the behaviour
        assert "event=follower_consumer_start" not in workers.log("follower")
    finally:
        workers.kill_all()


@pytest.mark.parametrize("resident", [False, True], ids=["per-task", "resident"])
def test_follower_stops_its_consumer_once_the_leaders_lease_is_taken_over(tmp_path, resident):
    url = queue_with(tmp_path, [{"id": "t0", "outputs": 40, "sleep": 0.25}])
    flags = [*SLICE_FLAGS, *(["--resident"] if resident else []), "--lease-ttl", "3", "--heartbeat", "0.5"]
    workers = Workers(url, tmp_path)
    try:
        workers.start("leader", *flags, "--host-index", "0")
        workers.start("follower", *flags, "--host-index", "1")
        wait_for(lambda: "event=follower_consumer_start" in workers.log("follower"), 30, "the follower's consumer")
        workers.procs["leader"].send_signal(signal.SIGKILL)  # a frozen or dead leader: its lease goes silent
        workers.start("other", "--lease-ttl", "3", "--idle-timeout", "30")
        wait_for(lambda: (lease_body(url, "t0") or {}).get("worker") == "other", 30, "the steal")
        stopped_at = time.monotonic()
        wait_for(lambda: "event=follower_stop task=t0" in workers.log("follower"), 10, "the follower stopping")
        # watch_s = min(5, heartbeat / 2): it notices within one watch interval of the steal.
        assert time.monotonic() - stopped_at < 0.25 + 2
        wait_for(lambda: "event=follower_consumer_exit task=t0" in workers.log("follower"), 10, "the consumer's exit")
    finally:
        workers.kill_all()
    if resident:
        follower = workers.log("follower")
        assert "event=follower_resident_exit task=t0" in follower and "why='it was stopped'" in follower


def test_a_second_leader_of_the_same_slice_is_refused(tmp_path):
    store = open_store(str(tmp_path / "queue"))
    options = SliceOptions(slice_id="s1", hosts=4, host_index=0, coordinator="10.0.0.2:8476")
    first = AssignmentBoard(store, options, "leader-a", Clock())
    second = AssignmentBoard(store, options, "leader-b", Clock())
    first.close("drained")
    second.close("drained")  # reads the current generation when it starts
    with pytest.raises(SliceConflict, match="another process leading slice s1"):
        first.close("drained")
    entry = next(iter(store.list("slices/")))
    assert entry.metadata == {"state": "closed", "leader": "leader-b", "hosts": "4"}


@pytest.mark.parametrize(
    "flags, problem",
    [
        (("--slice-hosts", "2", "--coordinator", "h:1"), "--slice-id"),
        (("--slice-hosts", "2", "--slice-id", "s", "--coordinator", "h:1", "--host-index", "2"), "--host-index"),
        (("--slice-hosts", "2", "--slice-id", "s", "--coordinator", "nohostport"), "--coordinator"),
    ],
)
def test_bad_slice_options_are_refused_naming_the_option(flags, problem, tmp_path):
    import subprocess
    import sys

    from tests.workers import REPO

    result = subprocess.run([sys.executable, "spawn.py", str(tmp_path), "--consumer", "true", *flags], cwd=REPO,
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and problem in result.stderr, result.stderr


@pytest.mark.parametrize("resident", [(), ("--resident",)], ids=["per-task", "resident"])
def test_a_slice_host_stopped_by_sigterm_releases_the_task_without_counting_an_attempt(tmp_path, resident):
    # 143 = 128 + SIGTERM: what every host of a slice exits with (a resident one: replies) once one of them was
    # stopped (preempted).
    url = queue_with(tmp_path, [{"id": "t0", "exit": 143}])
    workers = Workers(url, tmp_path)
    try:
        workers.start("leader", *SLICE_FLAGS, "--host-index", "0", "--max-tasks", "1", *resident)
        wait_for(lambda: "event=released task=t0" in workers.log("leader"), 30, "the release")
    finally:
        workers.kill_all()
    assert "a slice host was stopped" in workers.log("leader")
    lease = lease_body(url, "t0")
    assert lease["state"] == "released" and lease["errors"] == []


def test_status_shows_a_slice_as_one_worker_with_its_host_count(tmp_path):
    from reporting import status

    url = queue_with(tmp_path, [{"id": "t0", "outputs": 20, "sleep": 0.2}])
    workers = Workers(url, tmp_path)
    try:
        workers.start("leader", *SLICE_FLAGS, "--host-index", "0")
        workers.start("follower", *SLICE_FLAGS, "--host-index", "1")
        wait_for(lambda: "event=follower_consumer_start" in workers.log("follower"), 30, "the follower's consumer")
        view = status.snapshot(open_store(url))
    finally:
        workers.kill_all()
    assert view["holders"] == {"leader": 1} and view["slice_hosts"] == {"leader": 2}
    assert "holders 1 workers hold 1 leases: leader (2 hosts)=1" in status.render(view)


# -- resident slices (docs/PROTOCOL.md, "Slices": resident consumers) ------------------------------------------------


def drain_resident_slice(url: str, tmp_path) -> Workers:
    """A leader and a follower with --resident, run until the queue is drained; both exit 0."""
    workers = Workers(url, tmp_path)
    try:
        workers.start("leader", *SLICE_FLAGS, "--host-index", "0", "--resident")
        workers.start("follower", *SLICE_FLAGS, "--host-index", "1", "--resident")
        codes = workers.wait(timeout=60)
    finally:
        workers.kill_all()
    assert codes == {"leader": 0, "follower": 0}, workers.all_logs()
    return workers


def test_resident_slice_serves_every_task_with_one_consumer_per_host(tmp_path):
    url = queue_with(tmp_path, [{"id": f"t{i}", "outputs": 2, "sleep": 0.1} for i in range(4)])
    workers = drain_resident_slice(url, tmp_path)
    done = markers(url, layout.DONE)
    assert sorted(done) == ["t0", "t1", "t2", "t3"]
    assert len({record["pid"] for marker in done.values() for record in marker["outputs"]}) == 1
    leader, follower = workers.log("leader"), workers.log("follower")
    assert leader.count("event=resident_start") == 1
    assert follower.count("event=follower_resident_start") == 1
    # The follower's one consumer served each task once, in the leader's program.
    served = re.findall(r"event=follower_consumer_start task=(\S+) token=\S+ pid=(\d+) resident=true program=(\S+)", follower)
    assert sorted(task for task, _, _ in served) == ["t0", "t1", "t2", "t3"]
    assert len({pid for _, pid, _ in served}) == 1 and {program for _, _, program in served} == {"leader.1"}
    assert "stays=True" in follower and "event=follower_stop " not in follower
    assert "reason=leader_exit" in follower


def test_resident_slice_starts_a_new_program_on_every_host_after_a_failed_task(tmp_path):
    url = queue_with(tmp_path, [{"id": "a", "outputs": 1}, {"id": "flaky", "fail_attempts": 1}, {"id": "c"}])
    workers = drain_resident_slice(url, tmp_path)
    assert sorted(markers(url, layout.DONE)) == ["a", "c", "flaky"]
    leader, follower = workers.log("leader"), workers.log("follower")
    assert leader.count("event=resident_start") == 2
    # The follower's consumer of the first program is closed, one of the second serves the rest.
    programs = re.findall(r"event=follower_resident_start pid=\d+ program=(\S+)", follower)
    assert programs == ["leader.1", "leader.2"], follower
    # Its consumer of the first program was closed before the second started: after its part of the failed task, or
    # (a queue-test consumer does not wait for its hosts: the follower may see the next assignment first) on seeing
    # the new program.
    between = follower[follower.index("program=leader.1"):follower.index("program=leader.2")]
    assert "event=follower_resident_exit" in between, follower

"""The worker core (taskqueue.worker.TaskRun) on its own, and the stuck-task backstop with real processes."""

from __future__ import annotations

import json
import signal

import pytest
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exceptions

from objectstore import StoreUnavailable, open_store
from objectstore.local import LocalStore
from taskqueue import layout
from taskqueue.clock import Clock
from taskqueue.lease import HeldLease, LeaseLost, encode, new_lease_body
from taskqueue.worker import (
    CONSUMER_STAYS,
    ON_EXIT,
    Abandon,
    Complete,
    DeadLetter,
    Phase,
    Release,
    RunOptions,
    Signal,
    Tally,
    TaskRun,
    exit_class,
    perform_final,
    resident_exit_code,
)
from tests.queue.conftest import submit_tasks
from tests.workers import Workers, markers

TTL = 60.0
OPTIONS = RunOptions(lease_ttl_s=TTL, heartbeat_s=15.0, max_attempts=3, worker="w", stuck_after_s=100.0, max_task_s=1000.0)
ERROR = {"attempt": 1, "worker": "w", "exit_code": None, "error": "tail"}


def a_run(attempt: int = 1, options: RunOptions = OPTIONS) -> TaskRun:
    return TaskRun("t1", attempt, options, now=0.0, tally=Tally())


def test_progress_stays_pending_until_a_renewal_that_carried_it_succeeded():
    run = a_run()
    run.progress([{"i": 0}, {"i": 1}], now=1.0)
    first = run.heartbeat()
    assert run.renewal_failed(StoreUnavailable("503 past the deadline"), now=2.0) == []
    run.progress([{"i": 2}], now=3.0)
    second = run.heartbeat()
    assert second.records == ({"i": 0}, {"i": 1}, {"i": 2})  # the failed beat's records go again
    run.renewed(second, now=4.0)
    assert run.pending == [] and first.records == ({"i": 0}, {"i": 1})
    run.progress([{"i": 3}], now=5.0)
    assert run.exited(0, ERROR) == Complete(({"i": 3},))  # the completion carries what is still pending


@pytest.mark.parametrize(
    "error",
    [StoreUnavailable("503s"), gexc.Forbidden("403 on the lease"), auth_exceptions.RefreshError("expired"), RuntimeError("bug")],
)
def test_any_failed_renewal_keeps_the_task_until_a_ttl_then_gives_the_lease_up(error):
    run = a_run()
    run.renewed(run.heartbeat(), now=10.0)
    assert run.renewal_failed(error, now=10.0 + TTL - 1) == [] and run.phase is Phase.RUNNING
    assert run.renewal_failed(error, now=10.0 + TTL) == [Signal(signal.SIGKILL)]
    assert run.phase is Phase.LOST and run.heartbeat() is None
    assert isinstance(run.exited(-9, ERROR), Abandon)  # commit nothing: the lease may be someone else's


def test_lease_lost_kills_the_consumer_at_once_and_writes_nothing():
    run = a_run()
    assert run.renewal_failed(LeaseLost("412"), now=1.0) == [Signal(signal.SIGKILL)]
    assert isinstance(run.exited(0, ERROR), Abandon)  # even a clean exit: its outputs are abandoned


#: The exit table written out again, cell by cell, from docs/PROTOCOL.md ("Completion", "Failure",
#: "Release", "Slices"), not read from taskqueue.worker.ON_EXIT: (phase, exit code) -> what is written.
#: 143 is a slice leader's consumer's exit when another host was stopped (128 + SIGTERM).
EXIT_CELLS = [
    ("running", 0, "complete"),
    ("running", 65, "dead_letter"),
    ("running", 1, "attempt_failed"),
    ("running", 143, "release"),  # a slice host was stopped: not the task's fault
    ("stuck", 0, "complete"),  # it finished as the backstop fired: the work is done
    ("stuck", 65, "dead_letter"),
    ("stuck", 1, "attempt_failed"),
    ("stuck", 143, "attempt_failed"),  # stopped by the backstop, not by a host's stop
    ("stopping", 0, "release"),  # even a clean exit after SIGTERM: its last records may be missing
    ("stopping", 65, "release"),
    ("stopping", 1, "release"),
    ("stopping", 143, "release"),
]
SLICE_LEADER = RunOptions(lease_ttl_s=TTL, heartbeat_s=15.0, max_attempts=3, worker="w", is_slice_leader=True,
                          stuck_after_s=100.0, max_task_s=1000.0)  # fmt: skip


def test_the_exit_cells_are_every_cell_of_the_table():
    assert {(Phase(phase), exit_class(code, True)) for phase, code, _ in EXIT_CELLS} == set(ON_EXIT)
    assert len(EXIT_CELLS) == len(ON_EXIT) == 12


@pytest.mark.parametrize("attempt", [1, 3], ids=["first-attempt", "last-attempt"])
@pytest.mark.parametrize(("phase", "exit_code", "decision"), EXIT_CELLS, ids=[f"{p}-{c}" for p, c, _ in EXIT_CELLS])
def test_each_cell_of_the_exit_table(phase, exit_code, decision, attempt):
    """Every (phase, exit) cell, at a first and at a last allowed attempt: what is written, with which
    records, and whether it counts as an attempt."""
    run = TaskRun("t1", attempt, SLICE_LEADER, now=0.0, tally=Tally())
    run.progress([{"i": 0}], now=1.0)  # pending: whatever is written carries it
    if phase == "stuck":
        assert run.tick(now=101.0) == [Signal(signal.SIGTERM)] and run.phase is Phase.STUCK
    elif phase == "stopping":
        assert run.stop("SIGTERM", now=2.0) == [Signal(signal.SIGTERM)] and run.phase is Phase.STOPPING
    action = run.exited(exit_code, ERROR)
    if decision == "complete":
        assert action == Complete(({"i": 0},))
    elif decision == "dead_letter":
        assert isinstance(action, DeadLetter) and action.reason == f"consumer exit {exit_code}: bad input"
        assert action.records == ({"i": 0},) and action.error["attempt"] == ERROR["attempt"]
    elif decision == "release":
        assert isinstance(action, Release) and action.error is None and action.records == ({"i": 0},)
    else:  # attempt_failed: released for another try, or dead-lettered at the last allowed attempt
        assert run.tally.failed_attempts == 1
        if attempt < SLICE_LEADER.max_attempts:
            assert isinstance(action, Release) and action.error is not None and action.records == ({"i": 0},)
        else:
            assert isinstance(action, DeadLetter) and action.reason.startswith(f"failed {attempt} attempts")
        if phase == "stuck":
            assert "no progress record" in action.error["error"] or "max-task-time" in action.error["error"]
    if decision != "attempt_failed":
        assert run.tally.failed_attempts == 0
    assert run.phase is Phase.EXITED


def test_a_claim_answered_a_ttl_after_it_was_sent_starts_no_consumer():
    """Its lease may have been taken over meanwhile (a late answer, a suspended VM): given back, not run."""
    fresh = TaskRun("t1", 1, OPTIONS, now=TTL - 0.5, tally=Tally(), sent=0.0)
    assert fresh.stale(now=TTL - 0.5) is None and fresh.phase is Phase.RUNNING
    late = TaskRun("t1", 1, OPTIONS, now=TTL, tally=Tally(), sent=0.0)
    action = late.stale(now=TTL)
    assert isinstance(action, Release) and action.error is None and late.phase is Phase.EXITED


def test_a_stop_is_escalated_to_sigkill_after_the_grace():
    run = a_run()
    run.stop("preempted", now=10.0)
    assert run.tick(now=14.9) == [] and run.tick(now=15.0) == [Signal(signal.SIGKILL)]
    assert run.tick(now=16.0) == []


def test_the_backstop_stops_a_silent_or_overlong_consumer_as_a_failed_attempt():
    silent = a_run()
    silent.output_line(now=50.0)
    assert silent.tick(now=149.0) == [] and silent.tick(now=150.0) == [Signal(signal.SIGTERM)]
    assert silent.tick(now=155.0) == [Signal(signal.SIGKILL)]
    action = silent.exited(-9, ERROR)
    assert isinstance(action, Release) and "no progress record and no output line" in action.error["error"]
    busy = a_run(attempt=3)
    for t in range(0, 1000, 50):
        busy.progress([{"i": t}], now=float(t))
    assert busy.tick(now=1000.0) == [Signal(signal.SIGTERM)]
    action = busy.exited(143, ERROR)
    assert isinstance(action, DeadLetter) and "max-task-time" in action.error["error"]
    assert silent.tally.stuck == 1


class FailingWrites(LocalStore):
    """A local store whose lease rewrites fail past the retries, as a StoreError or as a 403."""

    def __init__(self, root: str, error: Exception):
        super().__init__(root)
        self.error = error

    def write(self, name, data, if_generation, metadata=None):
        raise self.error


@pytest.mark.parametrize("error", [StoreUnavailable("503 past the deadline"), gexc.Forbidden("403")])
def test_an_outcome_whose_write_failed_is_unconfirmed_and_the_lease_stays_held(tmp_path, error):
    store = FailingWrites(str(tmp_path / "q"), error)
    clock = Clock()
    body = new_lease_body("t1", "w", TTL, clock)
    data, metadata = encode(body)
    lease = HeldLease(store, body, store.create(layout.lease_object("t1"), data, metadata=metadata), clock)
    run = a_run()
    action = run.exited(0, ERROR)
    assert perform_final(lease, action, run.started) == "unconfirmed"
    run.settled(action, "unconfirmed")
    assert run.tally.unconfirmed == 1 and run.tally.done == 0
    # Nothing claims the task finished: no marker, and the lease is still held until it expires.
    assert not list(store.list(layout.DONE))
    assert json.loads(store.read(layout.lease_object("t1")).data)["state"] == "held"
    assert lease.body["state"] == "held"


# Stuck consumers, the stuck-task backstop's subject: one that says nothing for two minutes, one that prints for ever.
SILENT = "python -c 'import time; time.sleep(120)'"
CHATTY = "python -u -c 'import time\nwhile True: print(\"working\"); time.sleep(0.2)'"


@pytest.mark.parametrize(
    ("consumer", "flags", "reason"),
    [
        (SILENT, ("--stuck-after", "1.5"), "no progress record and no output line"),
        (CHATTY, ("--max-task-time", "2"), "over --max-task-time"),
    ],
)
def test_a_stuck_or_overlong_consumer_is_stopped_and_counts_as_a_failed_attempt(tmp_path, consumer, flags, reason):
    url = str(tmp_path / "queue")
    submit_tasks(url, [{"id": "stuck"}])
    workers = Workers(url, tmp_path)
    try:
        workers.start("w", *flags, "--max-attempts", "2", consumer=consumer)
        assert workers.wait(timeout=60) == {"w": 0}
    finally:
        workers.kill_all()
    letter = markers(url, layout.FAILED)["stuck"]
    assert [e["attempt"] for e in letter["errors"]] == [1, 2]
    assert all(reason in e["error"] for e in letter["errors"]), letter
    assert "event=consumer_stuck" in workers.log("w")
    assert not list(open_store(url).list(layout.DONE))


# -- resident consumers (docs/PROTOCOL.md, "Resident consumers") --------------------------------


def a_run_in(phase: Phase) -> TaskRun:
    """A run brought into `phase` by the event that leads there."""
    run = a_run()
    if phase is Phase.STOPPING:
        run.stop("SIGTERM", now=1.0)
    elif phase is Phase.STUCK:
        run.tick(now=101.0)
    elif phase is Phase.LOST:
        run.renewal_failed(LeaseLost("stolen"), now=1.0)
    elif phase is Phase.BROKEN:
        run.broken("not JSON")
    assert run.phase is phase
    return run


def test_the_resident_table_covers_every_phase_a_task_can_end_in():
    ends = {Phase.RUNNING, Phase.STOPPING, Phase.STUCK, Phase.LOST, Phase.BROKEN}
    assert set(CONSUMER_STAYS) == ends
    assert [phase for phase, stays in CONSUMER_STAYS.items() if stays] == [Phase.RUNNING]


@pytest.mark.parametrize("said", [True, False], ids=["says-it-stays", "says-it-leaves"])
@pytest.mark.parametrize("phase", list(CONSUMER_STAYS), ids=lambda p: p.value)
def test_a_resident_consumer_serves_on_only_after_an_undisturbed_task_and_only_if_it_says_so(phase, said):
    """Every other phase signalled the consumer (SIGTERM or SIGKILL): it never gets the next task."""
    assert a_run_in(phase).consumer_stays(said) is (said and phase is Phase.RUNNING)


@pytest.mark.parametrize(
    ("reply", "process", "expected"),
    [
        (0, None, 0), (65, None, 65), (75, None, 75), (143, -15, 143),  # a reply tells
        (None, 1, 1), (None, -9, -9), (None, 143, 143),  # it died on the task: its own exit code, as per task
        (None, 0, 70), (None, 65, 70), (None, None, 70),  # no reply: never a success, never the task's bad input
    ],
)  # fmt: skip
def test_a_resident_tasks_exit_code_comes_from_its_reply_else_from_the_process(reply, process, expected):
    assert resident_exit_code(reply, process) == expected
    # And the table of exits reads it as a per-task consumer's: an exit without a reply is a failed attempt.
    action = a_run().exited(resident_exit_code(reply, process), ERROR)
    if reply is None and process in (0, 65, None):
        assert isinstance(action, Release) and action.error is not None

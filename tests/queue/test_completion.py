"""taskqueue.completion on its own: the completion rule's every clause, and how a worker finds its job.

In-process and on virtual time, so that mutation testing (`make mutants`) reaches every branch of the
module: each clause of `QueueCount.why_not` and each outcome of `find_job`, `wait_for_job` and
`dead_letters_note` is pinned, its words included (they go into log lines and machine records)."""

from __future__ import annotations

import threading

import pytest

from objectstore import NotFound, StoreUnavailable
from objectstore.local import LocalStore
from taskqueue import layout
from taskqueue.clock import Clock
from taskqueue.completion import (
    JOB_POLL_S,
    QueueCount,
    QueueMissing,
    bucket_of,
    dead_letters_note,
    find_job,
    wait_for_job,
)


@pytest.mark.parametrize(
    ("progress", "why"),
    [
        (QueueCount(total=3, unfinished=0, submitting=0), None),
        (QueueCount(total=3, unfinished=0, submitting=2), "2 batch(es) still submitting"),
        (QueueCount(total=3, unfinished=0, submitting=0, steady=False), "a batch changed while the queue was counted"),
        (QueueCount(total=0, unfinished=0, submitting=0), "no task submitted yet"),
        (QueueCount(total=-1, unfinished=0, submitting=0), "no task submitted yet"),
        (QueueCount(total=1, unfinished=0, submitting=0), None),
        (QueueCount(total=3, unfinished=0, submitting=0, counted_all=False), "an estimate counts a sample of the regions"),
        (QueueCount(total=3, unfinished=1, submitting=0), "1 task(s) without a done marker or dead letter"),
        # The first clause that fails is the one said.
        (QueueCount(total=0, unfinished=2, submitting=1, steady=False, counted_all=False), "1 batch(es) still submitting"),
        (QueueCount(total=0, unfinished=2, submitting=0, steady=False, counted_all=False),
         "a batch changed while the queue was counted"),
        (QueueCount(total=0, unfinished=2, submitting=0, counted_all=False), "no task submitted yet"),
        (QueueCount(total=2, unfinished=2, submitting=0, counted_all=False), "an estimate counts a sample of the regions"),
    ],
)
def test_complete_only_when_every_clause_of_the_rule_holds_and_the_first_failing_one_is_said(progress, why):
    assert progress.why_not() == why
    assert progress.complete is (why is None)


def test_a_progress_is_steady_and_counted_whole_unless_told():
    assert QueueCount(total=1, unfinished=0, submitting=0) == QueueCount(1, 0, 0, steady=True, counted_all=True)


def test_bucket_of_a_url():
    assert bucket_of("gs://b/jobs/j1") == "b"  # objectstore.address.bucket_of since issue 46: the bucket's name
    assert bucket_of("gs://b") == "b"
    assert bucket_of("/tmp/q") is None


def test_find_job_says_whether_a_job_and_something_submitted_are_there(tmp_path):
    store = LocalStore(tmp_path / "q")
    assert find_job(store) == (None, False)
    store.create(layout.TASKS + "t1.json", b'{"id": "t1"}')
    assert find_job(store) == (None, True)  # a task without its job is no queue (the caller decides)
    store = LocalStore(tmp_path / "r")
    store.create(layout.JOB, b'{"a": 1}')
    assert find_job(store) == (b'{"a": 1}', False)
    store.create(layout.batch_object("b1"), b"{}", metadata={"state": layout.BATCH_RUNNING})
    assert find_job(store) == (b'{"a": 1}', True)  # a submit under way counts


class Ticking(Clock):
    """Virtual time: a wait moves the clock on and runs what the test scheduled for then."""

    def __init__(self, at: dict[float, object] | None = None) -> None:
        super().__init__()
        self.now, self.at, self.waits = 0.0, dict(at or {}), []

    def monotonic(self) -> float:
        return self.now

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        for when in sorted(t for t in self.at if t <= self.now):
            self.at.pop(when)()
        return stop.is_set()


def test_wait_for_job_returns_the_job_once_it_and_a_task_are_there(tmp_path):
    store = LocalStore(tmp_path / "q")
    clock = Ticking({12.0: lambda: store.create(layout.JOB, b"{}"),
                     23.0: lambda: store.create(layout.TASKS + "t1.json", b'{"id": "t1"}')})  # fmt: skip
    assert wait_for_job(store, 60.0, clock) == b"{}"
    assert 23.0 <= clock.now <= 23.0 + JOB_POLL_S and set(clock.waits) == {JOB_POLL_S}  # a look every JOB_POLL_S


def test_a_queue_already_there_costs_one_look_and_no_wait(tmp_path):
    store = LocalStore(tmp_path / "q")
    store.create(layout.JOB, b"{}")
    store.create(layout.TASKS + "t1.json", b'{"id": "t1"}')
    clock = Ticking()
    assert wait_for_job(store, 0.0, clock) == b"{}" and clock.waits == []


def test_wait_for_job_gives_up_after_its_bound_saying_what_is_missing(tmp_path):
    store = LocalStore(tmp_path / "q")
    clock = Ticking()
    with pytest.raises(QueueMissing, match=r"^no job at .*: check the queue URL \(spawn-queue, --queue\); "
                                           r"gcs-spawner submit writes job.json there first$"):  # fmt: skip
        wait_for_job(store, 8.0, clock)
    assert clock.now == pytest.approx(8.0) and clock.waits == [2.0, 2.0, 2.0, 2.0]  # a short bound looks 4 times
    store.create(layout.JOB, b"{}")
    with pytest.raises(QueueMissing, match=r"^no task at .*: its job.json is there but no task was submitted "
                                           r"\(gcs-spawner submit .* --tasks FILE\)$"):  # fmt: skip
        wait_for_job(store, 0.0, Ticking())


def test_wait_for_job_returns_none_when_stopped_while_waiting(tmp_path):
    store = LocalStore(tmp_path / "q")
    stop = threading.Event()
    clock = Ticking({10.0: stop.set})
    assert wait_for_job(store, 60.0, clock, stop) is None
    assert clock.now == pytest.approx(10.0)


def test_the_dead_letters_note_counts_the_confirmed_swept_markers_failed(tmp_path):
    store = LocalStore(tmp_path / "q")
    assert dead_letters_note(store) == ""
    store.create(layout.SWEPT + "-.json", b"{}", metadata={"tasks": "5", "failed": "0", "confirmed": "1"})
    assert dead_letters_note(store) == ""
    store.create(layout.SWEPT + "m.json", b"{}", metadata={"tasks": "5", "failed": "1", "confirmed": "1"})
    assert dead_letters_note(store) == f" with 1 dead letter (gcs-spawner status {store.root_url} --machines lists them)"
    store.create(layout.SWEPT + "p.json", b"{}", metadata={"tasks": "5", "failed": "2", "confirmed": "1"})
    store.create(layout.SWEPT + "x.json", b"{}", metadata={"tasks": "5", "failed": "7"})  # not confirmed: not counted
    assert dead_letters_note(store) == f" with 3 dead letters (gcs-spawner status {store.root_url} --machines lists them)"


class NoBucket(LocalStore):
    """A store whose bucket does not exist: every read and listing is a 404, as GCS answers."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.root_url = "gs://gone/jobs/j1"

    def list_page(self, prefix, *args, **kwargs):
        raise NotFound(f"bucket gone ({prefix!r})")


class Outage(LocalStore):
    """A store that is unavailable for its first `n` reads of job.json."""

    def __init__(self, path, n: int) -> None:
        super().__init__(path)
        self.n = n

    def read(self, name):
        if name == layout.JOB and self.n > 0:
            self.n -= 1
            raise StoreUnavailable("503")
        return super().read(name)


def test_a_missing_bucket_is_queue_missing_at_once_naming_the_bucket(tmp_path):
    clock = Ticking()
    with pytest.raises(QueueMissing, match=r"^bucket gs://gone does not exist: check the queue URL gs://gone/jobs/j1 "
                                           r"\(spawn-queue, --queue\)$"):  # fmt: skip
        wait_for_job(NoBucket(tmp_path / "q"), 60.0, clock)
    assert clock.waits == []  # no wait: a bucket never appears by itself


def test_an_outage_while_looking_for_the_job_counts_as_waiting(tmp_path):
    store = Outage(tmp_path / "q", n=2)
    store.create(layout.JOB, b"{}")
    store.create(layout.TASKS + "t1.json", b'{"id": "t1"}')
    clock = Ticking()
    assert wait_for_job(store, 60.0, clock) == b"{}"
    assert clock.waits == [JOB_POLL_S, JOB_POLL_S]


def test_the_log_lines_of_a_wait_name_the_queue_and_what_is_missing(tmp_path, caplog):
    """Its log lines are what an operator reads of a worker that waits: pinned, fields included."""
    store = Outage(tmp_path / "q", n=1)
    clock = Ticking({12.0: lambda: store.create(layout.JOB, b"{}")})
    caplog.set_level("INFO", logger="taskqueue.completion")
    with pytest.raises(QueueMissing):
        wait_for_job(store, 0.4, clock)  # a short bound looks every 0.1 s
    assert clock.waits == pytest.approx([0.1, 0.1, 0.1, 0.1])
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == f"event=job_unreadable queue={store.root_url} error=503"
    assert messages[1] == f"event=waiting_for_job queue={store.root_url} job=False left_s=0.4"


def test_a_swept_marker_without_a_failed_count_counts_none_and_an_unreadable_listing_adds_nothing(tmp_path, caplog):
    store = LocalStore(tmp_path / "q")
    store.create(layout.SWEPT + "-.json", b"{}", metadata={"tasks": "5", "confirmed": "1"})
    assert dead_letters_note(store) == ""

    class Down(LocalStore):
        def list_page(self, prefix, *args, **kwargs):
            raise StoreUnavailable("503")

    down = Down(tmp_path / "q")
    assert dead_letters_note(down) == ""
    assert [r.getMessage() for r in caplog.records] == [f"event=dead_letters_uncounted queue={down.root_url} error=503"]

"""taskqueue.submit on its own: the tasks file, the creates, the batch marker's life, its pruning, and
how a batch is finished by hand (docs/PROTOCOL.md, "Submitting", "Batches" and "Regions").

In-process on a local store (wrapped where a failure is needed) and a clock the test sets, so
that mutation testing (`make mutants`) reaches every branch of the module in seconds."""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import hashlib
import json
import locale
import logging
import threading
import time

import pytest

from objectstore import NotFound, PreconditionFailed, StoreUnavailable
from objectstore.local import LocalStore
from taskqueue import layout
from taskqueue.clock import Clock
from taskqueue.submit import (
    PRUNE_EVERY_S,
    SubmitError,
    SubmitReport,
    batch_id,
    batch_name,
    begin_batch,
    finish_batch,
    mark_regions,
    prune_batches,
    read_tasks,
    submit,
)
from tests.queue.test_lease import SetClock


class Inline(concurrent.futures.Executor):
    """Runs each job as it is handed over: a submit's creates settle before it waits, on any clock."""

    def submit(self, fn, /, *args, **kwargs):
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - kept in the future, as a pool's thread does
            future.set_exception(exc)
        return future


def run(store, job, batch, clock=None, **options):
    return submit(store, job, batch, clock=clock or SetClock(), executor=Inline(), **options)


def tasks(*ids, **fields):
    return [(t, json.dumps({"id": t, **fields}, sort_keys=True, separators=(",", ":")).encode()) for t in ids]


def batches(store):
    return {e.name: dict(e.metadata) for e in store.list(layout.BATCHES)}


def names(store, prefix):
    return [e.name for e in store.list(prefix)]


def set_updated(store, name, when: dt.datetime):
    path = store._meta_path(store._prefix + name)
    meta = json.loads(path.read_text())
    meta["updated"] = when.isoformat()
    path.write_text(json.dumps(meta))


# -- the tasks file -------------------------------------------------------------------------


def test_a_tasks_file_gives_each_lines_manifest_in_one_canonical_form(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"id": "b", "z": 1, "a": [1, 2]}\n\n   \n{"id":"a"}\n')
    assert read_tasks(path) == [("b", b'{"a":[1,2],"id":"b","z":1}'), ("a", b'{"id":"a"}')]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"id": "a"}\n{nope\n', ":2: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        ('[1]\n', ":1: a task must be a JSON object with an 'id' field"),
        ('{"x": 1}\n', ":1: task is missing field 'id' (ids make submission idempotent)"),
        ('{"id": "a/b"}\n', ":1: field 'id' must be a string of letters, digits"),
        ('{"id": "a"}\n\n{"id": "a"}\n', ":3: task id 'a' already used on line 1"),
        ('{"id": "a", "pad": "' + "x" * 65536 + '"}\n', ":1: manifest is 65555 bytes, over the 65536-byte limit"),
    ],
)
def test_a_bad_line_is_named_with_its_number_and_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "tasks.jsonl"
    path.write_text(text)
    with pytest.raises(SubmitError) as caught:
        read_tasks(path)
    assert str(caught.value).startswith(f"{path}{message}") and caught.value.__cause__ is None


def test_a_tasks_file_is_read_as_utf8_whatever_the_machines_locale(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_bytes('{"id": "a", "prompt": "caf\u00e9"}\n'.encode())
    before = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")  # a machine whose locale reads files as ASCII
    try:
        assert read_tasks(path) == [("a", b'{"id":"a","prompt":"caf\\u00e9"}')]
    finally:
        locale.setlocale(locale.LC_CTYPE, before)


def test_a_manifest_of_exactly_the_limit_is_read(tmp_path):
    pad = 65536 - len('{"id":"a","pad":""}')
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({"id": "a", "pad": "x" * pad}) + "\n")
    assert len(read_tasks(path)[0][1]) == 65536


# -- a submit -------------------------------------------------------------------------------


def test_a_submit_creates_the_job_and_tasks_inside_a_batch_marker_it_finishes(tmp_path):
    store, clock = LocalStore(tmp_path / "q"), SetClock()
    report = run(store, b'{"name": "j"}', tasks("b", "a", "c"), clock=clock)
    assert (report.created, report.existing, report.job) == (3, 0, "created")
    assert str(report) == "event=submitted created=3 already_existed=0 job=created"
    assert store.read(layout.JOB).data == b'{"name": "j"}'
    assert names(store, layout.TASKS) == ["tasks/a.json", "tasks/b.json", "tasks/c.json"]
    name = layout.batch_object(hashlib.sha256(b"a\nb\nc").hexdigest()[:24])
    assert batch_name(["c", "a", "b"]) == name
    assert batches(store) == {name: {"first": "a", "last": "c", "tasks": "3", "state": "done"}}
    assert [e.metadata for e in store.list(layout.TASKS)][0] == {"manifest": '{"id":"a"}'}  # rides in the listing


def test_the_same_submit_again_creates_nothing_and_says_so(tmp_path):
    store = LocalStore(tmp_path / "q")
    run(store, b'{"name": "j"}', tasks("a", "b"))
    report = run(store, b'{"name":  "j"}', tasks("a", "b"))  # the same JSON, spaced otherwise
    assert (report.created, report.existing, report.job) == (0, 2, "existing")
    assert SubmitReport() == SubmitReport(0, 0, "none")


def test_a_submit_without_a_job_or_without_tasks_writes_only_what_it_has(tmp_path):
    store = LocalStore(tmp_path / "q")
    report = run(store, None, tasks("a"))
    assert report.job == "none" and names(store, "") == ["batches/" + batch_id(batch_name(["a"])) + ".json", "tasks/a.json"]
    store = LocalStore(tmp_path / "r")
    report = run(store, b"{}", [])
    assert (report.created, report.job) == (0, "created") and names(store, "") == ["job.json"]


def test_a_changed_job_is_refused_and_names_the_job(tmp_path):
    store = LocalStore(tmp_path / "q")
    run(store, b'{"name": "j"}', tasks("a"))
    with pytest.raises(SubmitError) as caught:
        run(store, b'{"name": "k"}', tasks("b"))
    assert str(caught.value) == (f"{store.url(layout.JOB)} already exists with different content: "
                                 "submit a changed job to a new queue prefix")  # fmt: skip
    assert caught.value.__cause__ is None and names(store, layout.TASKS) == ["tasks/a.json"]


def test_a_big_manifest_is_not_copied_into_the_listing(tmp_path):
    store = LocalStore(tmp_path / "q")
    edge = 4096 - len('{"id":"a","pad":""}')
    run(store, None, tasks("a", pad="x" * edge) + tasks("b", pad="x" * (edge + 1)))
    metadata = {e.name: dict(e.metadata) for e in store.list(layout.TASKS)}
    assert len(metadata["tasks/a.json"]["manifest"]) == 4096 and metadata["tasks/b.json"] == {}


def test_a_task_that_exists_with_another_manifest_is_refused_after_the_others_are_created(tmp_path):
    store = LocalStore(tmp_path / "q")
    run(store, None, tasks("a", v=1))
    with pytest.raises(SubmitError) as caught:
        run(store, None, tasks("a", "b", "c", v=2))
    assert str(caught.value) == (
        f"{store.url('tasks/a.json')} already exists with a different manifest: tasks are immutable, give the changed "
        "task a new id and submit it. The batch's other 2 tasks are submitted (2 created now) and its batch marker "
        "is finished."
    )
    assert names(store, layout.TASKS) == ["tasks/a.json", "tasks/b.json", "tasks/c.json"]
    assert batches(store)[batch_name(["a", "b", "c"])] == {"first": "a", "last": "c", "tasks": "3", "state": "done",
                                                           "refused": "1"}  # fmt: skip


def test_many_refused_tasks_are_counted_and_the_first_three_named(tmp_path):
    store = LocalStore(tmp_path / "q")
    run(store, None, tasks("a", "b", "c", "d", v=1))
    with pytest.raises(SubmitError) as caught:
        run(store, None, tasks("a", "b", "c", "d", "e", v=2))
    urls = ", ".join(store.url(f"tasks/{t}.json") for t in "abc")
    assert str(caught.value).startswith(f"4 tasks already exist ({urls}, ...) with a different manifest")
    assert "The batch's other 1 tasks are submitted (1 created now)" in str(caught.value)
    with pytest.raises(SubmitError) as caught:
        run(store, None, tasks("a", "b", "c", v=3))
    assert str(caught.value).startswith(f"3 tasks already exist ({urls}) with a different manifest")  # all three named
    store = LocalStore(tmp_path / "r")
    run(store, None, tasks("a", "a.5", v=1))
    with pytest.raises(SubmitError) as caught:
        run(store, None, tasks("a", "a.5", v=2))
    # In the order of the listings, where `a.5.json` comes before `a.json`.
    assert str(caught.value).startswith(f"2 tasks already exist ({store.url('tasks/a.5.json')}, {store.url('tasks/a.json')}) with")


def test_a_batch_marker_spans_its_ids_in_the_listings_order(tmp_path):
    """Workers and status compare the span with listed names, where `a.5.json` sorts before `a.json`."""
    store = LocalStore(tmp_path / "q")
    run(store, None, tasks("a", "a.5"))
    assert batches(store)[batch_name(["a", "a.5"])] == {"first": "a.5", "last": "a", "tasks": "2", "state": "done"}


class Crowded(LocalStore):
    """Each create of a name under `prefix` waits until `crowd` creates were in flight at once (however
    slowly the threads start), then `hold_s` more for one more than `crowd` (it never comes while no
    more than `crowd` are sent at a time); `peak` is the most that were, `threads` the threads that
    sent them."""

    def __init__(self, path, prefix, crowd, hold_s=0.5):
        super().__init__(path)
        self.prefix, self.crowd, self.hold_s = prefix, crowd, hold_s
        self.in_flight = self.peak = 0
        self.threads: set[str] = set()
        self._changed = threading.Condition()

    def create(self, name, data, metadata=None):
        if not name.startswith(self.prefix):
            return super().create(name, data, metadata)
        with self._changed:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            self.threads.add(threading.current_thread().name)
            self._changed.notify_all()
            self._changed.wait_for(lambda: self.peak >= self.crowd, timeout=5)
            self._changed.wait_for(lambda: self.in_flight > self.crowd, timeout=self.hold_s)
        try:
            return super().create(name, data, metadata)
        finally:
            with self._changed:
                self.in_flight -= 1


def test_a_submit_sends_sixteen_creates_at_a_time_and_no_more_than_parallel_on_a_larger_executor(tmp_path):
    store = Crowded(tmp_path / "q", layout.TASKS, 16, hold_s=0.3)
    assert submit(store, None, tasks(*[f"a{i:02}" for i in range(17)]), clock=Clock()).created == 17
    assert store.peak == 16
    store = Crowded(tmp_path / "r", layout.TASKS, 1, hold_s=0.2)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        submit(store, None, tasks("a", "b"), parallel=1, clock=Clock(), executor=pool)
    assert store.peak == 1 and len(names(store, layout.TASKS)) == 2


def test_a_submit_and_a_finish_by_hand_send_every_split_on_the_executor_they_are_given(tmp_path):
    store = Crowded(tmp_path / "q", layout.SPLITS, crowd=1, hold_s=0)
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="given") as pool:
        submit(store, None, tasks("a", "b", "c"), clock=Clock(), executor=pool, region_tasks=1)
        store.create(layout.batch_object("x"), b"{}", metadata={"first": "d", "last": "f", "state": "running"})
        for task_id in "def":
            store.create(layout.task_object(task_id), b"{}")
        finish_batch(store, "x", executor=pool, region_tasks=1)
    assert names(store, layout.SPLITS) == [f"splits/{t}.json" for t in "bcdef"]
    assert store.threads and {t.split("_")[0] for t in store.threads} == {"given"}


def test_a_batch_finished_by_hand_sends_sixteen_splits_at_a_time(tmp_path):
    store = Crowded(tmp_path / "q", layout.SPLITS, 16, hold_s=0.3)
    ids = [f"a{i:02}" for i in range(18)]
    for task_id in ids:
        LocalStore.create(store, layout.task_object(task_id), b"{}")
    store.create(layout.batch_object("x"), b"{}", metadata={"first": ids[0], "last": ids[-1], "state": "running"})
    finish_batch(store, "x", region_tasks=1)
    assert len(names(store, layout.SPLITS)) == 17 and store.peak == 16


class Gapped(LocalStore):
    same_object_write_gap_s = 1.0


def test_the_marker_is_finished_a_second_after_it_was_begun_and_no_sooner(tmp_path):
    clock = SetClock()
    run(Gapped(tmp_path / "q"), None, tasks("a"), clock=clock)
    assert clock.waits == [1.0]


def test_the_finishing_write_waits_only_what_is_left_of_the_write_gap(tmp_path):
    clock = SetClock()

    class Slow(Failing):
        same_object_write_gap_s = 1.0

    def slow(method, name, store):
        if method == "create" and name.startswith(layout.TASKS):
            clock.now += 0.25  # the create took a quarter of a second
        return None

    run(Slow(tmp_path / "q", slow), None, tasks("a"), clock=clock)
    assert clock.waits == [0.75]


class Failing(LocalStore):
    """A local store whose chosen calls fail: `fail(name, method)` says whether this one does."""

    def __init__(self, path, fail):
        super().__init__(path)
        self.fail = fail
        self.calls: list[tuple[str, str]] = []

    def _check(self, method, name):
        self.calls.append((method, name))
        error = self.fail(method, name, self)
        if error is not None:
            raise error

    def create(self, name, data, metadata=None):
        self._check("create", name)
        return super().create(name, data, metadata)

    def write(self, name, data, if_generation, metadata=None):
        self._check("write", name)
        return super().write(name, data, if_generation, metadata)

    def delete(self, name, if_generation=None):
        self._check("delete", name)
        return super().delete(name, if_generation)

    def list_page(self, prefix, page_token=None, start_offset=None, page_size=1000, end_offset=None):
        self._check("list", prefix)
        return super().list_page(prefix, page_token, start_offset, page_size, end_offset)


def once(method, name, error):
    """Fail the first such call only."""
    state = {"done": False}

    def fail(m, n, store):
        if m == method and n == name and not state["done"]:
            state["done"] = True
            return error
        return None

    return fail


def test_a_create_that_fails_stops_the_submit_and_its_marker_is_finished_once_the_task_is_settled(tmp_path, caplog):
    store = Failing(tmp_path / "q", once("create", "tasks/b.json", StoreUnavailable("b: 503")))
    with caplog.at_level(logging.WARNING, logger="taskqueue.submit"), pytest.raises(StoreUnavailable) as caught:
        run(store, None, tasks("a", "b", "c"), parallel=1)
    assert not getattr(caught.value, "__notes__", None)  # finished: nothing to say
    name = batch_name(["a", "b", "c"])
    assert batches(store)[name] == {"first": "a", "last": "c", "tasks": "3", "state": "done", "gave_up": "StoreUnavailable"}
    # b's create was sent again (its answer never came), c's never: it was not in flight.
    assert names(store, layout.TASKS) == ["tasks/a.json", "tasks/b.json"]
    assert [m for m in caplog.messages if m.startswith(f"event=batch_finished_after_failure batch={name} error=StoreUnavailable(")]


def test_an_exit_raised_in_a_creates_thread_stops_the_submit_and_its_create_is_settled(tmp_path):
    """A KeyboardInterrupt or SystemExit in the thread sending a create: the submitting thread raises
    it, after sending that create again and finishing the marker, as for any failure."""
    store = Failing(tmp_path / "q", once("create", "tasks/a.json", KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt) as caught:
        run(store, None, tasks("a", "b"), parallel=2)
    assert not getattr(caught.value, "__notes__", None)
    assert names(store, layout.TASKS) == ["tasks/a.json"]  # a sent again; b never sent, the submit had stopped
    assert batches(store)[batch_name(["a", "b"])] == {"first": "a", "last": "b", "tasks": "2", "state": "done",
                                                      "gave_up": "KeyboardInterrupt"}  # fmt: skip


def test_a_store_that_refuses_the_finishing_write_leaves_the_batch_running_and_says_how_to_finish_it(tmp_path, caplog):
    def fail(method, name, store):
        if method == "create" and name == "tasks/b.json":
            return StoreUnavailable("b: 503")
        return None

    store = Failing(tmp_path / "q", fail)
    with caplog.at_level(logging.ERROR, logger="taskqueue.submit"), pytest.raises(StoreUnavailable) as caught:
        run(store, None, tasks("a", "b"), parallel=1)
    name = batch_name(["a", "b"])
    assert caught.value.__notes__ == [
        f"{store.url(name)} may be left running (b: 503): run the same submit again, or, once it will never run again, "
        f"finish its batch: gcs-spawner submit {store.root_url} --finish-batch {batch_id(name)}"
    ]
    assert batches(store)[name]["state"] == "running"
    assert [m for m in caplog.messages if m.startswith(f"event=batch_left_running batch={name} error=StoreUnavailable(")
            and m.endswith(" in_flight=0")]  # fmt: skip


def test_a_second_interrupt_while_waiting_says_so_in_the_note(tmp_path):
    calls = {"n": 0}

    class Interrupting(SetClock):
        def wait(self, stop, seconds):
            calls["n"] += 1
            raise KeyboardInterrupt

    store = Failing(tmp_path / "q", once("create", "tasks/a.json", KeyboardInterrupt()))
    executor = concurrent.futures.ThreadPoolExecutor(1)
    with pytest.raises(KeyboardInterrupt) as caught:
        submit(store, None, tasks("a"), clock=Interrupting(), executor=executor)
    executor.shutdown()
    assert "may be left running (interrupted again while its creates were in flight)" in caught.value.__notes__[0]


def test_a_second_interrupt_ends_the_submit_at_once_and_leaves_the_create_in_flight_to_its_thread(tmp_path):
    """Ctrl-C twice: the submit raises there and then; its own pool's thread ends with its create."""
    answer, sent = threading.Event(), threading.Event()

    def hang(method, name, store):
        if method == "create" and name == "tasks/a.json":
            sent.set()
            answer.wait(5)
        return None

    class CtrlC(SetClock):
        def wait(self, stop, seconds):
            sent.wait(5)
            raise KeyboardInterrupt

    store = Failing(tmp_path / "q", hang)
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            submit(store, None, tasks("a"), clock=CtrlC())
        assert names(store, layout.TASKS) == []  # the create is still in flight
    finally:
        answer.set()
    assert "may be left running (interrupted again while its creates were in flight)" in caught.value.__notes__[0]
    assert batches(store)[batch_name(["a"])]["state"] == "running"


def test_an_interrupt_while_a_create_is_in_flight_finishes_the_batch_only_once_that_create_is_answered(tmp_path):
    """Ctrl-C while the submit waits for its creates: `_give_up` waits for the one in flight (the
    clock's wait lets it through), then finishes the batch, after it, with no note."""
    answer = threading.Event()

    def fail(method, name, store):
        if method == "create" and name == "tasks/b.json":
            answer.wait(10)
            time.sleep(0.5)  # answered well after the clock's wait that let it through
        return None

    class CtrlC(SetClock):
        def wait(self, stop, seconds):
            self.waits.append(seconds)
            if len(self.waits) == 1:
                raise KeyboardInterrupt  # while `run` waits for b's create
            answer.set()
            stop.wait(0.05)
            return stop.is_set()

    store = Failing(tmp_path / "q", fail)
    with concurrent.futures.ThreadPoolExecutor(2) as pool, pytest.raises(KeyboardInterrupt) as caught:
        submit(store, None, tasks("a", "b"), clock=CtrlC(), executor=pool)
    assert not getattr(caught.value, "__notes__", None)
    name = batch_name(["a", "b"])
    assert batches(store)[name]["state"] == "done" and batches(store)[name]["gave_up"] == "KeyboardInterrupt"
    assert store.read(name).generation > store.read("tasks/b.json").generation


def test_the_last_create_to_settle_wakes_the_waiting_submit_at_once(tmp_path):
    """The submit waits for its creates in polls of half a second (here stretched to 10 s, so that
    one wait spans them all); the last answer ends that wait there and then, not at its timeout."""
    woken = []

    class Real(SetClock):
        def wait(self, stop, seconds):
            if seconds <= 0:  # the finishing write's wait for the write gap: none on a local store
                return stop.is_set()
            woken.append(stop.wait(10.0))
            return woken[-1]

    def slow(method, name, store):
        if method == "create" and name.startswith(layout.TASKS):
            time.sleep(0.5)
        return None

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        submit(Failing(tmp_path / "q", slow), None, tasks("a", "b", "c"), clock=Real(), executor=pool)
    assert woken == [True]


def test_the_same_submit_after_a_finished_one_makes_its_marker_running_again_then_done(tmp_path):
    store = Failing(tmp_path / "q", lambda m, n, s: None)
    run(store, None, tasks("a"))
    name = batch_name(["a"])
    first = store.read(name).generation
    assert begin_batch(store, name, {"first": "a", "last": "a", "tasks": "1"}) > first
    assert batches(store)[name]["state"] == "running"


def test_a_marker_deleted_or_rewritten_while_it_is_begun_is_looked_at_again(tmp_path):
    def fail(method, name, store):
        if method == "write" and name.startswith(layout.BATCHES) and not fail.done:
            fail.done = True
            return NotFound(name)
        return None

    fail.done = False
    store = Failing(tmp_path / "q", fail)
    name = layout.batch_object("x")
    store.create(name, b"{}", metadata={"state": "done"})
    generation = begin_batch(store, name, {"first": "a", "last": "a"})
    assert store.read(name).generation == generation and batches(store)[name] == {"first": "a", "last": "a", "state": "running"}
    assert [c for c in store.calls[1:] if c[1] == name] == [("create", name), ("write", name), ("create", name), ("write", name)]


def test_a_later_run_that_took_the_marker_over_finishes_it(tmp_path, caplog):
    name = batch_name(["a"])

    def fail(method, n, store):
        if method == "create" and n == "tasks/a.json":
            store.write(name, b"{}", if_generation=store.read(name).generation, metadata={"state": "running", "by": "2"})
        return None

    store = Failing(tmp_path / "q", fail)
    with caplog.at_level(logging.INFO, logger="taskqueue.submit"):
        run(store, None, tasks("a"))
    assert batches(store)[name] == {"state": "running", "by": "2"}  # left to the run that took it over
    assert f"event=batch_taken_over batch={name}" in caplog.messages


@pytest.mark.parametrize("how", ["lost_answer", "applied", "refused_again", "unanswered_again", "finish_refused"])
def test_a_marker_whose_begin_failed_is_settled_by_a_create(tmp_path, how):
    name = batch_name(["a"])
    state = {"creates": 0, "writes": 0}

    def fail(method, n, store):
        if n != name:
            return None
        if method == "create":
            state["creates"] += 1
            if state["creates"] == 1:
                if how == "applied":
                    LocalStore.create(store, n, b"{}", metadata={"state": "running"})
                return StoreUnavailable("begin: 503")
            if how == "unanswered_again":
                return StoreUnavailable("again: 503")
        if method == "write" and how == "finish_refused":
            return StoreUnavailable("finish: 503")
        return None

    store = Failing(tmp_path / "q", fail)
    if how == "refused_again":
        store.fail = lambda m, n, s: (StoreUnavailable("begin: 503") if m == "create" and n == name and not s.calls[:-1]
                                      else None)  # fmt: skip
    with pytest.raises(StoreUnavailable) as caught:
        run(store, None, tasks("a"))
    notes = getattr(caught.value, "__notes__", [])
    assert names(store, layout.TASKS) == []
    url = store.url(name)
    if how in ("lost_answer", "refused_again"):
        assert notes == [] and batches(store)[name] == {"first": "a", "last": "a", "tasks": "1", "state": "done",
                                                        "gave_up": "StoreUnavailable"}  # fmt: skip
    elif how == "applied":
        assert notes == [f"{url} exists, and may be running (this run's, whose answer was lost, or another run's): "
                         "if status names it, run the same submit again"]  # fmt: skip
        assert batches(store)[name] == {"state": "running"}
    elif how == "unanswered_again":
        assert notes == [f"{url} may have been begun (StoreUnavailable('again: 503')): if status names it as running, run "
                         "the same submit again"]  # fmt: skip
    else:
        # Left running as a submit's marker, which status and the workers read: its range and state.
        assert batches(store)[name] == {"first": "a", "last": "a", "tasks": "1", "state": "running"}
        assert notes == [f"{url} is left running (StoreUnavailable('finish: 503')), with no task created: run the same "
                         f"submit again, or finish its batch: gcs-spawner submit {store.root_url} --finish-batch "
                         f"{batch_id(name)}"]  # fmt: skip


def test_a_batch_id_is_its_markers_name_without_prefix_and_suffix():
    assert batch_id("batches/abc.json") == "abc"
    assert batch_id(batch_name(["a"])) == hashlib.sha256(b"a").hexdigest()[:24]


# -- regions --------------------------------------------------------------------------------


def test_regions_are_cut_at_every_nth_task_of_each_region_the_batch_touched(tmp_path):
    store = LocalStore(tmp_path / "q")
    run(store, None, tasks(*[f"a{i}" for i in range(7)]), region_tasks=3)
    assert names(store, layout.SPLITS) == ["splits/a3.json", "splits/a6.json"]
    run(store, None, tasks("a31", "a32", "a33"), region_tasks=3)  # region [a3, a6) grows to 6
    assert names(store, layout.SPLITS) == ["splits/a3.json", "splits/a33.json", "splits/a6.json"]
    run(store, None, tasks("b1"), region_tasks=3)  # the last region: a6, b1
    assert names(store, layout.SPLITS) == ["splits/a3.json", "splits/a33.json", "splits/a6.json"]
    mark_regions(store, [], region_tasks=1)
    assert len(names(store, layout.SPLITS)) == 3


def test_the_head_region_is_cut_for_ids_that_sort_before_any_letter(tmp_path):
    store = LocalStore(tmp_path / "q")
    run(store, None, tasks("0", "1", "A", "B"), region_tasks=2)
    assert names(store, layout.SPLITS) == ["splits/A.json"]


def test_each_region_a_batch_touched_is_cut_counting_its_own_tasks_only(tmp_path):
    store = LocalStore(tmp_path / "q")
    for task_id in ("a", "b", "c", "d", "m", "n", "o", "p"):
        store.create(layout.task_object(task_id), b"{}")
    store.create(layout.split_object("m"), b"{}")  # regions [head, m) and [m, end), four tasks each
    mark_regions(store, ["a", "m"], region_tasks=3)
    assert names(store, layout.SPLITS) == ["splits/d.json", "splits/m.json", "splits/p.json"]


def test_only_the_regions_a_batch_added_tasks_to_are_listed(tmp_path):
    store = Failing(tmp_path / "q", lambda m, n, s: None)
    for task_id in ("a", "b", "m", "n"):
        store.create(layout.task_object(task_id), b"{}")
    store.create(layout.split_object("m"), b"{}")
    mark_regions(store, ["m"])  # the first id of region m: the head region before it is not listed
    assert store.calls.count(("list", layout.TASKS)) == 1


def test_a_batch_landing_in_a_swept_region_unsweeps_it_and_no_other(tmp_path):
    store = LocalStore(tmp_path / "q")
    for region, end in ((layout.HEAD, "m"), ("m", "t"), ("t", "")):
        store.create(layout.swept_object(region), b"{}", metadata={"end": end, "confirmed": "1"})
    for task_id in ("m", "n", "t"):
        store.create(layout.split_object(task_id), b"{}") if task_id != "n" else None
    store.create(layout.SWEPT + "not-a-region.json.tmp", b"{}")
    mark_regions(store, ["n"])
    assert names(store, layout.SWEPT) == ["swept/-.json", "swept/not-a-region.json.tmp", "swept/t.json"]
    mark_regions(store, ["z"])  # the last region reaches the keyspace's end
    assert names(store, layout.SWEPT) == ["swept/-.json", "swept/not-a-region.json.tmp"]
    mark_regions(store, ["a"])
    assert names(store, layout.SWEPT) == ["swept/not-a-region.json.tmp"]


def test_the_head_regions_swept_marker_is_removed_for_ids_that_sort_before_any_letter(tmp_path):
    store = LocalStore(tmp_path / "q")
    store.create(layout.swept_object(layout.HEAD), b"{}", metadata={"end": "m", "confirmed": "1"})
    mark_regions(store, ["A"])
    assert names(store, layout.SWEPT) == []


def test_a_swept_marker_ending_at_the_batchs_first_id_stays(tmp_path):
    store = LocalStore(tmp_path / "q")
    store.create(layout.swept_object(layout.HEAD), b"{}", metadata={"end": "m", "confirmed": "1"})
    mark_regions(store, ["m"])
    assert names(store, layout.SWEPT) == ["swept/-.json"]
    mark_regions(store, ["l"])
    assert names(store, layout.SWEPT) == []


def test_a_split_or_unsweep_someone_else_made_first_is_no_error(tmp_path):
    def fail(method, name, store):
        if method == "delete" and name.startswith(layout.SWEPT):
            LocalStore.delete(store, name)
        return None

    store = Failing(tmp_path / "q", fail)
    for i in range(4):
        store.create(layout.task_object(f"a{i}"), b"{}")
    store.create(layout.split_object("a2"), b"{}")
    store.create(layout.swept_object(layout.HEAD), b"{}", metadata={"end": "", "confirmed": "1"})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        mark_regions(store, ["a0", "a3"], region_tasks=2, executor=pool)
    assert names(store, layout.SPLITS) == ["splits/a2.json"] and names(store, layout.SWEPT) == []


# -- pruning --------------------------------------------------------------------------------

T0 = dt.datetime(2026, 11, 28, 12, 0, tzinfo=dt.timezone.utc)
OWN = layout.batch_object("0000")  # this submit's marker: a name whose spread (its first 4 hex digits) is 0


def aged(store, **ages):
    """Batch markers `name` done (or running, for names starting with `r`), `age` seconds before T0."""
    for name, age in ages.items():
        state = layout.BATCH_RUNNING if name.startswith("r") else layout.BATCH_DONE
        name = OWN[len(layout.BATCHES):-len(".json")] if name == "own" else name
        store.create(layout.batch_object(name), b"{}", metadata={"first": "a", "last": "a", "state": state})
        set_updated(store, layout.batch_object(name), T0 - dt.timedelta(seconds=age))


def test_a_submit_prunes_the_done_markers_older_than_the_keep_time_and_marks_the_cutoff(tmp_path, caplog):
    store = LocalStore(tmp_path / "q")
    aged(store, own=0, old=181, older=900, edge=180, young=10, rold=1000)
    with caplog.at_level(logging.INFO, logger="taskqueue.submit"):
        assert prune_batches(store, OWN, 180.0) == 2
    assert sorted(batches(store)) == ["batches/-pruned.json", OWN, "batches/edge.json", "batches/rold.json",
                                      "batches/young.json"]  # fmt: skip
    assert batches(store)[layout.PRUNED] == {"before": (T0 - dt.timedelta(seconds=180)).isoformat()}
    assert "event=batches_pruned count=2" in caplog.messages


def test_a_finished_submit_prunes_the_done_markers_its_keep_time_older_than_its_own(tmp_path):
    store = LocalStore(tmp_path / "q")
    now = dt.datetime.now(dt.timezone.utc)
    aged(store, old=0, young=0)
    set_updated(store, "batches/old.json", now - dt.timedelta(seconds=120))
    set_updated(store, "batches/young.json", now - dt.timedelta(seconds=30))
    run(store, None, tasks("a"), batch_keep_s=60.0)
    assert sorted(batches(store)) == [layout.PRUNED, batch_name(["a"]), "batches/young.json"]


def test_nothing_stale_writes_no_prune_mark(tmp_path, caplog):
    store = LocalStore(tmp_path / "q")
    aged(store, own=0, young=10)
    with caplog.at_level(logging.INFO, logger="taskqueue.submit"):
        assert prune_batches(store, OWN, 180.0) == 0
        assert layout.PRUNED not in batches(store)
        assert prune_batches(store, layout.batch_object("abcd"), 180.0) == 0  # its own marker is not listed
        assert prune_batches(store, layout.task_object("a"), 180.0) == 0  # nor is a name outside batches/
    assert caplog.messages == []  # nothing to do is no failure


def test_a_prune_mark_keeps_the_latest_cutoff_and_a_recent_prune_defers_the_next(tmp_path):
    store = LocalStore(tmp_path / "q")
    aged(store, own=0, old=500)
    later = (T0 + dt.timedelta(seconds=60)).isoformat()
    store.create(layout.PRUNED, b"{}", metadata={"before": later})
    set_updated(store, layout.PRUNED, T0 - dt.timedelta(seconds=PRUNE_EVERY_S * 2))
    assert prune_batches(store, OWN, 180.0) == 1
    assert batches(store)[layout.PRUNED] == {"before": later}  # never moved back
    aged(store, old2=500)
    set_updated(store, layout.PRUNED, T0 - dt.timedelta(seconds=PRUNE_EVERY_S * 0.99))
    assert prune_batches(store, OWN, 180.0) == 0 and "batches/old2.json" in batches(store)
    set_updated(store, layout.PRUNED, T0 - dt.timedelta(seconds=PRUNE_EVERY_S * 2.01))
    assert prune_batches(store, OWN, 180.0) == 1


def test_a_prune_mark_without_a_cutoff_takes_this_ones(tmp_path):
    store = LocalStore(tmp_path / "q")
    aged(store, own=0, old=500)
    store.create(layout.PRUNED, b"{}")
    set_updated(store, layout.PRUNED, T0 - dt.timedelta(seconds=60))
    assert prune_batches(store, OWN, 100.0) == 1
    assert batches(store)[layout.PRUNED] == {"before": (T0 - dt.timedelta(seconds=100)).isoformat()}


def test_the_spread_between_parallel_submitters_comes_from_the_batch_name(tmp_path):
    store = LocalStore(tmp_path / "q")
    aged(store, ffff=0, old=500)  # spread 0xffff / 0x10000: the next prune after almost 2 x PRUNE_EVERY_S
    store.create(layout.PRUNED, b"{}", metadata={"before": T0.isoformat()})
    set_updated(store, layout.PRUNED, T0 - dt.timedelta(seconds=PRUNE_EVERY_S * 1.99))
    assert prune_batches(store, layout.batch_object("ffff"), 180.0) == 0
    aged(store, **{"0000": 0})
    assert prune_batches(store, layout.batch_object("0000"), 180.0) == 1
    assert PRUNE_EVERY_S == 5.0


def prunes_after(tmp_path, batch_hex, since_last_prune_s):
    """How many markers a submit of batch `batch_hex` prunes, the last prune `since_last_prune_s` before its marker."""
    store = LocalStore(tmp_path / f"{batch_hex}-{since_last_prune_s}")
    aged(store, **{batch_hex: 0, "old": 500})
    store.create(layout.PRUNED, b"{}", metadata={"before": T0.isoformat()})
    set_updated(store, layout.PRUNED, T0 - dt.timedelta(seconds=since_last_prune_s))
    return prune_batches(store, layout.batch_object(batch_hex), 180.0)


@pytest.mark.parametrize(("batch_hex", "spread"), [("0" * 24, 0.0), ("8" + "0" * 23, 0.5), ("f" * 24, 0xFFFF / 0x10000)])
def test_each_batch_prunes_once_its_share_of_between_one_and_two_prune_intervals_has_passed(tmp_path, batch_hex, spread):
    """A batch's name (24 hex digits, as submit makes them) sets its wait, the same for every submit
    of it: a prune interval times 1 + its first four digits / 0x10000."""
    due = round(PRUNE_EVERY_S * (1 + spread), 6)
    assert prunes_after(tmp_path, batch_hex, due) == 1
    assert prunes_after(tmp_path, batch_hex, due - 0.001) == 0
    assert prunes_after(tmp_path, batch_hex, 2 * PRUNE_EVERY_S) == 1


def test_a_stale_marker_a_rerun_made_running_again_is_not_pruned(tmp_path):
    def rerun(method, name, store):
        if method == "delete" and name == "batches/old.json":  # listed done; running again before the delete
            store.write(name, b"{}", if_generation=store.read(name).generation, metadata={"state": "running"})
        return None

    store = Failing(tmp_path / "q", rerun)
    aged(store, own=0, old=500)
    assert prune_batches(store, OWN, 180.0) == 0
    assert batches(store)["batches/old.json"] == {"state": "running"}


def test_a_prune_another_submit_is_doing_is_left_to_it_and_a_failing_one_costs_the_submit_nothing(tmp_path, caplog):
    store = Failing(tmp_path / "q", once("create", layout.PRUNED, PreconditionFailed(layout.PRUNED)))
    aged(store, own=0, old=500)
    assert prune_batches(store, OWN, 180.0) == 0 and "batches/old.json" in batches(store)
    store.fail = once("delete", "batches/old.json", NotFound("old"))
    assert prune_batches(store, OWN, 180.0) == 0 and "batches/old.json" in batches(store)
    store.fail = once("list", layout.BATCHES, StoreUnavailable("list: 503"))
    with caplog.at_level(logging.WARNING, logger="taskqueue.submit"):
        assert prune_batches(store, OWN, 180.0) == 0
    assert "event=batch_prune_failed error=StoreUnavailable('list: 503')" in caplog.messages


# -- finishing a batch by hand ----------------------------------------------------------------


def test_finishing_a_running_batch_cuts_its_regions_and_marks_it_done(tmp_path):
    store = LocalStore(tmp_path / "q")
    for task_id in ("0z", "a0", "a1", "a2", "a3", "b0"):  # 0z: before the batch's range
        store.create(layout.task_object(task_id), b"{}")
    store.create(layout.split_object("a0"), b"{}")
    store.create(layout.swept_object(layout.HEAD), b"{}", metadata={"end": "a0", "confirmed": "1"})  # [head, a0): not the batch's
    store.create(layout.swept_object("a0"), b"{}", metadata={"end": "", "confirmed": "1"})
    store.create(layout.batch_object("w"), b"{}", metadata={"first": "0z", "last": "0z", "state": "done"})  # listed first
    name = layout.batch_object("x")
    store.create(name, b"{}", metadata={"first": "a0", "last": "a3", "tasks": "4", "state": "running"})
    assert finish_batch(store, "x", region_tasks=2) == "event=batch_finished batch=x tasks_in_range=3"
    assert batches(store)[name] == {"first": "a0", "last": "a3", "tasks": "4", "state": "done", "finished_by": "finish_batch"}
    assert names(store, layout.SPLITS) == ["splits/a0.json", "splits/a2.json", "splits/b0.json"]
    assert names(store, layout.SWEPT) == ["swept/-.json"]
    assert finish_batch(store, name) == "event=batch_already_done batch=x"


def test_finishing_a_batch_that_is_not_there_or_not_a_submits_or_changing_says_so(tmp_path):
    store = LocalStore(tmp_path / "q")
    with pytest.raises(SubmitError) as caught:
        finish_batch(store, "nope")
    assert str(caught.value) == (f"{store.url('batches/nope.json')} does not exist: `gcs-spawner status {store.root_url}` "
                                 "lists the running batches")  # fmt: skip
    store.create(layout.batch_object("y"), b"{}", metadata={"first": "a", "state": "running"})
    with pytest.raises(SubmitError) as caught:
        finish_batch(store, "y")
    assert str(caught.value) == f"{store.url('batches/y.json')} has no 'first'/'last' metadata: it was not written by submit"
    store = Failing(tmp_path / "r", once("write", "batches/z.json", PreconditionFailed("z")))
    store.create(layout.batch_object("z"), b"{}", metadata={"first": "a", "last": "a", "state": "running"})
    with pytest.raises(SubmitError) as caught:
        finish_batch(store, "batches/z.json")
    assert str(caught.value) == (f"{store.url('batches/z.json')} changed while it was being finished: a submit of it "
                                 "is running again; leave it to finish")  # fmt: skip
    assert caught.value.__cause__ is None

"""taskqueue.sweep on its own: when a region's swept marker is written, confirmed, withdrawn or left alone,
and what it counts (docs/PROTOCOL.md, "Swept regions").

In-process on a local store and a clock the test sets, so that mutation testing (`make mutants`)
reaches every branch: markers copied from tombstones, the second task listing that withdraws a
marker, a marker someone else wrote, and the wait before the confirming write."""

from __future__ import annotations

import json
import logging
import threading

from objectstore import PreconditionFailed
from objectstore.local import LocalStore
from taskqueue import layout
from taskqueue.lease import DEAD, DONE, HELD, encode
from taskqueue.sweep import Sweeper
from taskqueue.view import QueueView
from tests.queue.test_lease import SetClock, iso


def queue(tmp_path, ids, splits=(), store_class=LocalStore):
    store = store_class(tmp_path / "q")
    for task_id in ids:
        store.create(layout.task_object(task_id), json.dumps({"id": task_id}).encode())
    for task_id in splits:
        store.create(layout.split_object(task_id), b"{}")
    clock = SetClock()
    view = QueueView(store, clock)
    view.scan_map()
    return store, clock, view


def sweeper(store, clock, view):
    return Sweeper(store, view, clock, "w1", threading.Event())


def done(store, task_id, counters=None):
    store.create(layout.done_object(task_id), b"{}", metadata={"counters": json.dumps(counters)} if counters else None)


def tombstone(store, task_id, state, **fields):
    body = {"task": task_id, "state": state, "worker": "w0", "ttl_s": 30.0, "heartbeat_at": iso(0), "fencing_token": 3,
            "progress": [], **fields}  # fmt: skip
    data, metadata = encode(body)
    store.create(layout.lease_object(task_id), data, metadata=metadata)


def swept_marker(store, region):
    name = layout.swept_object(region)
    entries = [e for e in store.list(layout.SWEPT) if e.name == name]
    if not entries:
        return None, None
    return json.loads(store.read(name).data), dict(entries[0].metadata)


def test_a_region_of_finished_tasks_gets_a_confirmed_marker_with_its_counts_and_the_done_markers_counters(tmp_path):
    store, clock, view = queue(tmp_path, ["a1", "a2", "a3", "b1", "b2"], splits=["b1"])
    view.load(layout.HEAD)
    done(store, "a1", {"tokens": 7})
    done(store, "a2", {"rows": 5})
    store.create(layout.failed_object("a3"), b"{}")
    done(store, "b1", {"rows": 100})  # another region's: not counted
    sweeper(store, clock, view).sweep(layout.HEAD)
    record, metadata = swept_marker(store, layout.HEAD)
    assert record == {"region": "", "end": "b1", "tasks": 3, "failed": 1, "worker": "w1", "swept_at": iso(0),
                      "counters": {"tokens": 7, "rows": 5}}  # fmt: skip
    assert metadata == {"end": "b1", "tasks": "3", "failed": "1", "counters": '{"rows":5,"tokens":7}', "confirmed": "1"}
    assert view.swept[layout.HEAD] == metadata and view.is_swept(layout.HEAD)


def test_the_last_region_reaches_the_keyspaces_end_and_a_region_without_counters_has_none(tmp_path):
    store, clock, view = queue(tmp_path, ["a1", "b1", "b2"], splits=["b1"])
    view.load("b1")
    done(store, "b1")
    store.create(layout.failed_object("b2"), b"{}")
    store.create(layout.failed_object("a1"), b"{}")  # the head region's: not counted
    sweeper(store, clock, view).sweep("b1")
    record, metadata = swept_marker(store, "b1")
    assert record == {"region": "b1", "end": None, "tasks": 2, "failed": 1, "worker": "w1", "swept_at": iso(0)}
    assert metadata == {"end": "", "tasks": "2", "failed": "1", "confirmed": "1"}


def test_a_holder_that_died_after_its_tombstone_gets_its_marker_copied_and_counted(tmp_path, caplog):
    store, clock, view = queue(tmp_path, ["a1", "a2", "a3"])
    view.load(layout.HEAD)
    tombstone(store, "a1", DONE, counters={"rows": 4}, completed_at=iso(1), seconds=1.5)
    tombstone(store, "a2", DEAD, reason="bad input")
    tombstone(store, "a3", DONE)
    done(store, "a3", {"rows": 1})  # its holder wrote the marker: the listing counts it, the tombstone is not read
    with caplog.at_level(logging.INFO, logger="taskqueue.sweep"):
        sweeper(store, clock, view).sweep(layout.HEAD)
    assert "event=marker_from_tombstone task=a1 object=done/a1.json" in caplog.messages
    assert "event=marker_from_tombstone task=a2 object=failed/a2.json" in caplog.messages
    assert json.loads(store.read("done/a1.json").data)["fencing_token"] == 3
    copied = {e.name: dict(e.metadata) for e in store.list(layout.DONE)}["done/a1.json"]
    assert copied == {"completed_at": iso(1), "seconds": "1.5", "counters": '{"rows":4}'}  # status reads these from listings
    assert json.loads(store.read("failed/a2.json").data)["reason"] == "bad input"
    record, metadata = swept_marker(store, layout.HEAD)
    assert (record["tasks"], record["failed"], record["counters"]) == (3, 1, {"rows": 5})
    assert metadata["confirmed"] == "1"


def test_a_marker_its_holder_wrote_meanwhile_is_left_as_it_is(tmp_path):
    store, clock, view = queue(tmp_path, ["a1"])
    view.load(layout.HEAD)
    tombstone(store, "a1", DONE, counters={"rows": 4})
    s = sweeper(store, clock, view)
    found_done, found_failed = s.markers(layout.HEAD)
    store.create("done/a1.json", b"holder's")  # after the sweeper listed the markers
    assert s.mark_from_tombstone("a1", found_done, found_failed) is True
    assert store.read("done/a1.json").data == b"holder's" and found_done == {"a1": '{"rows":4}'} and found_failed == set()


def test_a_region_with_a_task_still_to_finish_gets_no_marker_and_says_why(tmp_path, caplog):
    for lease in ("held", "missing", "not_json", "not_object"):
        store, clock, view = queue(tmp_path / lease, ["a1", "a2"])
        view.load(layout.HEAD)
        done(store, "a1")
        if lease == "held":
            tombstone(store, "a2", HELD)
        elif lease == "not_json":
            store.create(layout.lease_object("a2"), b"{nope")
        elif lease == "not_object":
            store.create(layout.lease_object("a2"), b"[1]")
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="taskqueue.sweep"):
            sweeper(store, clock, view).sweep(layout.HEAD)
        assert swept_marker(store, layout.HEAD) == (None, None), lease
        assert not list(store.list(layout.FAILED)) and [e.name for e in store.list(layout.DONE)] == ["done/a1.json"]
        (message,) = caplog.messages
        if lease in ("held", "not_object"):
            assert message == "event=sweep_refused task=a2 reason=lease_not_a_tombstone"
        else:
            assert message.startswith("event=sweep_refused task=a2 reason='lease unreadable: "), message


class Recording(LocalStore):
    """Records each request's name or prefix, and the names every listing returned."""

    def __init__(self, path):
        super().__init__(path)
        self.requests: list[tuple[str, str]] = []
        self.listed: list[str] = []

    def list_page(self, prefix, page_token=None, start_offset=None, page_size=1000, end_offset=None):
        self.requests.append(("list", prefix))
        page = super().list_page(prefix, page_token, start_offset, page_size, end_offset)
        self.listed += [e.name for e in page.entries]
        return page

    def create(self, name, data, metadata=None):
        self.requests.append(("create", name))
        return super().create(name, data, metadata)

    def write(self, name, data, if_generation, metadata=None):
        self.requests.append(("write", name))
        return super().write(name, data, if_generation, metadata)

    def read(self, name):
        self.requests.append(("read", name))
        return super().read(name)


def test_a_region_already_swept_costs_nothing(tmp_path):
    store, clock, view = queue(tmp_path, ["a1"], store_class=Recording)
    view.load(layout.HEAD)
    done(store, "a1")
    sweeper(store, clock, view).sweep(layout.HEAD)
    store.requests.clear()
    sweeper(store, clock, view).sweep(layout.HEAD)
    assert store.requests == []


def test_a_sweep_lists_only_its_own_regions_markers(tmp_path):
    store, clock, view = queue(tmp_path, ["a0", "a1", "b1", "b2", "c1", "c2"], splits=["b1", "c1"], store_class=Recording)
    view.load("b1")
    for task_id in ("a1", "b1", "c1"):
        done(store, task_id)
    for task_id in ("a0", "b2", "c2"):
        store.create(layout.failed_object(task_id), b"{}")
    store.listed.clear()
    sweeper(store, clock, view).sweep("b1")
    assert swept_marker(store, "b1")[1] == {"end": "c1", "tasks": "2", "failed": "1", "confirmed": "1"}
    assert sorted(n for n in store.listed if n.startswith((layout.DONE, layout.FAILED))) == [
        "done/b1.json", "failed/b2.json"]


def test_a_region_the_view_never_loaded_is_listed_again_before_it_is_marked(tmp_path):
    store, clock, view = queue(tmp_path, ["a1"])
    done(store, "a1")
    sweeper(store, clock, view).sweep(layout.HEAD)  # nothing loaded: its second listing finds a1, and withdraws
    assert swept_marker(store, layout.HEAD) == (None, None) and view.tasks[layout.HEAD] == ["a1"]
    sweeper(store, clock, view).sweep(layout.HEAD)
    assert swept_marker(store, layout.HEAD)[1]["tasks"] == "1"


def test_a_swept_entry_that_the_rule_refuses_is_swept_again(tmp_path):
    store, clock, view = queue(tmp_path, ["a1"])
    view.load(layout.HEAD)
    done(store, "a1")
    view.swept[layout.HEAD] = {"end": "", "tasks": "1"}  # not confirmed: not swept by the rule
    sweeper(store, clock, view).sweep(layout.HEAD)
    assert swept_marker(store, layout.HEAD)[1]["confirmed"] == "1"


def test_a_marker_someone_else_wrote_and_never_confirmed_is_confirmed_by_us(tmp_path):
    store, clock, view = queue(tmp_path, ["a1", "b1"], splits=["b1"])
    view.load("b1")
    done(store, "b1")
    store.create(layout.swept_object(layout.HEAD), b"{}", metadata={"end": "b1", "confirmed": "1"})  # listed before ours
    store.create(layout.swept_object("b1"), b'{"by": "w0"}', metadata={"end": "", "tasks": "1", "failed": "0"})
    sweeper(store, clock, view).sweep("b1")
    record, metadata = swept_marker(store, "b1")
    assert record["worker"] == "w1" and metadata == {"end": "", "tasks": "1", "failed": "0", "confirmed": "1"}
    assert view.swept["b1"] == metadata


def test_a_marker_someone_else_confirmed_is_taken_as_it_is(tmp_path):
    store, clock, view = queue(tmp_path, ["a1"])
    view.load(layout.HEAD)
    done(store, "a1")
    theirs = {"end": "", "tasks": "1", "failed": "0", "confirmed": "1"}
    store.create(layout.swept_object(layout.HEAD), b'{"by": "w0"}', metadata=theirs)
    generation = store.read(layout.swept_object(layout.HEAD)).generation
    sweeper(store, clock, view).sweep(layout.HEAD)
    assert store.read(layout.swept_object(layout.HEAD)).generation == generation
    assert view.swept[layout.HEAD] == {"end": "", "tasks": "1", "failed": "0", "confirmed": "1"}
    assert clock.waits == []


class Vanishing(LocalStore):
    """A swept marker that is there for the create and gone for the listing after it (withdrawn in between)."""

    def create(self, name, data, metadata=None):
        if name.startswith(layout.SWEPT):
            super().create(name, b"{}")
            self.delete(name)
            raise PreconditionFailed(name)
        return super().create(name, data, metadata)


def test_a_marker_withdrawn_between_our_create_and_our_look_is_left_for_the_next_visit(tmp_path):
    store, clock, view = queue(tmp_path, ["a1"], store_class=Vanishing)
    view.load(layout.HEAD)
    done(store, "a1")
    sweeper(store, clock, view).sweep(layout.HEAD)
    assert swept_marker(store, layout.HEAD) == (None, None) and layout.HEAD not in view.swept


class Submitting(LocalStore):
    """A task is submitted into the region, or the marker removed, right after the marker is created."""

    def __init__(self, path, then):
        super().__init__(path)
        self.then = then

    def create(self, name, data, metadata=None):
        generation = super().create(name, data, metadata)
        if name.startswith(layout.SWEPT) and self.then:
            then, self.then = self.then, None
            then(self)
        return generation


def test_an_unconfirmed_marker_already_says_what_it_covers(tmp_path):
    seen = {}

    def look(store):
        seen["record"], seen["metadata"] = swept_marker(store, "b1")

    store, clock, view = queue(tmp_path, ["a1", "b1", "c1"], splits=["b1", "c1"], store_class=lambda p: Submitting(p, look))
    view.load("b1")
    done(store, "b1")
    sweeper(store, clock, view).sweep("b1")
    # Submit's un-sweep reads `end` from the listing, confirmed or not (taskqueue.submit.mark_regions).
    assert seen["metadata"] == {"end": "c1", "tasks": "1", "failed": "0"}
    assert seen["record"] == {"region": "b1", "end": "c1", "tasks": 1, "failed": 0, "worker": "w1", "swept_at": iso(0)}


def test_a_withdrawal_never_deletes_a_marker_written_after_ours(tmp_path):
    def resubmitted_and_swept_again(store):
        store.create("tasks/b2.json", b"{}")
        store.delete(layout.swept_object("b1"))
        store.create(layout.swept_object("b1"), b"theirs", metadata={"end": "c1"})

    store, clock, view = queue(tmp_path, ["a1", "b1", "c1"], splits=["b1", "c1"],
                               store_class=lambda p: Submitting(p, resubmitted_and_swept_again))  # fmt: skip
    view.load("b1")
    done(store, "b1")
    sweeper(store, clock, view).sweep("b1")
    assert store.read(layout.swept_object("b1")).data == b"theirs" and view.tasks["b1"] == ["b1", "b2"]


def test_a_task_submitted_after_the_sweepers_task_listing_withdraws_the_marker(tmp_path, caplog):
    store, clock, view = queue(tmp_path, ["a1", "b1"], splits=["b1"],
                               store_class=lambda p: Submitting(p, lambda s: s.create("tasks/b2.json", b"{}")))  # fmt: skip
    LocalStore.create(store, layout.swept_object(layout.HEAD), b"{}", metadata={"end": "b1", "confirmed": "1"})  # not the hook's
    view.load("b1")
    done(store, "b1")
    with caplog.at_level(logging.INFO, logger="taskqueue.sweep"):
        sweeper(store, clock, view).sweep("b1")
    assert swept_marker(store, "b1") == (None, None) and swept_marker(store, layout.HEAD)[0] == {}  # ours only
    assert view.tasks["b1"] == ["b1", "b2"] and "b1" not in view.swept
    assert "event=sweep_withdrawn region='b1' reason=new_tasks" in caplog.messages


def test_a_marker_the_submitter_removed_first_is_neither_withdrawn_again_nor_confirmed(tmp_path):
    def submit_and_remove(store):
        store.create("tasks/a2.json", b"{}")
        store.delete(layout.swept_object(layout.HEAD))

    store, clock, view = queue(tmp_path, ["a1"], store_class=lambda p: Submitting(p, submit_and_remove))
    view.load(layout.HEAD)
    done(store, "a1")
    sweeper(store, clock, view).sweep(layout.HEAD)  # its delete's 404 is no error
    assert swept_marker(store, layout.HEAD) == (None, None) and view.tasks[layout.HEAD] == ["a1", "a2"]
    store, clock, view = queue(tmp_path / "b", ["a1"],
                               store_class=lambda p: Submitting(p, lambda s: s.delete(layout.swept_object(layout.HEAD))))  # fmt: skip
    view.load(layout.HEAD)
    done(store, "a1")
    sweeper(store, clock, view).sweep(layout.HEAD)  # removed with no new task: the confirming write's 404
    assert swept_marker(store, layout.HEAD) == (None, None) and layout.HEAD not in view.swept


class Gapped(LocalStore):
    same_object_write_gap_s = 1.0


class GappedSlow(LocalStore):
    """The sweeper's second task listing takes `listing_s` of the clock's time."""

    same_object_write_gap_s = 1.0

    def __init__(self, path, clock, listing_s):
        super().__init__(path)
        self.clock, self.listing_s, self.created = clock, listing_s, False

    def create(self, name, data, metadata=None):
        self.created = self.created or name.startswith(layout.SWEPT)
        return super().create(name, data, metadata)

    def list_page(self, prefix, page_token=None, start_offset=None, page_size=1000, end_offset=None):
        if prefix == layout.TASKS and self.created:
            self.clock.now += self.listing_s
        return super().list_page(prefix, page_token, start_offset, page_size, end_offset)


def test_the_confirming_write_waits_out_the_second_since_the_create(tmp_path, caplog):
    store, clock, view = queue(tmp_path, ["a1"], store_class=Gapped)
    view.load(layout.HEAD)
    done(store, "a1")
    with caplog.at_level(logging.INFO, logger="taskqueue.sweep"):
        sweeper(store, clock, view).sweep(layout.HEAD)
    assert clock.waits == [1.0] and swept_marker(store, layout.HEAD)[1]["confirmed"] == "1"
    assert "event=swept region='' tasks=1" in caplog.messages
    for listing_s, waits in ((0.25, [0.75]), (1.0, []), (3.0, [])):  # the second listing took that long
        store, clock, view = queue(tmp_path / str(listing_s), ["a1"])
        store = GappedSlow(tmp_path / str(listing_s) / "q", clock, listing_s)
        view.store = store
        view.load(layout.HEAD)
        done(store, "a1")
        sweeper(store, clock, view).sweep(layout.HEAD)
        assert clock.waits == waits and swept_marker(store, layout.HEAD)[1]["confirmed"] == "1"

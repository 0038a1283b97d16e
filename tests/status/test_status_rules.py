"""reporting.status's rules on their own: what a snapshot counts, and when it says `complete`.

In-process on a local queue written object by object, so that mutation testing (`make mutants`)
reaches each rule of the snapshot: the region map and which regions count from their swept markers,
the two listings of `batches/` around the regions (a batch new, changed, running, or come and gone
unseen between them), done markers, dead letters and leases counted by region, and the line a
finished queue ends with, clean or with dead letters. Not the text and page views."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from objectstore.base import Entry
from objectstore.local import LocalStore
from reporting import status
from reporting.status import SNAPSHOT_TRIES, finished_text, snapshot
from taskqueue import layout
from taskqueue.lease import DEAD, DONE, HELD, RELEASED
from tests.queue.test_view import batch as write_batch
from tests.queue.test_view import prune


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def task(store, *ids):
    for task_id in ids:
        store.create(layout.task_object(task_id), json.dumps({"id": task_id}).encode())


def done(store, *ids, **metadata):
    for task_id in ids:
        store.create(layout.done_object(task_id), b"{}", metadata={k: str(v) for k, v in metadata.items()} or None)
        lease(store, task_id, DONE)


def dead(store, *ids, reason="consumer exit 65: bad input"):
    for task_id in ids:
        letter = {"task": task_id, "reason": reason, "errors": [{"error": f"boom {task_id}"}]}
        store.create(layout.failed_object(task_id), json.dumps(letter).encode(), metadata={"reason": reason})
        lease(store, task_id, DEAD)


def lease(store, task_id, state=HELD, worker="w0", ttl_s="30.0"):
    name = layout.lease_object(task_id)
    found = [e for e in store.list(layout.LEASES) if e.name == name]
    metadata = {"state": state, "worker": worker, "ttl_s": ttl_s}
    if found:
        return store.write(name, b"{}", found[0].generation, metadata=metadata)
    return store.create(name, b"{}", metadata=metadata)


def split(store, *ids):
    for task_id in ids:
        store.create(layout.split_object(task_id), b"{}")


def swept(store, region, tasks, failed=0, end=None, confirmed=True, **metadata):
    metadata = {"tasks": str(tasks), "failed": str(failed), **({"end": end} if end else {}),
                **({"confirmed": "1"} if confirmed else {}), **metadata}  # fmt: skip
    store.create(layout.swept_object(region), b"{}", metadata=metadata)


def batch(store, name, first, last, state=layout.BATCH_DONE, tasks="1"):
    return write_batch(store, name, first, last, state, tasks)


class Meddled(LocalStore):
    """A local queue in which something happens while a snapshot looks: `meddle` runs after the
    regions were listed and before `batches/` is listed again (once per look, `tries` counting them),
    and the snapshot's listings of `batches/` are counted (not those of `meddle` itself)."""

    def __init__(self, path, meddle=None) -> None:
        super().__init__(path)
        self.meddle = meddle
        self.batch_listings = 0
        self.tries = 0
        self._regions_listed = False

    def list_page(self, prefix, page_token=None, start_offset=None, page_size=1000, end_offset=None):
        if self.meddle is not None:
            if prefix == layout.TASKS:
                self._regions_listed = True
            if prefix == layout.BATCHES:
                self.batch_listings += 1
                if self._regions_listed:
                    self._regions_listed = False
                    self.tries += 1
                    meddle, self.meddle = self.meddle, None  # not inside its own listings
                    try:
                        meddle(self, self.tries)
                    finally:
                        self.meddle = meddle
        return super().list_page(prefix, page_token, start_offset, page_size, end_offset)


# -- counts ---------------------------------------------------------------------------------------


def test_an_open_queue_counts_each_task_by_its_marker_or_its_lease(tmp_path):
    store = LocalStore(tmp_path / "q")
    task(store, "a", "b", "c", "d", "e", "f", "g")
    done(store, "a", seconds=2.0)
    dead(store, "b")
    lease(store, "c", worker="w1")
    lease(store, "d", worker="w1")
    lease(store, "e", state=RELEASED)
    lease(store, "f", worker="w2", ttl_s="0.5")  # silent past its TTL by the time status looks
    view = snapshot(store, now=now() + dt.timedelta(seconds=5))
    assert (view["total"], view["done"], view["failed"]) == (7, 1, 1)
    assert (view["leased"], view["stale"], view["released"], view["pending"]) == (2, 1, 1, 2)
    assert view["holders"] == {"w1": 2}
    assert [s["task"] for s in view["stale_leases"]] == ["f"] and view["stale_leases"][0]["worker"] == "w2"
    assert not view["complete"] and "unfinished" not in view
    assert not view["estimate"] and view["submitting"] == []
    assert view["regions"] == {"total": 1, "swept": 0, "open": 1, "listed": 1}


def test_a_lease_without_a_state_is_held_and_one_whose_task_has_a_done_marker_is_not_counted(tmp_path):
    store = LocalStore(tmp_path / "q")
    task(store, "a", "b")
    store.create(layout.lease_object("a"), b"{}", metadata={"worker": "w1", "ttl_s": "30"})
    store.create(layout.done_object("b"), b"{}")
    lease(store, "b", worker="w9")  # its tombstone not written yet: the done marker counts
    view = snapshot(store, now=now())
    assert (view["leased"], view["done"], view["holders"]) == (1, 1, {"w1": 1})


def test_the_done_markers_counters_are_summed_and_each_region_counts_only_its_own_leases(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "b")
    task(store, "a1", "a2", "a3", "b1", "b2")
    done(store, "a1", counters=json.dumps({"rows": 3}))
    done(store, "b1", counters=json.dumps({"rows": 4}))
    lease(store, "a2", worker="w1")
    store.create(layout.lease_object("b2"), b"{}", metadata={"state": HELD, "ttl_s": "30"})  # no worker said
    view = snapshot(store, now=now())
    assert view["counters"] == {"rows": 7}
    assert view["leased"] == 2 and view["holders"] == {"?": 1, "w1": 1}


def test_a_lease_is_stale_only_once_silent_for_longer_than_its_ttl(tmp_path):
    store = LocalStore(tmp_path / "q")
    task(store, "a")
    lease(store, "a", worker="w1", ttl_s="30.0")
    (entry,) = store.list(layout.LEASES)
    at_ttl = snapshot(store, now=entry.updated + dt.timedelta(seconds=30))
    assert (at_ttl["leased"], at_ttl["stale"]) == (1, 0)
    past = snapshot(store, now=entry.updated + dt.timedelta(seconds=30.25))
    assert (past["leased"], past["stale"]) == (0, 1)
    assert past["stale_leases"] == [{"task": "a", "worker": "w1", "silent_s": 30.2}]


def test_a_lease_with_no_ttl_is_never_stale(tmp_path):
    store = LocalStore(tmp_path / "q")
    task(store, "a")
    store.create(layout.lease_object("a"), b"{}", metadata={"state": HELD, "worker": "w1"})
    view = snapshot(store, now=now() + dt.timedelta(days=1))
    assert (view["leased"], view["stale"]) == (1, 0)


def test_a_finished_queue_is_complete_and_says_so_cleanly(tmp_path):
    store = LocalStore(tmp_path / "q")
    task(store, "a", "b")
    done(store, "a", "b")
    batch(store, "x", "a", "b")
    view = snapshot(store, now=now())
    assert view["complete"] and (view["total"], view["done"], view["failed"]) == (2, 2, 0)
    assert view["blockers"] == [] and view["blockers_total"] == {"batch": 0, "stale_lease": 0, "dead_letter": 0}
    assert finished_text(view) == "complete: every task has a done or failed marker"


def test_a_queue_finished_with_dead_letters_is_complete_but_says_it_is_not_clean(tmp_path):
    store = LocalStore(tmp_path / "q")
    task(store, "a", "b")
    dead(store, "a", "b")
    view = snapshot(store, now=now())
    assert view["complete"], "nothing is left to run: the keeper and the workers stop"
    assert (view["done"], view["failed"]) == (0, 2)
    assert view["blockers_total"]["dead_letter"] == 2
    assert [b["task"] for b in view["blockers"] if b["kind"] == "dead_letter"] == ["a", "b"]
    assert finished_text(view) == (
        f"finished: 0 done, 2 dead letters: the job's outputs miss them; `tools/status.py {view['queue']} --machines` "
        "lists every one with its reason (fix the cause, submit again under new ids)"
    )


def test_one_dead_letter_is_said_in_the_singular():
    view = {"done": 3, "failed": 1, "queue": "gs://b/q"}
    assert finished_text(view) == (
        "finished: 3 done, 1 dead letter: the job's outputs miss it; `tools/status.py gs://b/q --machines` "
        "lists every one with its reason (fix the cause, submit again under new ids)"
    )


def test_a_queue_whose_every_task_is_done_is_not_complete_while_a_batch_still_submits(tmp_path):
    store = LocalStore(tmp_path / "q")
    task(store, "a")
    done(store, "a")
    batch(store, "x", "a", "b", state=layout.BATCH_RUNNING)  # b not created yet
    view = snapshot(store, now=now())
    assert view["total"] == view["done"] == 1 and view["submitting"] == ["a"]
    assert not view["complete"]


def test_watching_with_a_cache_lists_the_task_lists_of_open_regions_once_in_ten_looks(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "c")
    task(store, "a", "b", "c1", "c2")
    done(store, "a")
    cache = status.RegionCache()
    views = [snapshot(store, now=now(), cache=cache) for _ in range(11)]
    assert [v["requests_by_kind"].get("list tasks/", 0) for v in views] == [2, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0]
    assert [v["total"] for v in views] == [4] * 11  # the cached lists of both regions count
    assert cache.tasks == {layout.HEAD: {"a", "b"}, "c": {"c1", "c2"}}


def test_an_empty_queue_is_not_complete(tmp_path):
    store = LocalStore(tmp_path / "q")
    view = snapshot(store, now=now())
    assert view["total"] == 0 and not view["complete"]


def test_requests_are_counted_by_kind(tmp_path):
    store = LocalStore(tmp_path / "q")
    task(store, "a")
    view = snapshot(store, now=now())
    assert view["requests"] == sum(view["requests_by_kind"].values())
    assert list(view["requests_by_kind"]) == sorted(view["requests_by_kind"])
    assert view["requests_by_kind"]["list batches/"] == 2  # before the regions and after
    assert view["requests_by_kind"]["list tasks/"] == 1


# -- regions ---------------------------------------------------------------------------------------


def test_a_swept_region_counts_from_its_marker_and_open_ones_from_their_listings(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "b", "c")
    task(store, "a1", "b1", "b2", "c1", "c2", "c3")
    swept(store, layout.HEAD, tasks=40, failed=3, end="b")  # its marker counts, not its listing
    done(store, "b1")
    dead(store, "c1")
    swept(store, "c", tasks=3, failed=1, confirmed=False)  # unconfirmed: listed
    view = snapshot(store, now=now())
    assert (view["total"], view["done"], view["failed"]) == (40 + 2 + 3, 37 + 1 + 0, 3 + 1)
    assert view["regions"] == {"total": 3, "swept": 1, "open": 2, "listed": 2}
    assert view["pending"] == 45 - 38 - 4


def test_a_marker_covers_the_regions_a_later_cut_made_of_its_region_and_those_count_once(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "b", "c", "e")
    task(store, "a1", "b1", "c1", "d1", "e1")
    swept(store, layout.HEAD, tasks=2, end="c")  # written before a submit cut [HEAD, c) at b
    swept(store, "b", tasks=99)  # b's own marker: covered by the head's, not counted again
    swept(store, "c", tasks=2, end="e")
    swept(store, "e", tasks=50)
    view = snapshot(store, now=now())
    assert view["total"] == 2 + 2 + 50 and view["regions"]["swept"] == 3 and view["regions"]["open"] == 0
    assert view["complete"]


def test_a_marker_without_an_end_covers_everything_after_it(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "b", "c")
    task(store, "a1", "b1", "c1")
    swept(store, layout.HEAD, tasks=3, end=None)  # written when the head region was the whole queue
    swept(store, "c", tasks=7)
    view = snapshot(store, now=now())
    assert view["total"] == 3 and view["regions"]["swept"] == 1 and view["regions"]["open"] == 0


def test_a_marker_that_does_not_reach_its_region_end_is_listed(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "c")
    task(store, "a1", "b1", "c1")
    swept(store, layout.HEAD, tasks=1, end="b")  # short of its region's end (c): it does not cover the region
    view = snapshot(store, now=now())
    assert view["regions"]["swept"] == 0 and view["total"] == 3


def test_a_swept_region_under_a_running_batch_is_listed_and_one_elsewhere_is_not(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "b")
    task(store, "a1", "b1", "b2")
    swept(store, layout.HEAD, tasks=1, end="b")
    swept(store, "b", tasks=1)
    batch(store, "x", "b2", "b2", state=layout.BATCH_RUNNING)  # adding b2 to a swept region
    view = snapshot(store, now=now())
    assert view["regions"] == {"total": 2, "swept": 1, "open": 1, "listed": 1}
    assert view["total"] == 1 + 2 and view["submitting"] == ["b2"] and not view["complete"]
    assert view["blockers_total"]["batch"] == 1


def test_a_running_batch_before_a_swept_region_leaves_it_counted_from_its_marker(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "b")
    task(store, "a1", "b1")
    swept(store, "b", tasks=5)
    batch(store, "x", "a1", "a1", state=layout.BATCH_RUNNING)  # in the head region, before b
    view = snapshot(store, now=now())
    assert view["regions"] == {"total": 2, "swept": 1, "open": 1, "listed": 1} and view["total"] == 1 + 5


def test_a_running_batch_in_a_region_cut_from_a_marker_keeps_the_whole_marker_from_counting(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "b")
    task(store, "a1", "b1", "b2")
    swept(store, layout.HEAD, tasks=2, end=None)  # covers b's region too
    batch(store, "x", "b2", "b2", state=layout.BATCH_RUNNING)
    view = snapshot(store, now=now())
    assert view["regions"]["swept"] == 0 and view["total"] == 3  # sim seed 11605


def test_dead_letters_count_in_their_own_region_only_and_by_reason(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "b")
    task(store, "a1", "b1", "b2")
    swept(store, layout.HEAD, tasks=1, failed=1, end="b")
    dead(store, "a1", reason="r1")  # counted by the head's marker, not again
    dead(store, "b1", "b2", reason="r2")
    view = snapshot(store, now=now())
    assert view["failed"] == 3 and view["total"] == 3
    assert view["failed_by_reason"] == {"r1": 1, "r2": 2}
    assert set(view["failed_reasons"]) == {"a1", "b1", "b2"}


def test_a_sample_estimates_the_open_regions_it_did_not_list_and_is_never_complete(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "b", "c", "d")
    task(store, "a1", "a2", "b1", "b2", "c1", "c2", "d1", "d2")
    done(store, "a1", "a2", "b1", "b2", "c1", "c2", "d1", "d2")
    view = snapshot(store, now=now(), sample=2, seed=1)
    assert view["estimate"] and view["regions"] == {"total": 4, "swept": 0, "open": 4, "listed": 2}
    assert (view["total"], view["done"]) == (8, 8)
    assert not view["complete"]
    full = snapshot(store, now=now(), sample=4, seed=1)
    assert not full["estimate"] and full["complete"]


def test_the_seed_decides_which_regions_a_sample_lists(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "b", "c", "d")
    task(store, "a1", "b1", "b2", "c1", "c2", "c3", "d1", "d2", "d3", "d4")  # regions of 1, 2, 3 and 4 tasks
    totals = {seed: snapshot(store, now=now(), sample=2, seed=seed)["total"] for seed in range(8)}
    assert totals == {seed: snapshot(store, now=now(), sample=2, seed=seed)["total"] for seed in range(8)}
    assert len(set(totals.values())) > 1  # and the seeds do choose


def test_without_history_the_done_markers_of_swept_regions_are_not_listed(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "b")
    task(store, "a1", "b1")
    done(store, "a1")
    swept(store, layout.HEAD, tasks=1, end="b")
    view = snapshot(store, now=now())
    assert view["requests_by_kind"]["list done/"] == 1  # b's, open
    assert view["curve"] is None  # no completion listed: the curve starts at the swept count
    assert snapshot(store, now=now(), history=True)["requests_by_kind"]["list done/"] == 2


def test_the_region_of_an_id_and_the_offsets_of_a_region():
    splits = [layout.HEAD, "b", "d"]
    keys = [""] + [layout.key(s) for s in splits[1:]]
    assert [status._region_of(splits, keys, t) for t in ("a", "b", "c", "d", "z")] == ["", "b", "b", "d", "d"]
    assert status._range(layout.DONE, layout.HEAD, "b") == {"start_offset": None, "end_offset": layout.DONE + "b.json"}
    assert status._range(layout.DONE, "b", None) == {"start_offset": layout.DONE + "b.json", "end_offset": None}


def test_the_region_map_names_swept_markers_by_region_and_skips_other_objects(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "b", "c")
    store.create("splits/-not-an-id.json", b"{}")
    swept(store, layout.HEAD, tasks=1)
    swept(store, "c", tasks=1, confirmed=False)
    store.create("swept/-not/a.json", b"{}")
    splits, markers = status._regions(store)
    assert splits == [layout.HEAD, "b", "c"]
    assert set(markers) == {layout.HEAD, "c"} and markers["c"] == {"tasks": "1", "failed": "0"}


# -- batches -----------------------------------------------------------------------------------------


def test_batches_are_those_markers_with_a_range_and_the_prune_mark_is_apart(tmp_path):
    store = LocalStore(tmp_path / "q")
    batch(store, "x", "a", "b", state=layout.BATCH_RUNNING)
    batch(store, "y", "c", "d")
    store.create(layout.batch_object("half"), b"{}", metadata={"first": "e"})
    store.create(layout.batch_object("other"), b"{}", metadata={"last": "e"})
    prune(store, now())
    batches, pruned, newest = status._batches(store)
    assert set(batches) == {layout.batch_object("x"), layout.batch_object("y")}
    assert pruned is not None and pruned[0] > 0
    assert newest == max(e.updated for e in store.list(layout.BATCHES))
    assert status._running(batches) == [("a", "b")]


def test_running_batches_are_in_the_order_of_their_first_ids(tmp_path):
    store = LocalStore(tmp_path / "q")
    batch(store, "x", "m", "n", state=layout.BATCH_RUNNING)
    batch(store, "y", "c", "d", state=layout.BATCH_RUNNING)
    store.create(layout.batch_object("z"), b"{}", metadata={"first": "e", "last": "f"})  # no state: running
    assert status._running(status._batches(store)[0]) == [("c", "d"), ("e", "f"), ("m", "n")]


def test_the_newest_update_of_a_listing_is_its_latest(tmp_path):
    store = LocalStore(tmp_path / "q")
    batch(store, "x", "a", "a")
    batch(store, "y", "b", "b")
    prune(store, now())
    times = sorted(e.updated for e in store.list(layout.BATCHES))
    assert status._batches(store)[2] == times[-1]
    store.delete(layout.PRUNED)
    store.delete(layout.batch_object("y"))
    batch(store, "y", "b", "b")
    batch(store, "x2", "a", "a")
    assert status._batches(store)[2] == max(e.updated for e in store.list(layout.BATCHES))
    assert status._batches(LocalStore(tmp_path / "empty"))[2] is None


def test_a_batch_that_changes_while_status_lists_makes_it_look_again(tmp_path):
    def once(store, tries):
        if tries == 1:
            task(store, "b")
            batch(store, "x", "b", "b")  # began and finished while the regions were listed

    store = Meddled(tmp_path / "q", once)
    task(store, "a")
    done(store, "a")
    view = snapshot(store, now=now())
    assert store.tries == 2 and store.batch_listings == 4
    assert view["total"] == 2 and not view["complete"]  # b counted on the second look, and unfinished


def test_a_batch_that_changes_at_every_look_leaves_the_queue_not_complete(tmp_path):
    def always(store, tries):
        batch(store, "x", "a", "a")  # a new generation at every look

    store = Meddled(tmp_path / "q", always)
    task(store, "a")
    done(store, "a")
    view = snapshot(store, now=now())
    assert store.tries == SNAPSHOT_TRIES == 3 and store.batch_listings == 2 * SNAPSHOT_TRIES
    assert view["total"] == 1 and view["done"] == 1 and not view["complete"]
    assert view["submitting"] == []


def test_a_batch_finished_before_status_looked_does_not_keep_it_looking(tmp_path):
    store = Meddled(tmp_path / "q", lambda store, tries: None)
    task(store, "a")
    done(store, "a")
    batch(store, "x", "a", "a")
    view = snapshot(store, now=now())
    assert store.tries == 1 and view["complete"]


@pytest.mark.parametrize("pruned_before_listing", [False, True])
def test_a_batch_that_came_and_went_between_the_two_listings_keeps_the_queue_from_complete(tmp_path, pruned_before_listing):
    """The only trace of a batch created and deleted while status listed the regions is the prune
    mark, whose `before` is later than anything the first listing held."""

    def come_and_go(store, tries):
        if tries == 1:
            task(store, "z")  # its batch marker created, finished and pruned: only the prune mark says so
            prune(store, now() + dt.timedelta(hours=1))

    store = Meddled(tmp_path / "q", come_and_go)
    task(store, "a")
    done(store, "a")
    batch(store, "x", "a", "a")
    if pruned_before_listing:
        prune(store, now() - dt.timedelta(hours=1))
    view = snapshot(store, now=now())
    assert store.tries == 2, "status looked once: a batch that came and went was not seen"
    assert view["total"] == 2 and not view["complete"], "complete while task z has no marker"


def test_a_prune_of_batches_older_than_the_first_listing_is_no_change(tmp_path):
    def prune_old(store, tries):
        if tries == 1:
            prune(store, dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc))

    store = Meddled(tmp_path / "q", prune_old)
    task(store, "a")
    done(store, "a")
    batch(store, "x", "a", "a")
    view = snapshot(store, now=now())
    assert store.tries == 1 and view["complete"]


def test_the_batches_running_after_the_regions_are_those_said_to_be_submitting(tmp_path):
    def begin(store, tries):
        if tries == SNAPSHOT_TRIES:
            batch(store, "late", "z", "z", state=layout.BATCH_RUNNING)
        else:
            batch(store, "x", "a", "a")

    store = Meddled(tmp_path / "q", begin)
    task(store, "a")
    done(store, "a")
    view = snapshot(store, now=now())
    assert view["submitting"] == ["z"]
    assert [b["batch"] for b in view["blockers"] if b["kind"] == "batch"] == ["late"]
    assert view["blockers_total"]["batch"] == 1


# -- rate, ETA and the completion curve ------------------------------------------------------------


def done_at(store, task_id, at, **metadata):
    """A done marker whose worker says it finished at `at` (its `completed_at`), whatever the store's clock."""
    done(store, task_id, completed_at=at.isoformat(), **metadata)


def test_the_rate_counts_completions_of_the_last_ten_minutes_over_their_span_with_a_two_sigma_range(tmp_path):
    store = LocalStore(tmp_path / "q")
    at = now()
    task(store, "d0", "d1", "d2", "d3", "d4", "d5", "d6", "d7", "p1", "p2", "p3")
    # Seven in the window, its two ends included (600 s ago and now); one a second before it. A worker's
    # time in another zone is the same instant; one without a zone is UTC. Seconds that are no number, or
    # infinite, are no task's duration.
    times = [at - dt.timedelta(seconds=ago) for ago in (600, 500, 400, 300, 200, 100, 0, 601)]
    texts = [t.isoformat() for t in times]
    texts[1] = times[1].astimezone(dt.timezone(dt.timedelta(hours=2))).isoformat()
    texts[2] = times[2].replace(tzinfo=None).isoformat()
    seconds = [1.0, 2.12345, 5.0, "inf", "inf", "soon"]
    for i, text in enumerate(texts):
        done(store, f"d{i}", completed_at=text, **({"seconds": seconds[i]} if i < len(seconds) else {}))
    view = snapshot(store, now=at)
    assert (view["total"], view["done"], view["pending"]) == (11, 8, 3)
    assert view["recent_done"] == 7 and view["rate_window_s"] == 600.0
    assert view["rate_since"] == (at - dt.timedelta(seconds=600)).isoformat(timespec="seconds")
    assert view["tasks_per_s"] == 0.0117  # 7 / 600 s
    assert view["eta_s"] == 257.1  # 3 remaining at 7 / 600 s
    # 7 +- 2 sqrt(7) completions in 600 s: 3 remaining take 146.4 s at best, 1053.6 s at worst
    assert view["eta_range_s"] == [146.4, 1053.6]
    assert view["median_task_s"] == 2.123  # of the markers that say their seconds


def test_a_queue_with_nothing_remaining_has_an_eta_of_zero_and_one_without_a_rate_none(tmp_path):
    store = LocalStore(tmp_path / "q")
    task(store, "a", "b")
    done(store, "a")
    lease(store, "b", worker="w1")
    waiting = snapshot(store, now=now())
    assert waiting["tasks_per_s"] is None and waiting["rate_since"] is None  # one completion is no rate
    assert waiting["eta_s"] is None and waiting["eta_range_s"] is None
    done(store, "b")
    finished = snapshot(store, now=now())
    assert (finished["pending"], finished["eta_s"], finished["eta_range_s"]) == (0, 0.0, [0.0, 0.0])


def test_an_estimate_scales_the_listed_regions_completions_and_leases_but_not_the_swept_regions(tmp_path):
    """Regions b and c alike, so that whichever the sample lists the estimate is the same."""
    store = LocalStore(tmp_path / "q")
    at = now()
    split(store, "b", "c")
    task(store, "a1", "a2", "b1", "b2", "b3", "c1", "c2", "c3")
    goodput = {"goodput_ms_steady": 3000, "goodput_ms_weights": 1000, "goodput_attempts": 1}
    swept(store, layout.HEAD, tasks=2, end="b", counters=json.dumps({"rows": 5, **goodput}))
    done_at(store, "a1", at)
    done_at(store, "a2", at - dt.timedelta(seconds=1000))  # before the window: on the curve only
    for region in "bc":
        done_at(store, f"{region}1", at - dt.timedelta(seconds=0.5), counters=json.dumps({"rows": 3}))
        lease(store, f"{region}2", worker="w1")
    view = snapshot(store, now=at, sample=1, seed=0, history=True)
    assert view["estimate"] and view["regions"] == {"total": 3, "swept": 1, "open": 2, "listed": 1}
    assert (view["total"], view["done"], view["leased"], view["pending"]) == (2 + 3 * 2, 2 + 1 * 2, 1 * 2, 2)
    assert view["holders"] == {"w1": 1}  # of the listed region: not scaled
    assert view["counters"] == {"rows": 5 + 3} and view["goodput"]["goodput"] == 0.75
    # One listed completion (counted twice) and one swept (once), 0.5 s apart: a span of at least 1 s.
    assert view["recent_done"] == 2 and view["tasks_per_s"] == 3.0
    assert view["rate_since"] == (at - dt.timedelta(seconds=0.5)).isoformat(timespec="seconds")
    assert view["eta_s"] == 1.3 and view["eta_range_s"] == [0.6, None]  # 3 - 2 sqrt(2) * 1.5 < 0: no latest
    curve = view["curve"]
    assert curve["floor"] == 0 and curve["start"] == (at - dt.timedelta(seconds=1000)).isoformat(timespec="seconds")
    assert curve["points"][0] == [0.0, 1] and curve["points"][-1] == [1000.0, 4]


def test_without_history_the_curve_starts_at_what_the_swept_regions_finished_well(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "b")
    task(store, "a1", "a2", "a3", "b1")
    swept(store, layout.HEAD, tasks=3, failed=1, end="b")
    done(store, "b1")
    curve = snapshot(store, now=now())["curve"]
    assert curve["floor"] == 2 and curve["points"][-1][1] == 3


def test_with_history_a_watch_lists_a_swept_regions_done_markers_once_and_only_that_regions(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "b")
    task(store, "a1", "b1")
    done(store, "a1", "b1")
    swept(store, layout.HEAD, tasks=1, end="b")
    cache = status.RegionCache()
    first, second = (snapshot(store, now=now(), cache=cache, history=True) for _ in range(2))
    assert [v["requests_by_kind"]["list done/"] for v in (first, second)] == [2, 1]  # the head's, then b's only
    assert [v["recent_done"] for v in (first, second)] == [2, 2]  # a1 from the head's listing, b1 from b's
    assert [v["curve"]["points"][-1][1] for v in (first, second)] == [2, 2]


def test_the_curve_counts_open_completions_scaled_and_swept_ones_from_the_floor(tmp_path):
    t0 = dt.datetime(2026, 11, 28, 10, 0, 0, tzinfo=dt.timezone.utc)
    ago = [t0 + dt.timedelta(seconds=s) for s in (2.5, 10)]
    swept_times = [t0, t0 + dt.timedelta(seconds=30)]
    # 60 points 1.25 s apart from t0 to now; an open completion counts 2 (scale), a swept one 1, on a floor of 5.
    curve = status._curve(ago, swept_times, t0 + dt.timedelta(seconds=73.75), 2.0, 5)
    assert curve["start"] == "2026-11-28T10:00:00+00:00" and curve["floor"] == 5 and len(curve["points"]) == 60
    points = curve["points"]
    assert [points[k] for k in (0, 1, 2, 7, 8, 23, 24, 59)] == [
        [0.0, 6], [1.2, 6], [2.5, 8], [8.8, 8], [10.0, 10], [28.8, 10], [30.0, 11], [73.8, 11]
    ]
    only_open = status._curve([t0], [], t0, 1.0, 0)  # no time between the first completion and now: a span of 1 s
    assert only_open["points"][-1] == [1.0, 1]
    assert status._curve([], [t0], t0, 1.0, 0)["points"][0] == [0.0, 1]
    assert status._curve([], [], t0, 1.0, 0) is None


# -- slices, stale leases, dead letters ------------------------------------------------------------


def test_a_slice_is_counted_with_its_hosts_when_its_leader_holds_a_lease(tmp_path):
    from taskqueue.slice import assignment_object

    store = LocalStore(tmp_path / "q")
    task(store, "a", "b")
    lease(store, "a", worker="lead-x")
    lease(store, "b", worker="w9")
    for slice_id, metadata in {"x": {"leader": "lead-x", "hosts": "4"},
                               "y": {"leader": "idle-y", "hosts": "2"},  # holds nothing
                               "z": {"leader": "w9"},  # says no hosts
                               "v": {"leader": "w9", "hosts": "two"}}.items():  # fmt: skip
        store.create(assignment_object(slice_id), b"{}", metadata=metadata)
    view = snapshot(store, now=now())
    assert view["holders"] == {"lead-x": 1, "w9": 1} and view["slice_hosts"] == {"lead-x": 4}


def test_stale_leases_are_named_in_the_order_of_their_task_ids(tmp_path):
    store = LocalStore(tmp_path / "q")
    task(store, "a", "a.5")
    lease(store, "a", ttl_s="0.5")
    lease(store, "a.5", ttl_s="0.5")  # listed first: `a.5.json` sorts before `a.json`
    view = snapshot(store, now=now() + dt.timedelta(seconds=5))
    assert [s["task"] for s in view["stale_leases"]] == ["a", "a.5"]


def test_a_dead_letter_of_an_id_before_X_counts_in_the_head_region(tmp_path):
    store = LocalStore(tmp_path / "q")
    split(store, "b")
    task(store, "0", "a1", "b1")
    dead(store, "0")
    swept(store, "b", tasks=1)
    view = snapshot(store, now=now())
    assert view["regions"]["swept"] == 1 and (view["total"], view["failed"]) == (3, 1)


def test_each_dead_letter_read_gives_its_reason_and_the_first_line_of_its_message(tmp_path):
    store = LocalStore(tmp_path / "q")
    task(store, "a", "b", "c")
    dead(store, "a")
    store.create(layout.failed_object("b"), json.dumps({"task": "b", "message": "disk full\nat /data"}).encode())
    store.create(layout.failed_object("c"), b"not json")
    view = snapshot(store, now=now())
    reasons = view["failed_reasons"]
    assert (reasons["a"], reasons["b"]) == ("consumer exit 65: bad input", "?")
    assert reasons["c"].startswith("(unreadable dead letter: ")
    assert view["failed_details"] == {"a": "boom a", "b": "disk full", "c": None}


@pytest.mark.parametrize("letter, line", [
    ({"message": "disk full\nat /data", "errors": [{"error": "boom"}]}, "disk full"),
    ({"message": "m" * 600}, "m" * 500),
    ({"errors": [{"error": "first"}, {"error": "second"},
                 {"error": "Traceback (most recent call last):\n  File x\n\nValueError: " + "v" * 600}]},
     ("ValueError: " + "v" * 600)[:500]),
    ({"errors": [{"error": "first"}, {"error": "start\nevent=bad_input exit=65 error=row 3 of t1: error=null\n"
                                               "Traceback\nSystemExit: 65"}]}, "row 3 of t1: error=null"),
    ({"errors": [{"error": "event=bad_input exit=65 error=" + "r" * 600}]}, "r" * 500),
    ({"errors": [{"error": "event=upload_failed error=timeout"}]}, "event=upload_failed error=timeout"),
    ({"errors": []}, None),
    ({"errors": ["not a record"]}, None),
    ({"errors": [{"attempt": 1}]}, None),
    ({}, None),
])  # fmt: skip
def test_the_first_line_of_a_dead_letter_is_its_message_or_the_last_attempts_bad_input_or_last_line(letter, line):
    assert status.first_line(letter) == line


def test_the_blockers_name_each_running_batch_stale_lease_and_dead_letter_with_the_command_that_clears_it():
    t0 = dt.datetime(2026, 11, 28, 10, 0, 0, tzinfo=dt.timezone.utc)

    def running(name, first, last, seconds, **metadata):
        updated = t0 + dt.timedelta(seconds=seconds)
        return Entry(layout.batch_object(name), 1, 0, updated, {"first": first, "last": last, **metadata})

    # In the order of their names, as listed; named oldest first. `skew` was updated after status's now.
    batches = [running("aa", "d", "d", 10), running("skew", "e", "e", 20, tasks="1"),
               running("zz", "a", "c", 0, tasks="3")]  # fmt: skip
    view = {"queue": "/q/my queue", "stale_leases": [{"task": "s1", "worker": "w1", "silent_s": 45.0}],
            "failed_reasons": {"f1": "consumer exit 65: bad input"}}  # fmt: skip
    found = status.blockers(view, batches, t0 + dt.timedelta(seconds=12.345))
    finish = ("wait for its submit, or run that submit again; if it will never run again: "
              "gcs-spawner submit '/q/my queue' --finish-batch ")  # fmt: skip
    assert found == [
        {"kind": "batch", "batch": "zz", "first": "a", "last": "c", "tasks": 3, "running_s": 12.3, "clear": finish + "zz"},
        {"kind": "batch", "batch": "aa", "first": "d", "last": "d", "tasks": None, "running_s": 2.3, "clear": finish + "aa"},
        {"kind": "batch", "batch": "skew", "first": "e", "last": "e", "tasks": 1, "running_s": 0.0, "clear": finish + "skew"},
        {"kind": "stale_lease", "task": "s1", "worker": "w1", "silent_s": 45.0,
         "clear": "any running worker takes it over; with none left, start one: "
                  "python spawn.py '/q/my queue' --consumer 'python consume.py'"},
        {"kind": "dead_letter", "task": "f1", "reason": "consumer exit 65: bad input",
         "clear": "fix the cause, then submit the task again under a new id: gcs-spawner submit '/q/my queue' "
                  "--tasks FILE (tasks and their outcomes are immutable)"},
    ]  # fmt: skip

"""taskqueue.view on its own: what a worker's view of the queue holds after each listing.

In-process on a local store (with small listing pages where the map's pages matter) and a clock the
test sets, so that mutation testing (`make mutants`) reaches every branch of `QueueView`: the map's
pages and refreshes, the swept markers that count, batches as news (new, changed, gone, or come and
gone unseen), each region's task and lease listings, the lease sightings a claim is judged by, and
the cache's bounds."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from objectstore.local import LocalStore
from taskqueue import layout, view as view_module
from taskqueue.lease import DEAD, DONE, HELD, RELEASED
from taskqueue.view import MAP_REFRESH_S, MAX_LOADED_REGIONS, SWEPT_REFRESH_S, QueueView, Sighting, offset
from tests.queue.test_lease import SetClock


class Pages(LocalStore):
    """A local store whose listings come `page` entries a page, and which counts them by prefix."""

    def __init__(self, path, page: int = 1000) -> None:
        super().__init__(path)
        self.page = page
        self.listed: list[str] = []

    def list_page(self, prefix, page_token=None, start_offset=None, page_size=1000, end_offset=None):
        self.listed.append(prefix)
        return super().list_page(prefix, page_token, start_offset, min(page_size, self.page), end_offset)


def queue(tmp_path, ids=(), splits=(), page=1000, scan=True):
    store = Pages(tmp_path / "q", page)
    for task_id in ids:
        store.create(layout.task_object(task_id), json.dumps({"id": task_id}).encode(),
                     metadata={"manifest": json.dumps({"id": task_id})})  # fmt: skip
    for task_id in splits:
        store.create(layout.split_object(task_id), b"{}")
    clock = SetClock()
    view = QueueView(store, clock)
    if scan:
        view.scan_map()
    store.listed.clear()
    return store, clock, view


def lease(store, task_id, state=HELD, worker="w0", ttl_s="30.0"):
    metadata = {"state": state, "worker": worker, "ttl_s": ttl_s}
    name = layout.lease_object(task_id)
    found = [e for e in store.list(layout.LEASES) if e.name == name]
    if found:
        return store.write(name, b"{}", found[0].generation, metadata=metadata)
    return store.create(name, b"{}", metadata=metadata)


def swept(store, region, confirmed=True, end=None):
    metadata = {"tasks": "1", "failed": "0", **({"confirmed": "1"} if confirmed else {}), **({"end": end} if end else {})}
    store.create(layout.swept_object(region), b"{}", metadata=metadata)


def batch(store, name, first, last, state=layout.BATCH_RUNNING, tasks="1"):
    """Write batch `name`'s marker (created, or rewritten over the one there); the status tests share it."""
    found = [e for e in store.list(layout.BATCHES) if e.name == layout.batch_object(name)]
    metadata = {"first": first, "last": last, "state": state, "tasks": tasks}
    if found:
        return store.write(layout.batch_object(name), b"{}", found[0].generation, metadata=metadata)
    return store.create(layout.batch_object(name), b"{}", metadata=metadata)


def prune(store, before: dt.datetime):
    found = [e for e in store.list(layout.BATCHES) if e.name == layout.PRUNED]
    metadata = {"before": before.isoformat()}
    if found:
        return store.write(layout.PRUNED, b"{}", found[0].generation, metadata=metadata)
    return store.create(layout.PRUNED, b"{}", metadata=metadata)


# -- sightings and offsets ------------------------------------------------------------------------


def test_a_sighting_is_seen_until_its_last_listing_or_else_its_first():
    assert Sighting(1, HELD, "w", 30.0, 5.0).seen_until() == 5.0
    assert Sighting(1, HELD, "w", 30.0, 5.0, last_seen=7.0).seen_until() == 7.0
    assert Sighting(1, HELD, "w", 30.0, 5.0).renewed is False


def test_a_region_boundary_is_a_listing_offset_and_the_head_or_the_end_is_none():
    assert offset(layout.TASKS, "b1") == layout.TASKS + layout.key("b1")
    assert offset(layout.TASKS, layout.HEAD) is None
    assert offset(layout.LEASES, None) is None


# -- the region map -------------------------------------------------------------------------------


def test_before_any_listing_the_view_knows_one_open_ended_region_and_no_finished_one(tmp_path):
    store, clock, view = queue(tmp_path, ["a"], scan=False)
    assert view.splits == [layout.HEAD]
    assert view.region_of("zz") == layout.HEAD and view.region_end(layout.HEAD) is None
    assert view.known_regions() == [] and not view.all_swept()
    assert not view.is_swept(layout.HEAD) and not view.under_running_batch(layout.HEAD)
    assert view.map_at is None and view.swept_at is None and view.batches is None
    assert view.max_loaded_regions == MAX_LOADED_REGIONS
    view.freshen_map()  # never listed: it lists now
    assert store.listed == [layout.SPLITS, layout.SWEPT, layout.BATCHES]


def test_regions_run_from_their_split_to_the_next_and_every_id_has_one(tmp_path):
    store, clock, view = queue(tmp_path, splits=["b", "d"])
    assert view.splits == [layout.HEAD, "b", "d"] and view.map_complete
    assert [view.region_end(r) for r in view.splits] == ["b", "d", None]
    # `b.5` sorts before `b` (layout.key: `b.5.json` < `b.json`), so it is the head region's
    assert [view.region_of(t) for t in ("0", "A", "a", "b.5", "b", "b0", "c", "d", "zz")] == ["", "", "", "", "b", "b", "b", "d", "d"]
    assert view.known_regions() == [layout.HEAD, "b", "d"]


def test_the_map_lists_one_page_at_first_then_one_more_per_extension_until_it_is_complete(tmp_path):
    store, clock, view = queue(tmp_path, splits=["b", "c", "d", "e", "f"], page=2)
    assert view.splits == [layout.HEAD, "b", "c"] and not view.map_complete
    assert view.known_regions() == [layout.HEAD, "b"]  # c's region has no known end yet
    assert not view.all_swept()
    assert view.extend_map()
    assert view.splits == [layout.HEAD, "b", "c", "d", "e"] and not view.map_complete
    assert store.listed.count(layout.SPLITS) == 2
    assert view.extend_map()
    assert view.splits == [layout.HEAD, "b", "c", "d", "e", "f"] and view.map_complete
    assert view.known_regions() == view.splits
    store.listed.clear()
    assert not view.extend_map()  # complete already: no request
    assert store.listed == []


def test_the_whole_map_is_listed_at_once_and_at_every_scan_after(tmp_path):
    store, clock, view = queue(tmp_path, splits=["b", "c", "d", "e", "f"], page=2)
    view.whole_map()
    assert view.map_complete and view.splits == [layout.HEAD, "b", "c", "d", "e", "f"]
    assert store.listed == [layout.SPLITS] * 3 + [layout.SWEPT]  # without the batches
    store.listed.clear()
    view.scan_map()
    assert store.listed == [layout.SPLITS] * 3 + [layout.SWEPT, layout.BATCHES]
    store.listed.clear()
    view.whole_map()  # complete: nothing to list
    assert store.listed == []


def test_a_scan_without_batches_leaves_them_unlisted(tmp_path):
    store, clock, view = queue(tmp_path, splits=["b"], scan=False)
    view.scan_map(with_batches=False)
    assert store.listed == [layout.SPLITS, layout.SWEPT] and view.batches is None
    assert view.map_at == clock.now


def test_swept_markers_are_listed_again_only_when_older_than_their_refresh(tmp_path):
    store, clock, view = queue(tmp_path, splits=["b"])
    clock.now += SWEPT_REFRESH_S
    view.freshen_map()
    view.freshen_swept()
    assert store.listed == []  # neither is older than its refresh
    clock.now += 0.5
    view.freshen_map()
    assert store.listed == [layout.SWEPT] and view.swept_at == clock.now
    store.listed.clear()
    clock.now += SWEPT_REFRESH_S + 0.5
    view.freshen_swept()
    assert store.listed == [layout.SWEPT] and view.swept_at == clock.now


def test_the_map_is_listed_again_only_when_older_than_its_refresh(tmp_path):
    store, clock, view = queue(tmp_path, splits=["b"])
    view.swept_at = 1e9  # swept markers never due: only the map's own age decides
    clock.now += MAP_REFRESH_S
    view.freshen_map()
    assert store.listed == []
    clock.now += 0.5
    view.freshen_map()
    assert store.listed == [layout.SPLITS, layout.SWEPT, layout.BATCHES]
    assert view.map_at == clock.now


def test_a_region_cut_by_a_submit_is_listed_again_and_keeps_its_sightings(tmp_path):
    store, clock, view = queue(tmp_path, ["a1", "a2", "a3", "a4", "m1"], splits=["m1"])
    lease(store, "a1")
    lease(store, "a2", state=DONE)
    view.load(layout.HEAD)
    view.load("m1")
    assert view.tasks[layout.HEAD] == ["a1", "a2", "a3", "a4"]
    store.create(layout.split_object("a3"), b"{}")  # a submit cut the head region at a3
    view.scan_map()
    assert layout.HEAD not in view.tasks and "m1" in view.tasks  # only the cut region's list is gone
    assert "a1" in view.leases and "a2" in view.finished
    assert view.region_end(layout.HEAD) == "a3"


def test_only_a_confirmed_swept_marker_of_a_known_region_counts(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b1", "c1", "d1"], splits=["b", "c", "d"], page=2, scan=False)
    swept(store, layout.HEAD)
    swept(store, "b", confirmed=False)
    swept(store, "c")
    swept(store, "d")
    view.scan_map()
    assert view.splits == [layout.HEAD, "b", "c"]
    assert set(view.swept) == {layout.HEAD}  # b's is unconfirmed; c's region has no known end yet
    assert view.swept[layout.HEAD]["tasks"] == "1"
    assert view.open_regions() == ["b"] and view.is_swept(layout.HEAD) and not view.is_swept("b")
    view.whole_map()
    assert set(view.swept) == {layout.HEAD, "c", "d"}
    assert view.open_regions() == ["b"] and not view.all_swept()
    store.delete(layout.swept_object("b"))
    swept(store, "b")
    view.scan_swept()
    assert view.open_regions() == [] and view.all_swept()


def test_a_running_batch_before_a_swept_region_leaves_it_swept(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b1"], splits=["b"], scan=False)
    swept(store, "b")
    batch(store, "x", "a", "a")  # in the head region, before b
    view.scan_map()
    assert view.is_swept("b") and view.open_regions() == [layout.HEAD]


def test_a_partial_map_lists_the_swept_markers_up_to_its_last_known_split(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b1", "c1", "d1"], splits=["b", "c", "d"], page=2, scan=False)
    for region in (layout.HEAD, "b", "c", "d"):
        swept(store, region)
    view.scan_map()
    assert view.splits == [layout.HEAD, "b", "c"] and set(view.swept) == {layout.HEAD, "b"}


def test_a_swept_region_under_a_running_batch_is_open(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b1"], splits=["b"], scan=False)
    swept(store, layout.HEAD)
    swept(store, "b")
    batch(store, "x", "b5", "b6")
    view.scan_map()
    assert view.running == [("b5", "b6")]
    assert view.under_running_batch("b") and not view.under_running_batch(layout.HEAD)
    assert view.open_regions() == ["b"] and not view.all_swept()


def test_a_swept_region_forgets_the_sightings_of_tasks_no_longer_cached_but_not_of_cached_or_open_ones(tmp_path):
    store, clock, view = queue(tmp_path, ["a1", "a2", "b1", "c1"], splits=["b", "c"])
    for task_id in ("a1", "b1", "c1"):
        lease(store, task_id)
    view.load(layout.HEAD)
    view.load("b")
    view.load("c")
    view.forget(layout.HEAD)
    view.forget("c")
    swept(store, layout.HEAD)
    swept(store, "b")
    view.scan_swept()
    assert set(view.leases) == {"b1", "c1"}  # a1: swept, not cached; b1: cached; c1: open


# -- batches ----------------------------------------------------------------------------------


def test_the_first_listing_of_batches_is_the_baseline_and_not_news(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b1"], splits=["b"], scan=False)
    batch(store, "x", "b1", "b1")
    view.scan_map()
    (entry,) = store.list(layout.BATCHES)
    assert view.batches == {layout.batch_object("x"): entry.generation}
    assert view.news == set() and view.running == [("b1", "b1")]
    assert not view.scan_batches()  # unchanged: no news


def test_a_new_batch_is_news_for_the_regions_it_meets_and_their_task_lists_are_forgotten(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b1", "c1", "d1"], splits=["b", "c", "d"])
    lease(store, "b1", state=DONE)
    for region in view.splits:
        view.load(region)
    batch(store, "x", "b5", "c1")  # meets b (from b) and c (up to c1)
    assert view.scan_batches()
    assert view.news == {"b", "c"}
    assert set(view.tasks) == {layout.HEAD, "d"}
    assert "b1" in view.finished  # a region listed again for news keeps what it knew of its tasks
    assert not view.scan_batches()  # the same batch, still running: news once
    assert view.news == {"b", "c"}


def test_a_batch_meets_a_region_from_its_start_up_to_before_its_end(tmp_path):
    store, clock, view = queue(tmp_path, splits=["b", "d"])
    assert view.overlaps("b", (layout.key("b"), layout.key("b")))  # its first id
    assert view.overlaps("b", (layout.key("a"), layout.key("b")))  # a batch that ends there
    assert not view.overlaps("b", (layout.key("a"), layout.key("a.9")))  # before it
    assert view.overlaps("b", (layout.key("c.9"), layout.key("c.9")))  # its last id
    assert not view.overlaps("b", (layout.key("d"), layout.key("e")))  # the next region's start
    assert view.overlaps(layout.HEAD, (layout.key("0"), layout.key("0")))
    assert view.overlaps("d", (layout.key("zz"), layout.key("zz")))  # the last region has no end


def test_a_batch_that_changes_is_news_and_one_gone_once_done_is_not(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b1", "c1"], splits=["b", "c"], scan=False)
    batch(store, "x", "b1", "b1")
    batch(store, "y", "c1", "c1", state=layout.BATCH_DONE)
    view.scan_map()
    assert view.running == [("b1", "b1")]
    batch(store, "x", "b1", "b1", state=layout.BATCH_DONE)  # its submit finished it
    assert view.scan_batches()
    assert view.news == {"b"} and view.running == []
    store.delete(layout.batch_object("y"))  # done already at the last listing: gone is not news
    assert not view.scan_batches()
    assert view.news == {"b"}


def test_a_running_batch_that_is_gone_is_news_for_its_regions(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b1", "c1"], splits=["b", "c"], scan=False)
    batch(store, "x", "c1", "c2")
    view.scan_map()
    view.load("c")
    store.delete(layout.batch_object("x"))  # finished and deleted between two listings
    assert view.scan_batches()
    assert view.news == {"c"} and "c" not in view.tasks


def test_a_marker_without_its_range_is_no_batch(tmp_path):
    store, clock, view = queue(tmp_path, ["a"], scan=False)
    store.create(layout.batch_object("half"), b"{}", metadata={"first": "a", "state": layout.BATCH_RUNNING})
    store.create(layout.batch_object("other"), b"{}", metadata={"last": "a", "state": layout.BATCH_RUNNING})
    batch(store, "x", "a", "a")  # listed after them
    view.scan_map()
    assert set(view.batches) == {layout.batch_object("x")} and view.running == [("a", "a")]


def test_news_of_a_batch_reaches_the_regions_a_later_cut_makes_of_its_region(tmp_path):
    store, clock, view = queue(tmp_path, ["a1", "a5", "a6", "a7", "b1"], splits=["b1"])
    batch(store, "x", "a5", "a7")
    assert view.scan_batches()
    assert view.news == {layout.HEAD}
    store.create(layout.split_object("a6"), b"{}")  # the same submit cut the head region at a6
    view.scan_map()
    assert view.news == {layout.HEAD, "a6"}


def test_a_prune_newer_than_the_last_listing_forgets_every_task_list_and_an_older_one_does_not(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b1"], splits=["b"], scan=False)
    first = store.list(layout.BATCHES)  # nothing yet
    assert list(first) == []
    batch(store, "old", "a", "a", state=layout.BATCH_DONE)
    batch(store, "new", "b1", "b1", state=layout.BATCH_DONE)
    times = {e.name: e.updated for e in store.list(layout.BATCHES)}
    older, newer = times[layout.batch_object("old")], times[layout.batch_object("new")]
    assert older < newer
    view.scan_map()
    lease(store, "a")
    lease(store, "b1", state=DONE)
    view.load(layout.HEAD)
    view.load("b")
    prune(store, older + (newer - older) / 2)  # pruned markers were all older than the newest listed
    assert not view.scan_batches()
    assert set(view.tasks) == {layout.HEAD, "b"}
    assert set(view.batches) == {layout.batch_object("old"), layout.batch_object("new")}  # listed after the mark
    assert view.pruned is not None and view.pruned[1] == (older + (newer - older) / 2).isoformat()
    prune(store, dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1))  # a batch may have come and gone
    assert view.scan_batches()
    assert view.tasks == {} and view.news == set()
    assert "a" in view.leases and "b1" in view.finished  # sightings kept: the TTL-long watch goes on


def test_the_first_prune_seen_is_no_news(tmp_path):
    store, clock, view = queue(tmp_path, ["a"], scan=False)
    prune(store, dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1))
    view.scan_map()
    view.load(layout.HEAD)
    assert not view.scan_batches()
    assert layout.HEAD in view.tasks


# -- one region's listings -------------------------------------------------------------------------


def test_a_region_lists_its_own_tasks_with_the_manifests_they_carry_and_the_sizes_of_those_that_do_not(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b1", "b2", "c1"], splits=["b", "c"])
    store.create(layout.task_object("b3"), b'{"id": "b3", "big": "xxxxxx"}')  # no manifest in its metadata
    store.create("tasks/-not-a-task.json", b"{}")
    assert view.list_region_tasks("b") == ["b1", "b2", "b3"]
    assert view.manifests["b1"] == json.dumps({"id": "b1"}) and "b1" not in view.sizes
    assert view.manifests["b3"] is None and view.sizes["b3"] == len(b'{"id": "b3", "big": "xxxxxx"}')
    assert "a" not in view.manifests and "c1" not in view.manifests
    assert view.list_region_tasks(layout.HEAD) == ["a"]
    assert view.list_region_tasks("c") == ["c1"]


def test_loading_a_region_takes_two_requests_and_sorts_its_leases_into_finished_and_sightings(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b1", "b2", "b3", "b4", "c1"], splits=["b", "c"])
    lease(store, "a")  # another region's
    lease(store, "b1", worker="w7", ttl_s="20.5")
    lease(store, "b2", state=DONE)
    lease(store, "b3", state=DEAD)
    store.create(layout.lease_object("b4"), b"{}", metadata={})  # no state, worker or TTL said
    store.create("leases/-x.json", b"{}", metadata={"state": DONE})
    store.create("leases/b1.json.tmp", b"{}", metadata={"state": DONE})  # in b's range, not a lease: skipped
    lease(store, "c1")
    store.listed.clear()
    view.load("b")
    assert store.listed == [layout.TASKS, layout.LEASES]
    assert view.tasks["b"] == ["b1", "b2", "b3", "b4"]
    assert view.finished == {"b2", "b3"}
    assert set(view.leases) == {"b1", "b4"}
    b1, b4 = view.leases["b1"], view.leases["b4"]
    assert (b1.state, b1.worker, b1.ttl_s, b1.first_seen, b1.last_seen, b1.renewed) == (HELD, "w7", 20.5, 100.0, 100.0, False)
    assert (b4.state, b4.worker, b4.ttl_s) == (HELD, "?", float("inf"))
    assert view.loaded == {"b": 100.0}


def test_a_lease_is_renewed_only_when_seen_changed_within_a_ttl_of_its_last_sighting(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b", "c", "d"])
    for task_id in "abcd":
        lease(store, task_id, ttl_s="30.0")
    view.load(layout.HEAD)
    clock.now += 20
    lease(store, "a")  # its holder's heartbeat
    view.refresh(layout.HEAD)
    assert view.leases["a"].renewed and view.leases["a"].first_seen == 120.0
    assert not view.leases["b"].renewed and view.leases["b"].first_seen == 100.0
    assert view.leases["b"].last_seen == 120.0 and view.leases["b"].seen_until() == 120.0
    clock.now += 29.5  # b last seen 29.5 s ago: within a TTL
    lease(store, "b")
    view.refresh(layout.HEAD)
    assert view.leases["b"].renewed
    assert view.leases["a"].renewed  # the same generation keeps what it was judged
    clock.now += 30  # c and d last seen a whole TTL ago
    lease(store, "c")
    view.leases["d"] = Sighting(0, HELD, "w0", 30.0, clock.now - 1)  # generation 0: not a lease seen yet
    lease(store, "d")
    view.refresh(layout.HEAD)
    assert not view.leases["c"].renewed, "a change seen across a gap of a TTL says nothing of now"
    assert not view.leases["d"].renewed


def test_a_sighting_at_the_first_generation_a_store_gives_is_a_sighting_like_any(tmp_path):
    store, clock, view = queue(tmp_path, ["a"])
    view.leases["a"] = Sighting(1, HELD, "w0", 30.0, clock.now)  # a store that counts generations from 1
    clock.now += 10
    lease(store, "a")
    view.load(layout.HEAD)
    assert view.leases["a"].renewed


def test_refreshing_a_region_never_loaded_sights_its_leases_and_caches_no_tasks(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b1"], splits=["b"])
    lease(store, "b1")
    view.refresh("b")
    assert view.tasks["b"] == [] and set(view.leases) == {"b1"}


def test_a_lease_gone_from_its_region_listing_is_forgotten_and_other_regions_keep_theirs(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b1"], splits=["b"])
    lease(store, "a")
    lease(store, "b1")
    view.load(layout.HEAD)
    view.load("b")
    store.delete(layout.lease_object("a"))
    view.refresh(layout.HEAD)
    assert set(view.leases) == {"b1"}
    assert view.tasks[layout.HEAD] == ["a"]  # refresh without ids keeps the cached list


def test_the_cache_forgets_the_least_recently_loaded_region_first(tmp_path):
    ids = [f"r{i}" for i in range(MAX_LOADED_REGIONS + 1)]
    store, clock, view = queue(tmp_path, ["0"] + ids, splits=ids)
    lease(store, "r0", state=DONE)
    lease(store, "r1")
    for region in ids[: MAX_LOADED_REGIONS]:
        clock.now += 1
        view.load(region)
    clock.now += 1
    view.load("r0")  # loaded again: now the most recent
    clock.now += 1
    view.load(ids[MAX_LOADED_REGIONS])
    assert len(view.tasks) == MAX_LOADED_REGIONS and "r1" not in view.tasks and "r0" in view.tasks
    assert list(view.loaded)[-2:] == ["r0", ids[MAX_LOADED_REGIONS]]
    assert "r1" in view.leases  # its sighting stays
    assert "r0" in view.finished
    view.forget("r0")
    assert "r0" not in view.finished and "r0" not in view.loaded and "r0" not in view.manifests


def test_a_smaller_cache_holds_fewer_regions(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b1", "c1"], splits=["b", "c"])
    small = QueueView(store, clock, max_loaded_regions=2)
    small.scan_map()
    for region in small.splits:
        small.load(region)
    assert list(small.tasks) == ["b", "c"]


def test_forgetting_a_region_drops_its_manifests_and_sizes(tmp_path):
    store, clock, view = queue(tmp_path, ["a"])
    store.create(layout.task_object("b"), b'{"id": "b"}')
    view.load(layout.HEAD)
    assert view.sizes == {"b": len(b'{"id": "b"}')} and set(view.manifests) == {"a", "b"}
    view.forget(layout.HEAD, keep_sightings=True)
    assert view.sizes == {} and view.manifests == {} and view.loaded == {}


def test_sightings_past_the_bound_go_oldest_first_and_never_those_of_cached_regions(tmp_path, monkeypatch):
    store, clock, view = queue(tmp_path, ["a", "b1"], splits=["b"])
    lease(store, "a")
    clock.now = 0.0
    view.load(layout.HEAD)  # a: cached, first seen at 0, the oldest
    n = view_module.MAX_SIGHTINGS
    for i in range(n):  # b0 is the newest, b<n-1> the oldest: neither order of names nor of insertion is age
        view.leases[f"b{i}"] = Sighting(1, HELD, "w", 30.0, float(n - i))
    view.forget("b")
    assert len(view.leases) == view_module.MAX_SIGHTINGS  # one over: the oldest uncached goes
    assert "a" in view.leases and f"b{n - 1}" not in view.leases and "b0" in view.leases and f"b{n - 2}" in view.leases
    view.forget("b")
    assert len(view.leases) == view_module.MAX_SIGHTINGS  # at the bound: none goes


def test_the_bound_on_sightings_is_a_hundred_thousand():
    assert view_module.MAX_SIGHTINGS == 100_000 and MAX_LOADED_REGIONS == 8
    assert (MAP_REFRESH_S, SWEPT_REFRESH_S) == (300.0, 30.0)


# -- one task -------------------------------------------------------------------------------------


def test_a_lease_is_live_until_seen_unchanged_for_a_whole_ttl(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b", "c", "d"])
    lease(store, "a", ttl_s="30.0")
    lease(store, "b", state=RELEASED)
    lease(store, "c", state=DONE)
    view.load(layout.HEAD)
    assert view.live("a") and not view.claimable("a")
    assert not view.live("b") and view.claimable("b")  # released
    assert not view.live("c") and not view.claimable("c")  # finished
    assert not view.live("d") and view.claimable("d")  # never leased
    clock.now += 29.9
    assert view.live("a")
    clock.now += 0.1
    assert not view.live("a") and view.claimable("a")


def test_a_region_is_finished_when_every_task_it_lists_is(tmp_path):
    store, clock, view = queue(tmp_path, ["a", "b"])
    assert view.region_finished(layout.HEAD)  # nothing loaded: nothing unfinished known
    lease(store, "a", state=DONE)
    view.load(layout.HEAD)
    assert not view.region_finished(layout.HEAD)
    lease(store, "b", state=DEAD)
    view.refresh(layout.HEAD)
    assert view.region_finished(layout.HEAD)


def test_unjudged_leases_are_the_live_unrenewed_finite_ones_of_open_regions_in_order(tmp_path):
    store, clock, view = queue(tmp_path, ["a1", "a2", "a3", "a4", "a5", "b1"], splits=["b"])
    lease(store, "a3")
    lease(store, "a1")
    lease(store, "a2", ttl_s="inf")  # a lease without a TTL is not for this rule
    lease(store, "a4")
    lease(store, "b1")
    view.load(layout.HEAD)
    view.load("b")
    assert view.unjudged() == ["a1", "a3", "a4", "b1"]
    clock.now += 10
    lease(store, "a4")  # renewed
    view.refresh(layout.HEAD)
    assert view.unjudged() == ["a1", "a3", "b1"]
    view.finished.add("a3")  # its done marker found by a claim
    assert view.unjudged() == ["a1", "b1"]
    view.swept["b"] = {"confirmed": "1"}
    assert view.unjudged() == ["a1"]
    clock.now += 20  # a1 watched unchanged for a whole TTL
    assert view.unjudged() == []


@pytest.mark.parametrize(("text", "seconds"), [(None, float("inf")), ("30", 30.0), ("2.5", 2.5), ("soon", float("inf"))])
def test_a_ttl_reads_as_seconds_and_anything_unreadable_as_forever(text, seconds):
    assert view_module._float(text) == seconds

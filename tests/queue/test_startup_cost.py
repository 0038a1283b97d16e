"""Start-up, drain and status cost, counted in requests against the test GCS server through the real client.

Big queues are seeded straight into the server's storage (the same objects `submit` would write:
manifests, and a split marker at every thousandth id); every request under test goes over HTTP.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from objectstore.counting import CountingStore
from objectstore.gcs import GCSStore
from taskqueue import layout
from taskqueue.claims import JUMP_TRIES, Claimer, ClaimOptions
from taskqueue.clock import Clock
from taskqueue.lease import RELEASED, encode, new_lease_body
from reporting.status import RegionCache, snapshot
from taskqueue.submit import submit
from tests.fakegcs.server import Preconditions
from tests.workers import renewing

PREFIX = "q"


def seed(gcs, bucket: str, n: int, done: range = range(0)) -> list[str]:
    """n tasks as `submit` lays them out; the ids at positions `done` finished as a worker leaves
    them: a done marker, and the lease as its `done` tombstone."""
    ids = [f"t{k:07d}" for k in range(n)]
    for task_id in ids:
        manifest = json.dumps({"id": task_id})
        gcs.storage.commit(bucket, f"{PREFIX}/{layout.task_object(task_id)}", manifest.encode(),
                           {"metadata": {"manifest": manifest}}, Preconditions(), "application/json")
    for task_id in ids[layout.REGION_TASKS :: layout.REGION_TASKS]:
        gcs.storage.commit(bucket, f"{PREFIX}/{layout.split_object(task_id)}", b"{}", {}, Preconditions(), None)
    for k in done:
        gcs.storage.commit(bucket, f"{PREFIX}/{layout.done_object(ids[k])}", b"{}", {}, Preconditions(), None)
        gcs.storage.commit(bucket, f"{PREFIX}/{layout.lease_object(ids[k])}", b"{}", {"metadata": {"state": "done"}},
                           Preconditions(), None)
    return ids


def first_claim_cost(store: GCSStore, worker: str, seed: int = 7) -> tuple[int, str]:
    counted = CountingStore(store)
    claimer = Claimer(counted, ClaimOptions(worker=worker, idle_timeout_s=5, poll_min_s=0.01, poll_max_s=0.05, seed=seed))
    claim = next(iter(claimer))
    # The claim's own lease create comes after the start; everything before it is start-up.
    requests = counted.requests - 1
    claim.lease.complete([], time.monotonic())
    return requests, claim.task_id


@pytest.mark.parametrize("size", [100, 100_000])
def test_first_claim_takes_the_same_few_requests_at_any_queue_size(gcs, gcs_client, gcs_bucket, size):
    seed(gcs, gcs_bucket, size)
    store = GCSStore(gcs_bucket, PREFIX, client=gcs_client)
    requests, task_id = first_claim_cost(store, "w0")
    # splits/, swept/ and batches/ (one page each up to a million tasks), then one region: tasks and leases.
    assert requests == 5
    assert store.read(layout.done_object(task_id)).generation > 0


def test_workers_starting_together_spread_over_regions(gcs, gcs_client, gcs_bucket):
    seed(gcs, gcs_bucket, 20_000)
    store = GCSStore(gcs_bucket, PREFIX, client=gcs_client)
    claimed = [first_claim_cost(store, f"w{k}", seed=k)[1] for k in range(4)]
    assert len({t[:5] for t in claimed}) > 1  # not all in the same region of a thousand
    assert len(set(claimed)) == 4


def test_a_worker_leaves_drained_only_once_every_region_is_swept(gcs, gcs_client, gcs_bucket):
    ids = seed(gcs, gcs_bucket, 2500, done=range(2499))
    store = GCSStore(gcs_bucket, PREFIX, client=gcs_client)
    options = ClaimOptions(worker="w", idle_timeout_s=0.3, poll_min_s=0.01, poll_max_s=0.05, lease_ttl_s=60)
    # The last task is held by a live worker: the others are finished, yet the queue is not drained.
    holder = next(iter(Claimer(store, ClaimOptions(worker="holder", lease_ttl_s=60, seed=1))))
    assert holder.task_id == ids[-1]
    waiting = Claimer(store, options)
    with renewing(holder.lease):  # live: a worker leaves idle beside a lease only once it saw it renew
        assert list(waiting) == [] and waiting.exit_reason == "idle"
    swept = {e.name for e in store.list(layout.SWEPT)}
    assert swept == {layout.swept_object(layout.HEAD), layout.swept_object(ids[1000])}  # the finished regions
    holder.lease.complete([], time.monotonic())
    last = Claimer(store, options)
    assert list(last) == [] and last.exit_reason == "drained"
    assert len(list(store.list(layout.SWEPT))) == 3


def test_a_submission_into_a_swept_region_unsweeps_it(gcs_client, gcs_bucket):
    store = GCSStore(gcs_bucket, PREFIX, client=gcs_client)
    submit(store, b"{}", [(f"a{k}", json.dumps({"id": f"a{k}"}).encode()) for k in range(3)])
    options = ClaimOptions(worker="w", idle_timeout_s=5, poll_min_s=0.01, poll_max_s=0.05)
    first = Claimer(store, options)
    for claim in first:
        claim.lease.complete([], time.monotonic())
    assert first.exit_reason == "drained" and list(store.list(layout.SWEPT))
    submit(store, b"{}", [("a1b", json.dumps({"id": "a1b"}).encode())])
    assert list(store.list(layout.SWEPT)) == []
    second = Claimer(store, options)
    claimed = []
    for claim in second:
        claimed.append(claim.task_id)
        claim.lease.complete([], time.monotonic())
    assert claimed == ["a1b"] and second.exit_reason == "drained"


def test_status_counts_swept_regions_from_their_markers_and_labels_an_estimate(gcs, gcs_client, gcs_bucket):
    ids = seed(gcs, gcs_bucket, 5000, done=range(3000))
    store = GCSStore(gcs_bucket, PREFIX, client=gcs_client)
    exact = snapshot(store)
    assert (exact["total"], exact["done"], exact["pending"], exact["estimate"]) == (5000, 3000, 2000, False)
    assert exact["requests"] == 2 + 3 * 5 + 4  # map, three listings per open region, failed/ and slices/ once, batches/ before and after
    # A worker sweeps the finished regions it visits; status then counts them from their markers.
    for region in (layout.HEAD, ids[1000], ids[2000]):
        claimer = Claimer(store, ClaimOptions(worker="w"))
        claimer.view.scan_map()
        claimer._visit(region)
    swept = snapshot(store)
    assert (swept["total"], swept["done"], swept["regions"]["swept"]) == (5000, 3000, 3)
    assert swept["requests"] == 2 + 3 * 2 + 4
    estimate = snapshot(store, sample=1, seed=3)
    assert estimate["estimate"] is True and estimate["requests"] == 2 + 3 + 4
    assert estimate["total"] == 5000 and estimate["done"] == 3000  # both open regions are alike here
    cache = RegionCache()
    snapshot(store, cache=cache)
    watched = snapshot(store, cache=cache)
    assert watched["requests"] == 2 + 2 * 2 + 4 and watched["total"] == 5000  # task lists kept between ticks


def test_status_names_dead_letters_of_swept_regions(tmp_path):
    from objectstore.local import LocalStore

    store = LocalStore(tmp_path / "q")
    submit(store, b"{}", [("bad", b'{"id": "bad"}'), ("good", b'{"id": "good"}')])
    # As workers leave them: the marker, then the lease as its tombstone.
    store.create(layout.done_object("good"), b"{}")
    store.create(layout.lease_object("good"), b"{}", metadata={"state": "done"})
    store.create(layout.failed_object("bad"), json.dumps({"reason": "bad input: field 'text'"}).encode())
    store.create(layout.lease_object("bad"), b"{}", metadata={"state": "dead"})
    claimer = Claimer(store, ClaimOptions(worker="w", idle_timeout_s=1, poll_min_s=0.01, poll_max_s=0.05))
    assert list(claimer) == [] and claimer.exit_reason == "drained"  # it swept the only region
    view = snapshot(store)
    assert (view["total"], view["done"], view["failed"], view["complete"]) == (2, 1, 1, True)
    assert view["failed_reasons"] == {"bad": "bad input: field 'text'"}


class ReleasedThenTakenOver(CountingStore):
    """After the waiting worker's start, the first region it lists again has one lease released just
    before the listing and taken over by a rival just after it: the worker sees a task free that
    is not free any more by the time it claims it."""

    def __init__(self, inner: GCSStore, start_listings: int):
        super().__init__(inner)
        self.start_listings = start_listings
        self.raced: str | None = None

    def list_page(self, prefix, page_token=None, start_offset=None, page_size=1000, end_offset=None):
        race = prefix == layout.LEASES and self.raced is None and self.counts[f"list {layout.LEASES}"] == self.start_listings
        if race:
            entry = next(iter(self.inner.list(layout.LEASES, start_offset=start_offset, end_offset=end_offset)))
            raced = layout.id_from_object(entry.name, layout.LEASES)
            released = dict(json.loads(self.inner.read(entry.name).data), state=RELEASED)
            data, metadata = encode(released)
            generation = self.inner.write(entry.name, data, if_generation=entry.generation, metadata=metadata)
        page = super().list_page(prefix, page_token, start_offset, page_size, end_offset)
        if race:
            rival = new_lease_body(raced, "rival", 600, Clock(), released)
            data, metadata = encode(rival)
            self.inner.write(entry.name, data, if_generation=generation, metadata=metadata)
            # Only now: the test's holders start renewing once `raced` is set, and a renewal between the
            # two writes above would make the second a 412 (the flaky failure of issue 48).
            self.raced = raced
        return page


def test_a_waiting_worker_that_loses_a_claim_waits_on_instead_of_moving(gcs, gcs_client, gcs_bucket):
    """At the end of a queue most workers wait, and every request they make is overhead: a claim a
    waiting worker loses (the task was taken in between) costs the claim and one re-list of that
    region, not a move through other regions (docs/PROTOCOL.md, "Claim", step 8)."""
    ids = seed(gcs, gcs_bucket, 3 * layout.REGION_TASKS)
    for task_id in ids:  # every task held by a live worker
        data, metadata = encode(new_lease_body(task_id, "other", 600, Clock()))
        gcs.storage.commit(gcs_bucket, f"{PREFIX}/{layout.lease_object(task_id)}", data, {"metadata": metadata},
                           Preconditions(), "application/json")
    store = ReleasedThenTakenOver(GCSStore(gcs_bucket, PREFIX, client=gcs_client), start_listings=JUMP_TRIES)
    at_poll: list[int] = []
    race_poll: list[int] = []

    looks: set[int] = set()  # the poll intervals in which a last look before leaving idle ran

    class Counted(Claimer):
        def _poll(self):
            at_poll.append(store.requests)
            try:
                return super()._poll()
            finally:
                if store.raced is not None and not race_poll:
                    race_poll.append(len(at_poll) - 1)

        def _last_look(self):
            looks.add(len(at_poll) - 1)
            return super()._last_look()

    options = ClaimOptions(worker="w", idle_timeout_s=2, lease_ttl_s=1, poll_min_s=0.01, poll_max_s=0.2, seed=3)
    claimer = Counted(store, options)
    stop = threading.Event()

    def live_holders() -> None:
        """The holders renew (straight into the server: uncounted), the rival too, once the race is
        over: the waiting worker leaves idle only once it has seen each lease renew, the one it lost
        included (a lease first seen held after a release is watched like any other: docs/PROTOCOL.md, "Claim")."""
        while not stop.wait(0.3):
            if store.raced is None:
                continue
            for task_id in ids:  # the rival renews the raced task's lease as its holder
                holder = "rival" if task_id == store.raced else "other"
                data, metadata = encode(new_lease_body(task_id, holder, 600, Clock()))
                gcs.storage.commit(gcs_bucket, f"{PREFIX}/{layout.lease_object(task_id)}", data,
                                   {"metadata": metadata}, Preconditions(), "application/json")  # fmt: skip

    holders = threading.Thread(target=live_holders)
    holders.start()
    try:
        assert list(claimer) == [] and claimer.exit_reason == "idle"
    finally:
        stop.set()
        holders.join()
    assert store.raced is not None and store.counts["read leases/"] == 1  # it saw the release and lost the takeover
    assert at_poll[0] == 3 + 2 * JUMP_TRIES  # start: map and batches, then the regions one move tries, all held
    # From the poll that saw the release to the next poll (or the exit): that poll's batches/ listing
    # and one or two region listings, the lost takeover's read, one re-list of the region. Moving on
    # would load regions too, two listings each (7 requests here before waiting stuck).
    at_poll.append(store.requests)
    assert at_poll[race_poll[0] + 1] - at_poll[race_poll[0]] <= 5
    # Every other poll is batches/ and one listing, or two when it looks at a region it does not watch,
    # and swept/ when its copy is over 30 s old (a slow machine); a last look before leaving idle adds
    # batches/ and each of the 3 regions afresh.
    for k, (a, b) in enumerate(zip(at_poll[:-1], at_poll[1:])):
        assert b - a <= 5 + (1 + 2 * 3 if k in looks else 0), (k, b - a, sorted(looks))
    assert store.counts["list splits/"] == 1

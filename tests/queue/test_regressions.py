"""Issue 16's seven bugs, one named test each (A to G), against real stores, real workers and the
fake GCS server with injected faults. Each failed on the code before its fix."""

from __future__ import annotations

import functools
import json
import sys
import threading
import time

import pytest

from objectstore import StoreUnavailable, open_store
from objectstore.counting import CountingStore
from objectstore.gcs import GCSStore, RetryPolicy
from objectstore.local import LocalStore
from taskqueue import layout
from taskqueue.claims import Claimer, ClaimOptions
from taskqueue.lease import LeaseLost
from taskqueue.spawner import Spawner, SpawnOptions
from reporting.status import snapshot
from taskqueue.submit import mark_regions, submit
from tests.fakegcs.server import Preconditions
from tests.queue.conftest import assert_outputs_exact
from tests.workers import REPO, WaitingClock, markers, renewing, wait_for

CONSUMER = [sys.executable, str(REPO / "tests" / "queue" / "consumer.py")]
#: Outlasted within a second, so that a test can make a request fail for good.
SHORT_RETRIES = RetryPolicy(initial_s=0.02, cap_s=0.1, deadline_s=0.3, timeout_s=5)


def tasks(*manifests: dict) -> list[tuple[str, bytes]]:
    return [(m["id"], json.dumps(m).encode()) for m in manifests]


def gcs_store(gcs_client, bucket: str, prefix: str = "q") -> GCSStore:
    return GCSStore(bucket, prefix, client=gcs_client, policy=SHORT_RETRIES)


def spawner(store, monkeypatch, worker: str = "w", on_state=None, **options) -> Spawner:
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the consumer imports this checkout's objectstore
    defaults = dict(lease_ttl_s=1.5, heartbeat_s=0.5, idle_timeout_s=4.0, poll_min_s=0.05, poll_max_s=0.2)
    return Spawner(store, SpawnOptions(consumer=CONSUMER, worker=worker, **{**defaults, **options}), on_state=on_state)


def assert_status_complete_only_with_markers(store) -> dict:
    """status's `complete` is derived from markers: never true while a task lacks its marker."""
    view = snapshot(store)
    ids = {layout.id_from_object(e.name, layout.TASKS) for e in store.list(layout.TASKS)}
    marked = {layout.id_from_object(e.name, p) for p in (layout.DONE, layout.FAILED) for e in store.list(p)}
    if view["complete"]:
        assert ids <= marked, f"status says complete, but {sorted(ids - marked)} have no marker"
    return view


# -- A ----------------------------------------------------------------------------------------


def test_A_a_done_marker_that_fails_past_the_retries_never_counts_as_finished(gcs, gcs_client, gcs_bucket, monkeypatch):
    """The done marker's create fails with 503s past the store's retry deadline. The worker must not
    take the task for finished (nor sweep its region, nor leave `drained`) until a marker exists,
    and status must not say complete without one."""
    store = gcs_store(gcs_client, gcs_bucket)
    submit(store, b"{}", tasks({"id": "a", "outputs": 2}, {"id": "b"}))
    gcs.faults.fail_next(25, 503, name_contains="q/done/a.json")
    reason = spawner(store, monkeypatch).run()
    assert gcs.counts()["faults_injected"] >= 2  # the first create of done/a.json failed for good
    done = markers(store.root_url, layout.DONE)
    if reason == "drained":
        assert sorted(done) == ["a", "b"], f"drained with markers for {sorted(done)} only"
    view = assert_status_complete_only_with_markers(store)
    # Whatever the worker did meanwhile, once the faults are spent the queue finishes exactly once.
    if reason != "drained":
        assert spawner(store, monkeypatch, worker="w2").run() == "drained"
        done = markers(store.root_url, layout.DONE)
        view = assert_status_complete_only_with_markers(store)
    assert sorted(done) == ["a", "b"] and markers(store.root_url, layout.FAILED) == {}
    assert_outputs_exact(store.root_url, {"a": done["a"]}, 2)
    assert view["complete"] and view["done"] == 2


def test_A_a_tombstone_that_fails_past_the_retries_leaves_the_task_held_not_finished(
    gcs, gcs_client, gcs_bucket, monkeypatch
):
    """The tombstone's write fails past the retry deadline: the worker did not see its outcome
    confirmed, so its view keeps the lease held (ours, expiring a TTL after our last confirmed
    write) instead of finished; the task is taken over and finished once, not swept unfinished."""
    store = gcs_store(gcs_client, gcs_bucket)
    submit(store, b"{}", tasks({"id": "a"}, {"id": "b"}))
    injected = []

    def on_state(state: str, **fields) -> None:
        if state == "working" and fields.get("task") == "a" and not injected:
            injected.append(True)  # after the claim: every write of a's lease fails for about two seconds
            gcs.faults.fail_next(20, 503, method="POST", name_contains="q/leases/a.json")

    reason = spawner(store, monkeypatch, on_state=on_state, idle_timeout_s=8.0).run()
    assert injected
    done = markers(store.root_url, layout.DONE)
    assert reason == "drained" and sorted(done) == ["a", "b"]
    assert_status_complete_only_with_markers(store)
    leases = {layout.id_from_object(e.name, layout.LEASES): e.metadata["state"] for e in store.list(layout.LEASES)}
    assert leases == {"a": "done", "b": "done"}


# -- B ----------------------------------------------------------------------------------------


def test_B_tasks_submitted_while_a_worker_waits_are_claimed_within_a_poll_cap(tmp_path, monkeypatch):
    """One task is held by a live worker; another worker waits. Tasks submitted into its region,
    then into new regions, must be claimed within about one poll cap of their submit, not when
    the held task ends (or never, leaving `idle`)."""
    store = LocalStore(tmp_path / "q")
    small = functools.partial(submit, region_tasks=3)  # regions of three tasks, so a small batch cuts new ones
    small(store, b"{}", tasks({"id": "m"}))
    holder = next(iter(Claimer(store, ClaimOptions(worker="holder", lease_ttl_s=600, seed=1))))
    poll_max = 0.2
    clock = WaitingClock()
    waiting = Claimer(store, ClaimOptions(worker="w", lease_ttl_s=600, idle_timeout_s=6, poll_min_s=0.02,
                                          poll_max_s=poll_max, seed=2), clock)  # fmt: skip
    claimed: dict[str, float] = {}

    def run() -> None:
        for claim in waiting:
            claimed[claim.task_id] = time.monotonic()
            claim.lease.complete([], time.monotonic())

    thread = clock.thread = threading.Thread(target=run)
    with renewing(holder.lease):  # live: the waiting worker leaves idle once it has seen it renew
        thread.start()
        assert clock.waiting.wait(30), "the worker never waited"  # it has found nothing and waits, polling
        small(store, b"{}", tasks({"id": "k"}, {"id": "l"}))  # into the region it watches
        into_region = time.monotonic()
        wait_for(lambda: {"k", "l"} <= set(claimed), 30, "k and l to be claimed")
        clock.waiting.clear()
        assert clock.waiting.wait(30), "the worker never waited again"  # it has run both, and waits again
        small(store, b"{}", tasks(*({"id": f"z{k}"} for k in range(7))))  # past the end: new regions
        new_regions = time.monotonic()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(list(store.list(layout.SPLITS))) >= 2
    assert set(claimed) == {"k", "l", *(f"z{k}" for k in range(7))}, sorted(claimed)
    # A poll cap, plus the claim's own few requests (generous on a loaded 2-core machine).
    assert min(claimed[t] for t in "kl") - into_region < poll_max + 1.0
    assert min(claimed[f"z{k}"] for k in range(7)) - new_regions < poll_max + 1.0
    assert waiting.exit_reason == "idle"  # the held task is still held
    holder.lease.release()


# -- C ----------------------------------------------------------------------------------------


class DiesAfterTheTasks(CountingStore):
    """A submitter that dies once its tasks exist: its next listing (of splits/) fails for good."""

    def list_page(self, prefix, page_token=None, start_offset=None, page_size=1000, end_offset=None):
        if prefix == layout.SPLITS:
            raise StoreUnavailable("list splits/: the submitter's machine was preempted")
        return super().list_page(prefix, page_token, start_offset, page_size, end_offset)


def test_C_no_worker_leaves_drained_during_a_submit_nor_after_one_died_halfway(tmp_path):
    store = LocalStore(tmp_path / "q")
    options = ClaimOptions(worker="w", idle_timeout_s=1.0, poll_min_s=0.02, poll_max_s=0.1, seed=1)
    submit(store, b"{}", tasks({"id": "a0"}, {"id": "a2"}))
    first = Claimer(store, options)
    for claim in first:
        claim.lease.complete([], time.monotonic())
    assert first.exit_reason == "drained" and list(store.list(layout.SWEPT))  # the queue is swept
    # A second batch whose submitter dies after creating its tasks, before it could un-sweep them.
    with pytest.raises(StoreUnavailable):
        submit(DiesAfterTheTasks(store), None, tasks({"id": "a1"}, {"id": "a3"}))
    assert {e.name for e in store.list(layout.TASKS)} >= {layout.task_object("a1"), layout.task_object("a3")}
    second = Claimer(store, options)
    ran = []
    for claim in second:
        ran.append(claim.task_id)
        claim.lease.complete([], time.monotonic())
    # It ran what the dead submit created, and did not call the queue drained: the batch never finished.
    assert sorted(ran) == ["a1", "a3"] and second.exit_reason == "idle"
    assert snapshot(store)["complete"] is False
    # The same submit again finishes the batch; now the queue is drained.
    submit(store, None, tasks({"id": "a1"}, {"id": "a3"}))
    third = Claimer(store, options)
    assert list(third) == [] and third.exit_reason == "drained"
    assert snapshot(store)["complete"] is True


def test_C_a_worker_starting_between_task_creation_and_unsweep_does_not_leave_drained(tmp_path):
    """The window of the bug as it was: the batch's tasks exist, the swept marker over them is not yet
    removed. A worker starting right then must find them, not leave `drained`."""
    store = LocalStore(tmp_path / "q")
    options = ClaimOptions(worker="w", idle_timeout_s=1.0, poll_min_s=0.02, poll_max_s=0.1, seed=1)
    submit(store, b"{}", tasks({"id": "a0"}))
    for claim in Claimer(store, options):
        claim.lease.complete([], time.monotonic())
    outcome: dict[str, object] = {}

    class StartsAWorkerBeforeTheUnsweep(CountingStore):
        def list_page(self, prefix, page_token=None, start_offset=None, page_size=1000, end_offset=None):
            if prefix == layout.SWEPT and "reason" not in outcome:
                late = Claimer(store, options)
                outcome["ran"] = [c.task_id for c in late if c.lease.complete([], time.monotonic())]
                outcome["reason"] = late.exit_reason
            return super().list_page(prefix, page_token, start_offset, page_size, end_offset)

    submit(StartsAWorkerBeforeTheUnsweep(store), None, tasks({"id": "a1"}))
    assert outcome["reason"] != "drained" and outcome["ran"] == ["a1"]


# -- D ----------------------------------------------------------------------------------------


def test_D_progress_read_by_a_failed_heartbeat_is_committed_by_a_later_one(gcs, gcs_client, gcs_bucket, monkeypatch):
    """Heartbeats fail past the retry deadline for a second and a half while the consumer writes its
    outputs (well inside the TTL, so the lease is still ours, and over before the consumer exits):
    the records those heartbeats read must still reach the done marker."""
    store = gcs_store(gcs_client, gcs_bucket)
    submit(store, b"{}", tasks({"id": "p", "outputs": 4, "sleep": 1.0}))
    window = threading.Event()

    def faults_while_outputs_are_written() -> None:
        deadline = time.monotonic() + 30
        while not list(store.list("out/p/")) and time.monotonic() < deadline:
            time.sleep(0.02)
        gcs.faults.fail_fraction(1.0, 503, method="POST", name_contains="q/leases/p.json")
        window.set()
        time.sleep(1.6)  # every heartbeat now fails past the retries, and the next output comes meanwhile
        gcs.faults.reset()

    watcher = threading.Thread(target=faults_while_outputs_are_written)
    watcher.start()
    reason = spawner(store, monkeypatch, lease_ttl_s=6.0, heartbeat_s=0.4).run()
    watcher.join()
    assert window.is_set() and gcs.counts()["faults_injected"] >= 1
    assert reason == "drained"
    done = markers(store.root_url, layout.DONE)
    assert done["p"]["attempt"] == 1 and done["p"]["worker"] == "w"  # one run, not a rerun that hid the loss
    assert_outputs_exact(store.root_url, done, 4)


# -- E ----------------------------------------------------------------------------------------


def test_E_an_old_holder_cannot_dead_letter_a_task_its_thief_completed(gcs_client, gcs_bucket):
    """The lease is stolen, the thief completes, then the old holder's consumer exits 65: its dead
    letter must be refused (LeaseLost), leaving the done marker alone."""
    store = gcs_store(gcs_client, gcs_bucket)
    submit(store, b"{}", tasks({"id": "x"}))
    old = next(iter(Claimer(store, ClaimOptions(worker="old", lease_ttl_s=0.3, seed=1))))
    thief = Claimer(store, ClaimOptions(worker="thief", lease_ttl_s=60, idle_timeout_s=5, poll_min_s=0.02,
                                        poll_max_s=0.1, seed=2))  # fmt: skip
    stolen = next(iter(thief))  # it waits until the silent lease has been unchanged for a TTL
    assert stolen.task_id == "x" and stolen.lease.complete([{"shard": 0}], time.monotonic())
    with pytest.raises(LeaseLost):
        old.lease.dead_letter("consumer exit 65: bad input", [{"shard": 9}])
    assert list(markers(store.root_url, layout.DONE)) == ["x"]
    assert markers(store.root_url, layout.FAILED) == {}


# -- F ----------------------------------------------------------------------------------------


class LateAnswers(CountingStore):
    """Lease writes are applied at once, but one answer comes back late; `meanwhile` runs in between."""

    def __init__(self, inner, meanwhile):
        super().__init__(inner)
        self.meanwhile = meanwhile

    def write(self, name, data, if_generation, metadata=None):
        generation = super().write(name, data, if_generation, metadata)
        if self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()
        return generation


def test_F_a_late_heartbeat_answer_does_not_let_the_old_holder_complete_a_stolen_task(gcs_client, gcs_bucket):
    """The old holder's heartbeat is applied, its answer comes late: meanwhile a thief saw the lease
    unchanged for a TTL and stole it. The old holder must not complete on the strength of its
    'recent' write; the thief's completion is the only one, and status keeps its counters."""
    inner = gcs_store(gcs_client, gcs_bucket)
    submit(inner, b"{}", tasks({"id": "f"}))
    stolen = []

    def steal() -> None:
        thief = Claimer(inner, ClaimOptions(worker="thief", lease_ttl_s=60, idle_timeout_s=5, poll_min_s=0.02,
                                            poll_max_s=0.1, seed=2))  # fmt: skip
        stolen.append(next(iter(thief)))

    store = LateAnswers(inner, None)
    old = next(iter(Claimer(store, ClaimOptions(worker="old", lease_ttl_s=0.5, seed=1))))
    store.meanwhile = steal
    old.lease.heartbeat([{"shard": 0, "counters": {"rows": 100}}])  # applied; the answer comes after the steal
    assert stolen and stolen[0].task_id == "f"
    with pytest.raises(LeaseLost):
        old.lease.complete([{"shard": 1, "counters": {"rows": 100}}], time.monotonic())
    assert markers(inner.root_url, layout.DONE) == {}  # the old holder made no marker
    assert stolen[0].lease.complete([{"shard": 1, "counters": {"rows": 7}}], time.monotonic())
    done = markers(inner.root_url, layout.DONE)
    assert done["f"]["worker"] == "thief"
    # The queue drains (its region swept); status counts the thief's counters from the markers.
    assert list(Claimer(inner, ClaimOptions(worker="last", idle_timeout_s=2, poll_min_s=0.02, poll_max_s=0.1))) == []
    view = snapshot(inner)
    assert view["regions"]["swept"] == 1 and view["counters"] == {"rows": 107}


# -- G ----------------------------------------------------------------------------------------


def test_G_regions_stay_about_a_thousand_tasks_whatever_the_batch_sizes(gcs, gcs_client, gcs_bucket):
    """Ten batches of 900 tasks: regions must still be cut at about a thousand, so that a first
    claim takes at most 10 requests (it took 12 with one region of 9,000).

    Each batch's tasks are seeded straight into the server's storage (the objects `submit` creates;
    9,000 creates over HTTP would take minutes on a loaded CI machine); then `submit`'s own
    region-cutting step runs for that batch over HTTP, as `submit` runs it after its creates."""
    store = GCSStore(gcs_bucket, "q", client=gcs_client)
    for batch in range(10):
        ids = [f"t{batch}{k:03d}" for k in range(900)]
        for task_id in ids:
            manifest = json.dumps({"id": task_id})
            gcs.storage.commit(gcs_bucket, f"q/{layout.task_object(task_id)}", manifest.encode(),
                               {"metadata": {"manifest": manifest}}, Preconditions(), "application/json")  # fmt: skip
        mark_regions(store, ids)
    starts = [layout.HEAD] + [layout.id_from_object(e.name, layout.SPLITS) for e in store.list(layout.SPLITS)]
    keys = [layout.key(layout.id_from_object(e.name, layout.TASKS)) for e in store.list(layout.TASKS)]
    bounds = [layout.key(s) if s else "" for s in starts] + ["~"]
    sizes = [sum(lo <= k < hi for k in keys) for lo, hi in zip(bounds, bounds[1:])]
    assert sum(sizes) == 9000 and max(sizes) <= layout.REGION_TASKS and len(sizes) >= 9, sizes
    counted = CountingStore(store)
    claim = next(iter(Claimer(counted, ClaimOptions(worker="w", seed=3))))
    assert counted.requests - 1 <= 10  # everything before the claim's own lease create
    claim.lease.release()

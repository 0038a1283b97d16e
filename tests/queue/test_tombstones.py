"""A finished task's lease stays as its tombstone (docs/PROTOCOL.md, "Completion"): claims need no done
check, a takeover checks for a marker its dead holder may have left, and a tombstone is final."""

from __future__ import annotations

import contextlib
import json
import time

import pytest

from objectstore import open_store
from objectstore.counting import CountingStore
from taskqueue import layout
from taskqueue.claims import Claimer, ClaimOptions
from taskqueue.clock import Clock
from taskqueue.lease import DEAD, DONE, HeldLease, LeaseLost, encode, new_lease_body
from tests.queue.conftest import submit_tasks
from tests.workers import renewing


def options(worker: str = "w") -> ClaimOptions:
    return ClaimOptions(worker=worker, lease_ttl_s=60, idle_timeout_s=5, poll_min_s=0.01, poll_max_s=0.05, seed=1)


def held_by_the_dead(store, task_id: str, ttl_s: float = 0.3) -> None:
    """The lease as a holder leaves it when it dies right after writing its marker: held, soon expired."""
    data, metadata = encode(new_lease_body(task_id, "dead-vm", ttl_s, Clock()))
    store.create(layout.lease_object(task_id), data, metadata=metadata)


def test_completion_leaves_a_done_tombstone_that_refuses_every_later_claim(queue_url):
    submit_tasks(queue_url, [{"id": "a"}])
    store = CountingStore(open_store(queue_url))
    claim = next(iter(Claimer(store, options())))
    claim.lease.heartbeat([{"shard": 0, "counters": {"rows": 2}}])
    beat = time.monotonic()
    before = store.requests
    assert claim.lease.complete([{"shard": 1, "counters": {"rows": 3}}], time.monotonic())
    # After a recent heartbeat: the done marker and the tombstone, and no lease write before them;
    # on GCS the tombstone waits out the second after the heartbeat (one write per second per object).
    assert store.requests - before == 2
    assert time.monotonic() - beat >= (1.0 if queue_url.startswith("gs://") else 0.0)
    marker = json.loads(store.read(layout.done_object("a")).data)
    assert [r["shard"] for r in marker["outputs"]] == [0, 1]
    lease = store.read(layout.lease_object("a"))
    body = json.loads(lease.data)
    assert body["state"] == DONE and [r["shard"] for r in body["progress"]] == [0, 1]
    (entry,) = store.list(layout.LEASES)
    assert entry.metadata["state"] == DONE and json.loads(entry.metadata["counters"]) == {"rows": 5}
    # A late release (a stop arriving after completion) must not turn the task back into work.
    with pytest.raises(LeaseLost):
        claim.lease.release()
    assert store.read(layout.lease_object("a")).generation == lease.generation
    # A worker whose view never saw the task finished collides with the tombstone and runs nothing.
    stale = Claimer(store, options("late"))
    assert list(stale) == [] and stale.exit_reason == "drained"


def test_a_holder_that_died_between_marker_and_tombstone_is_settled_not_rerun(queue_url):
    submit_tasks(queue_url, [{"id": "done-then-died"}, {"id": "failed-then-died"}, {"id": "todo"}])
    store = open_store(queue_url)
    counters = json.dumps({"rows": 4})
    store.create(layout.done_object("done-then-died"), b"{}", metadata={"counters": counters})
    held_by_the_dead(store, "done-then-died")
    store.create(layout.failed_object("failed-then-died"), json.dumps({"reason": "bad input"}).encode())
    held_by_the_dead(store, "failed-then-died")
    claimer = Claimer(store, options())
    ran = []
    for claim in claimer:
        ran.append(claim.task_id)
        claim.lease.complete([], time.monotonic())
    # Only the task nobody finished ran; the others were taken over after their TTL, found
    # finished, and their leases became the tombstones their holders never wrote.
    assert ran == ["todo"] and claimer.exit_reason == "drained"
    states = {layout.id_from_object(e.name, layout.LEASES): e.metadata for e in store.list(layout.LEASES)}
    assert {t: m["state"] for t, m in states.items()} == {"done-then-died": DONE, "failed-then-died": DEAD, "todo": DONE}
    assert states["done-then-died"]["counters"] == '{"rows":4}'  # so the sweep still sums them
    (swept,) = store.list(layout.SWEPT)
    assert (swept.metadata["tasks"], swept.metadata["failed"], swept.metadata["counters"]) == ("3", "1", '{"rows":4}')


class TurnCounting(CountingStore):
    """Counts as CountingStore does, and calls `then` once batches/ has been listed `turns` times."""

    def after(self, turns: int, then) -> None:
        self.turns, self.then = turns, then

    def list_page(self, prefix, *args, **kwargs):
        if prefix == layout.BATCHES:
            self.turns -= 1
            if self.turns == 0:
                self.then()
        return super().list_page(prefix, *args, **kwargs)


def test_a_waiting_worker_watches_its_regions_with_one_request_and_still_explores_the_rest(tmp_path):
    """Ten regions of three tasks, each with one task held by a live worker and the rest finished:
    nothing to claim, so the worker waits, polling mostly the regions it watches (one leases
    listing each) and now and then one it does not (tasks and leases). It is stopped after 80 turns
    of its loop (each lists batches/ once), not after a time: on a loaded machine 3 s held 27 polls,
    too few for the walk's own ten listings of each kind to stop mattering (a round at a load of 20
    failed on 47 > 2 * 27)."""
    from objectstore.local import LocalStore

    local = LocalStore(tmp_path / "q")
    store = CountingStore(local)
    ids = [f"t{k:02d}" for k in range(30)]
    submit_tasks(store.root_url, [{"id": t} for t in ids])
    busy = []
    for k, task_id in enumerate(ids):
        if k % 3 == 0 and k:
            store.create(layout.split_object(task_id), b"{}")  # regions of three, as submit cuts them by a thousand
        if k % 3 == 2:
            body = new_lease_body(task_id, "busy-vm", 3600, Clock())
            data, metadata = encode(body)
            busy.append(HeldLease(local, body, local.create(layout.lease_object(task_id), data, metadata=metadata), Clock()))
        else:
            data, metadata = encode({**new_lease_body(task_id, "gone-vm", 60, Clock()), "state": DONE})
            store.create(layout.lease_object(task_id), data, metadata=metadata)
    before = dict(store.counts)
    turns = TurnCounting(local, store.counts)
    waiting = Claimer(turns, ClaimOptions(worker="w", lease_ttl_s=0.5, idle_timeout_s=600.0, poll_min_s=0.01,
                                          poll_max_s=0.02, seed=3))  # fmt: skip
    turns.after(80, waiting.stop)
    with contextlib.ExitStack() as live:  # the busy workers renew (uncounted): the waiting one sees them alive
        for lease in busy:
            live.enter_context(renewing(lease))
        assert list(waiting) == [] and waiting.exit_reason == "stopped"
    polls = {k: store.counts[k] - before.get(k, 0) for k in ("list tasks/", "list leases/")}
    assert polls["list leases/"] > 2 * polls["list tasks/"]  # most polls re-list a watched region only
    assert set(waiting.view.tasks) | set(waiting.view.swept) <= set(waiting.view.splits)
    assert len(waiting.view.loaded) == 8 and polls["list tasks/"] > 10  # it kept loading unwatched regions too

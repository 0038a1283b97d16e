"""The simulated world itself (tests/simworld): what it models, it models as documented.

The seeds are only as good as their world: these pin the models the invariants lean on (listing
pages, writes applied after a timeout, suspended machines and their clocks, `updated` moved by a
lifecycle rule, a thread pool of actors, signals and deaths) against the production code that meets
them, outside any seed.
"""

from __future__ import annotations

import datetime as dt
import threading

import pytest

from taskqueue import layout
from taskqueue.submit import batch_name, submit
from tests.simworld.scheduler import InlineExecutor, Scheduler, SimClock, SimExecutor
from tests.simworld.faults import SetUpClock
from tests.simworld.store import Faults, Limits, SimStore


class Dead(BaseException):
    """A machine's death, as the seeds raise it."""


def test_short_pages_list_everything_in_order_within_the_offsets():
    store = SimStore(Scheduler(), page_limit=2)
    names = [f"tasks/t{k:02d}.json" for k in range(7)]
    for name in reversed(names):
        store.create(name, b"{}")
    pages, token = [], None
    while True:
        page = store.list_page("tasks/", page_token=token)
        pages.append([e.name for e in page.entries])
        token = page.next_token
        if not token:
            break
    assert [len(p) for p in pages] == [2, 2, 2, 1] and sum(pages, []) == names
    assert [e.name for e in store.list("tasks/", start_offset=names[2], end_offset=names[6])] == names[2:6]


class TimeoutOnce(Faults):
    """The first write of `name` times out at the client; the store applies it `apply_after_s` later."""

    def __init__(self, name: str, after_s: float):  # noqa: D107
        self.name, self.apply_after_s, self.fired = name, after_s, False

    def draw(self, op, name):
        if name == self.name and op in ("create", "write") and not self.fired:
            self.fired = True
            return "timeout"
        return None


def run_actor(scheduler: Scheduler, target, machine=None) -> None:
    scheduler.spawn("actor", target, 0.0, machine=machine)
    scheduler.run()


def test_a_write_the_client_gave_up_on_is_applied_later_with_the_preconditions_of_then():
    scheduler = Scheduler()
    limits = Limits(latency_s=0.01, retry_deadline_s=3.0, timeout_s=2.0)
    store = SimStore(scheduler, limits, faults=TimeoutOnce("leases/a.json", after_s=30.0))
    seen = {}

    def actor():
        seen["generation"] = store.create("leases/a.json", b"first")  # timed out, then retried: created
        scheduler.sleep(40.0)  # the first attempt lands now, and finds the object there
        seen["later"] = store.read("leases/a.json").generation

    run_actor(scheduler, actor)
    assert seen["later"] == seen["generation"]  # the late copy changed nothing

    scheduler = Scheduler()
    gave_up = SimStore(scheduler, Limits(latency_s=0.01, retry_deadline_s=0.0, timeout_s=2.0),
                       faults=TimeoutOnce("leases/b.json", after_s=30.0))  # fmt: skip
    seen.clear()

    def no_retry():
        with pytest.raises(Exception):
            gave_up.create("leases/b.json", b"late")
        seen["before"] = gave_up.exists("leases/b.json")
        scheduler.sleep(40.0)
        seen["after"] = gave_up.read("leases/b.json").data

    run_actor(scheduler, no_retry)
    assert seen == {"before": False, "after": b"late"}  # applied after the client gave up on it

    scheduler = Scheduler()
    raced = SimStore(scheduler, Limits(latency_s=0.01, retry_deadline_s=0.0, timeout_s=2.0),
                     faults=TimeoutOnce("leases/c.json", after_s=30.0))  # fmt: skip

    def someone_else_first():
        with pytest.raises(Exception):
            raced.create("leases/c.json", b"late")
        raced.create("leases/c.json", b"theirs")  # before the late one lands: it then finds the object there
        scheduler.sleep(40.0)

    run_actor(scheduler, someone_else_first)
    assert raced.peek("leases/c.json")[1] == b"theirs"


def test_a_suspended_machine_waits_and_its_clock_stands_still_or_counts_it():
    machine = object()
    stops = [(10.0, 70.0)]
    scheduler = Scheduler(gate=lambda actor, at: 70.0 if actor.machine is machine and 10.0 <= at < 70.0 else at)
    stopping, counting = SimClock(scheduler, stops=stops), SimClock(scheduler)
    woke = {}

    def actor():
        scheduler.sleep(5.0)
        before = (stopping.monotonic(), counting.monotonic())
        scheduler.sleep(10.0)  # due at 15, inside the suspension: runs at 70
        woke["at"] = scheduler.now
        woke["elapsed"] = (stopping.monotonic() - before[0], counting.monotonic() - before[1])

    run_actor(scheduler, actor, machine=machine)
    assert woke["at"] == 70.0
    assert woke["elapsed"] == (pytest.approx(5.0), pytest.approx(65.0))  # stood still 60 s; counted them


def test_a_lifecycle_change_moves_updated_not_the_generation_and_no_marker_goes_sooner():
    scheduler = Scheduler()  # no actor runs: the store's time is set by hand
    store = SimStore(scheduler)

    def submit_at(now: float, task: str) -> None:
        scheduler.now = now
        submit(store, None, [(task, b'{"id": "%s"}' % task.encode())], clock=SetUpClock(scheduler),
               executor=InlineExecutor(), batch_keep_s=150.0)  # fmt: skip

    submit_at(0.0, "t0")
    submit_at(10.0, "t1")
    first = batch_name(["t0"])
    entry, _ = store.peek(first)
    scheduler.now = 190.0
    assert store.touch(first)  # a lifecycle rule changed its storage class: `updated` moves on
    touched, _ = store.peek(first)
    assert touched.generation == entry.generation and touched.updated > entry.updated
    submit_at(200.0, "t2")  # prunes what is 150 s older than its own marker
    left = set(store.names(layout.BATCHES))
    assert batch_name(["t1"]) not in left and first in left  # t0's, touched 10 s ago, stays for now
    pruned, _ = store.peek(layout.PRUNED)
    assert pruned.metadata["before"] == (entry.updated + dt.timedelta(seconds=50)).isoformat()  # 200 - 150 s


def test_a_pool_of_actors_runs_calls_side_by_side_and_they_die_with_their_machine():
    scheduler = Scheduler(ends=(Dead,))
    store = SimStore(scheduler, Limits(latency_s=1.0))
    machine = object()
    pool = SimExecutor(scheduler, max_workers=3)
    results = {}

    def main():
        futures = [pool.submit(store.create, f"tasks/t{k}.json", b"{}") for k in range(6)]
        scheduler.sleep(0.5)  # three requests in flight now, three queued
        results["in_flight"] = sum(1 for a in scheduler.actors if a.machine is machine and a.name != "main")
        for actor in scheduler.actors_of(machine):
            scheduler.interrupt(actor, Dead())  # the machine dies: each actor at its next turn
        for future in futures:
            results.setdefault("done", 0)
            results["done"] += future.done()

    scheduler.spawn("main", main, 0.0, machine=machine)
    scheduler.run()
    assert results["in_flight"] == 3
    # The three requests in flight were applied (the store had them); nothing queued behind them ran.
    assert sorted(store.names("tasks/")) == ["tasks/t0.json", "tasks/t1.json", "tasks/t2.json"]


def test_a_signal_wakes_a_waiting_actor_at_once_and_waits_for_a_request_in_flight():
    scheduler = Scheduler()
    store = SimStore(scheduler, Limits(latency_s=5.0))
    got = {}

    def waiter():
        try:
            SimClock(scheduler).wait(threading.Event(), 100.0)
        except KeyboardInterrupt:
            got["waiter"] = scheduler.now

    def requester():
        try:
            store.create("tasks/x.json", b"{}")
        except KeyboardInterrupt:
            got["requester"] = scheduler.now

    w = scheduler.spawn("waiter", waiter, 0.0)
    r = scheduler.spawn("requester", requester, 0.0)
    scheduler.spawn("signal", lambda: (scheduler.interrupt(w, KeyboardInterrupt()), scheduler.interrupt(r, KeyboardInterrupt())), 1.0)
    scheduler.run()
    assert got["waiter"] == 1.0  # woken by the signal, not at 100
    assert got["requester"] > 1.0 and store.exists("tasks/x.json")  # its request was applied; the answer never read

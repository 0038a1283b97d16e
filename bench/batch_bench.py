"""What a poll and a status cost after many small submits: `python -m bench.batch_bench [--submits 10000]`.

A queue fed by one-task submits, one every `--every-s` seconds of virtual time, on bench/fleet_sim.py's
`Scheduler` and `SimStore` (GCS's listing pages of 1000, its one write per second per object): a
worker (the real `Claimer`) claims and completes each task as it comes and waits between them,
while a holder keeps one long task leased, so the worker never drains. At the end it reports, for
the waiting worker, the requests of its last polls, and the requests of a `status.snapshot`.

Two queues side by side, the same submits: `now`, where each submit deletes the `done` batch
markers older than BATCH_KEEP_S (docs/PROTOCOL.md, "Batches"), and `before`, where none is ever
deleted (the code before issue 25). It is a benchmark: it prints figures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import logging
import threading
import time
from unittest import mock

from bench.fleet_sim import EPOCH, InlineExecutor, Limits, Scheduler, SimClock, SimStore
from taskqueue import layout
from taskqueue import submit as submit_module
from taskqueue.claims import Claimer, ClaimOptions
from reporting.status import snapshot
from taskqueue.submit import submit

LAST_POLLS = 20


def run(submits: int, every_s: float, prune: bool) -> dict:
    scheduler = Scheduler()
    store = SimStore(scheduler, Limits(), seed=1)
    done = threading.Event()
    polls: list[tuple[float, int]] = []  # (when, the worker's request count) at each poll's start
    quiet_from: list[float] = []  # when the last submit ended
    holder_stop = threading.Event()

    def submitter() -> None:
        clock = SimClock(scheduler)
        for k in range(submits):
            submit(store, b"{}", [(f"t{k:06d}", json.dumps({"id": f"t{k:06d}"}).encode())], parallel=1, clock=clock)
            scheduler.sleep(every_s)
        quiet_from.append(scheduler.now)
        scheduler.sleep(60.0 * (LAST_POLLS + 3))  # the worker's last polls, on a queue with nothing new
        done.set()
        holder_stop.set()

    def holder() -> None:
        clock = SimClock(scheduler)
        claim = next(iter(Claimer(store, ClaimOptions(worker="holder", seed=2), clock)))
        while not clock.wait(holder_stop, 30.0):
            claim.lease.heartbeat()
        claim.lease.release()

    def worker() -> None:
        claimer = Claimer(store, ClaimOptions(worker="worker", idle_timeout_s=1e9, seed=3), SimClock(scheduler))
        poll = claimer._poll

        def counted_poll() -> None:
            polls.append((scheduler.now, store.by_worker["worker"]))
            if done.is_set():
                claimer.stop()
            poll()

        claimer._poll = counted_poll
        for claim in claimer:
            claim.lease.complete([], claimer.clock.monotonic())

    submit(store, b"{}", [("a-long", b'{"id": "a-long"}')], parallel=1)  # the holder's task, first in key order
    scheduler.spawn("holder", holder, 0.0)
    scheduler.spawn("worker", worker, 1.0)
    scheduler.spawn("submitter", submitter, 5.0)
    started = time.monotonic()
    with mock.patch.object(concurrent.futures, "ThreadPoolExecutor", InlineExecutor), \
            mock.patch.object(submit_module, "prune_batches", submit_module.prune_batches if prune else lambda *a: 0):
        scheduler.run()
    wall = time.monotonic() - started
    # Polls from the second after the last submit on (the first may still bring that submit's news).
    last = [n for at, n in polls if at > quiet_from[0]][1:]
    scheduler.current = None
    before = dict(store.by_kind)
    view = snapshot(store, now=EPOCH + dt.timedelta(seconds=scheduler.now))
    status_kinds = {k: v - before.get(k, 0) for k, v in store.by_kind.items() if v != before.get(k, 0)}
    return {
        "submits": submits,
        "batch_markers_left": len(store.names.get(layout.BATCHES, [])),
        "polls_measured": len(last) - 1,
        "poll_requests": round((last[-1] - last[0]) / (len(last) - 1), 2),
        "batches_pages": max(1, -(-len(store.names.get(layout.BATCHES, [])) // 1000)),
        "status_requests": view["requests"],
        "status_batches_listings": view["requests_by_kind"].get("list batches/", 0),
        "status_total": view["total"],
        "store_requests": sum(store.by_kind.values()),
        "submit_deletes_of_batches": store.by_kind.get("delete batches/", 0),
        "virtual_s": round(scheduler.now),
        "wall_s": round(wall, 1),
        "status_kinds": status_kinds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--submits", type=int, default=10_000)
    p.add_argument("--every-s", type=float, default=2.0, help="virtual seconds between two submits")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("taskqueue", "objectstore"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    results = {name: run(args.submits, args.every_s, prune) for name, prune in (("now", True), ("before", False))}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for name, r in results.items():
        print(f"{name:6s} {r['submits']} one-task submits, one every {args.every_s:g}s: {r['batch_markers_left']} batch "
              f"markers left; a waiting worker's poll {r['poll_requests']} requests (mean of "
              f"{r['polls_measured']}; batches/ in {r['batches_pages']} page(s)); status {r['status_requests']} requests "
              f"({r['status_batches_listings']} listings of batches/, total {r['status_total']}); "
              f"deletes of batch markers {r['submit_deletes_of_batches']}; {r['store_requests']} requests in all; "
              f"simulated in {r['wall_s']}s")


if __name__ == "__main__":
    main()

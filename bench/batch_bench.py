"""What a poll and a status cost when submits keep coming: `python -m bench.batch_bench [--submits 10000] [--submitters 8]`.

A queue fed by one-task submits from `--submitters` submitters side by side, each one every `--every-s`
seconds of virtual time, on tests/simworld's `Scheduler` and `SimStore` (GCS's listing pages of 1000,
its one write per second per object): a worker (the real `Claimer`) claims and completes each task
as it comes and waits between them, while a holder keeps one long task leased, so the worker never
drains. At the end it reports the batch markers left, the requests of the waiting worker's last
polls, and the requests of a `reporting.status.snapshot`.

The same submits side by side, with done batch markers kept as long as the submits' `batch_keep_s`
says: 600 s (what issue 25 chose, when a busy worker's clock decided when it had missed a batch) and
180 s (layout.BATCH_KEEP_S now, since the pruned marker tells a worker that it missed one). Markers
left grow with the submit rate times the keep time, and a poll lists all of them, a page per
thousand. It is a benchmark: it prints figures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import threading
import time

from reporting.status import snapshot
from taskqueue import layout
from taskqueue.claims import Claimer, ClaimOptions
from taskqueue.submit import submit
from tests.simworld.scheduler import EPOCH, InlineExecutor, Scheduler, SimClock
from tests.simworld.store import Limits, SimStore

LAST_POLLS = 20


def run(submits: int, every_s: float, submitters: int, keep_s: float) -> dict:
    scheduler = Scheduler()
    store = SimStore(scheduler, Limits(), seed=1)
    done = threading.Event()
    quiet_from: list[float] = []  # when the last submit ended
    holder_stop = threading.Event()
    finished, completed = [0], [0]

    def submitter(k: int) -> None:
        clock = SimClock(scheduler)
        for n in range(k, submits, submitters):
            task = f"t{n:06d}"
            submit(store, b"{}", [(task, json.dumps({"id": task}).encode())], clock=clock, executor=InlineExecutor(),
                   batch_keep_s=keep_s)  # fmt: skip
            scheduler.sleep(every_s)
        finished[0] += 1
        if finished[0] == submitters:
            while completed[0] < submits:  # the worker catches up (a task costs it about a second: GCS's
                scheduler.sleep(10.0)  # one write a second to its lease, claim then tombstone)
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

    polls: list[tuple[float, int]] = []  # (when, the worker's requests so far) at each poll's start
    claimer = Claimer(store, ClaimOptions(worker="worker", idle_timeout_s=1e9, seed=3), SimClock(scheduler))
    poll = claimer._poll

    def counted_poll() -> None:  # (the bench's instrument: the poll itself runs unchanged)
        polls.append((scheduler.now, store.by_actor["worker"]))
        if done.is_set():
            claimer.stop()
        poll()

    claimer._poll = counted_poll

    def worker() -> None:
        for claim in claimer:
            claim.lease.complete([], claimer.clock.monotonic())
            completed[0] += 1

    submit(store, b"{}", [("a-long", b'{"id": "a-long"}')], executor=InlineExecutor())  # the holder's, first in key order
    scheduler.spawn("holder", holder, 0.0)
    scheduler.spawn("worker", worker, 1.0)
    for k in range(submitters):
        scheduler.spawn(f"submitter{k}", lambda k=k: submitter(k), 5.0 + k * every_s / submitters)
    started = time.monotonic()
    scheduler.run()
    wall = time.monotonic() - started
    # The waits of the last polls (from the second after the last submit on: the first may bring its news).
    last = [n for at, n in polls if at > quiet_from[0]][1:]
    markers = len(store.names(layout.BATCHES))
    view = snapshot(store, now=EPOCH + dt.timedelta(seconds=scheduler.now))
    return {
        "submits": submits,
        "submitters": submitters,
        "keep_s": keep_s,
        "batch_markers_left": markers,
        "polls_measured": len(last) - 1,
        "poll_requests": round((last[-1] - last[0]) / (len(last) - 1), 2),
        "batches_pages": max(1, -(-markers // 1000)),
        "status_requests": view["requests"],
        "status_batches_listings": view["requests_by_kind"].get("list batches/", 0),
        "status_total": view["total"],
        "store_requests": sum(store.by_kind.values()),
        "submit_deletes_of_batches": store.by_kind.get("delete batches/", 0),
        "pruned_marker_429s": store.throttled.get("write same object (batches/)", 0),
        "virtual_s": round(scheduler.now),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--submits", type=int, default=10_000)
    p.add_argument("--every-s", type=float, default=2.0, help="virtual seconds between two submits of one submitter")
    p.add_argument("--submitters", type=int, default=8, help="submitters side by side")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    for noisy in ("taskqueue", "objectstore"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    results = {f"keep {keep:g}s": run(args.submits, args.every_s, args.submitters, keep) for keep in (600.0, layout.BATCH_KEEP_S)}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for name, r in results.items():
        print(f"{name:10s} {r['submits']} one-task submits from {r['submitters']} submitters, each one every "
              f"{args.every_s:g}s: {r['batch_markers_left']} batch markers left; a waiting worker's poll "
              f"{r['poll_requests']} requests (mean of {r['polls_measured']}; batches/ in {r['batches_pages']} page(s)); "
              f"status {r['status_requests']} requests ({r['status_batches_listings']} listings of batches/, total "
              f"{r['status_total']}); deletes of batch markers {r['submit_deletes_of_batches']} (429s on the pruned marker "
              f"{r['pruned_marker_429s']}); {r['store_requests']} "
              f"requests in all; simulated in {r['wall_s']}s")  # fmt: skip


if __name__ == "__main__":
    main()

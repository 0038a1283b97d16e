"""GCS requests per task and claims per second: our claim protocol beside the naive baseline.

    python -m bench.queue_bench [--workers 64] [--tasks 5000] [--baseline-tasks 500]

W worker threads, each with its own `google-cloud-storage` client, drain T no-op tasks from a
queue on the test GCS server (tests/fakegcs) over HTTP. Our workers run the real `Claimer` and
`HeldLease`; the baseline is what the older scripts did: list every task, then try each in order
(GET its done marker, try to create its lease). Requests are counted on the client per operation
and cross-checked against the server's own per-kind counts. The baseline walks every task from
every worker, so by default it runs on a smaller queue; both protocols also run on that size,
and the ratio is taken there.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import threading
import time
import uuid

from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from objectstore import NotFound, ObjectStore, PreconditionFailed
from objectstore.counting import CountingStore
from objectstore.gcs import GCSStore
from taskqueue import layout
from taskqueue.claims import Claimer, ClaimOptions
from taskqueue.submit import submit
from tests.fakegcs import FakeGCS


def ours(store: ObjectStore, worker: str, runs: collections.Counter, lock: threading.Lock) -> None:
    claimer = Claimer(store, ClaimOptions(worker=worker, lease_ttl_s=60, idle_timeout_s=30, poll_min_s=0.05, poll_max_s=0.5))
    for claim in claimer:
        with lock:
            runs[claim.task_id] += 1
        claim.lease.complete([], time.monotonic())


def naive(store: ObjectStore, worker: str, runs: collections.Counter, lock: threading.Lock) -> None:
    ids = sorted(layout.id_from_object(e.name, layout.TASKS) for e in store.list(layout.TASKS))
    for task_id in ids:
        try:
            store.read(layout.done_object(task_id))
            continue
        except NotFound:
            pass
        try:
            generation = store.create(layout.lease_object(task_id), json.dumps({"worker": worker}).encode())
        except PreconditionFailed:
            continue
        with lock:
            runs[task_id] += 1
        try:
            store.create(layout.done_object(task_id), b"{}")
        except PreconditionFailed:
            pass
        store.delete(layout.lease_object(task_id), if_generation=generation)


def run(server: FakeGCS, protocol, workers: int, tasks: int) -> dict:
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    server.create_bucket(bucket)
    setup = GCSStore(bucket, "q", client=storage.Client(project="bench", credentials=AnonymousCredentials()))
    submit(setup, b"{}", [(f"t{k:06d}", json.dumps({"id": f"t{k:06d}"}).encode()) for k in range(tasks)], parallel=32)
    counts: collections.Counter = collections.Counter()
    runs: collections.Counter = collections.Counter()
    lock = threading.Lock()
    stores = [
        CountingStore(
            GCSStore(bucket, "q", client=storage.Client(project="bench", credentials=AnonymousCredentials())), counts, lock
        )
        for _ in range(workers)
    ]
    server.reset_counts()
    started = time.monotonic()
    threads = [threading.Thread(target=protocol, args=(stores[w], f"w{w}", runs, lock)) for w in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.monotonic() - started
    done = sum(1 for _ in setup.list(layout.DONE))
    server_counts = server.counts()
    total = sum(counts.values())
    return {
        "protocol": protocol.__name__,
        "workers": workers,
        "tasks": tasks,
        "done_markers": done,
        "runs": sum(runs.values()),
        "double_runs": sum(n - 1 for n in runs.values() if n > 1),
        "seconds": round(seconds, 2),
        "claims_per_s": round(tasks / seconds, 1),
        "requests": total,
        "requests_per_task": round(total / tasks, 3),
        "by_operation": {k: round(v / tasks, 3) for k, v in sorted(counts.items())},
        "server_counts": {k: v for k, v in server_counts.items() if k != "faults_injected"},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--tasks", type=int, default=5000)
    p.add_argument("--baseline-tasks", type=int, default=500, help="queue size for the side-by-side comparison")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with FakeGCS() as server:
        os.environ["STORAGE_EMULATOR_HOST"] = server.url  # the clients below talk to the test server
        results = [
            run(server, ours, args.workers, args.tasks),
            run(server, ours, args.workers, args.baseline_tasks),
            run(server, naive, args.workers, args.baseline_tasks),
        ]
    if args.json:
        print(json.dumps(results, indent=1))
    for r in results:
        print(
            f"{r['protocol']:>5}  {r['workers']:>3} workers x {r['tasks']:>5} tasks: "
            f"{r['requests_per_task']:.3f} requests/task, {r['claims_per_s']:.0f} claims/s, "
            f"done markers {r['done_markers']}/{r['tasks']}, double runs {r['double_runs']}"
        )
        print("       per task: " + ", ".join(f"{k}={v}" for k, v in r["by_operation"].items()))
        print(f"       server saw: {r['server_counts']}")
    small_ours, small_naive = results[1], results[2]
    print(
        f"ratio at {args.workers} x {args.baseline_tasks}: naive/ours requests per task = "
        f"{small_naive['requests_per_task'] / small_ours['requests_per_task']:.1f}x, "
        f"ours/naive claims per second = {small_ours['claims_per_s'] / small_naive['claims_per_s']:.1f}x"
    )


if __name__ == "__main__":
    main()

"""A region map past one listing page (issue 39, defect 2), on the fake GCS server through the real client.

More than 1,000 `splits/` markers (over a million tasks at the default region size) take more than
one page to list. A claim needs only the first; a waiting worker's polls and its last look must
reach every region. Before the fix they covered only the regions of the pages listed so far: a
worker that found nothing in two regions of the first page waited, polled those, and left `idle`
with tasks past the first page never claimed (a fresh worker left having run nothing).

The queue is seeded straight into the server's storage as workers and `submit` leave it, with one
task per region so that a thousand regions cost a thousand tasks: 1,002 regions, every one of the
first page swept but two whose tasks a live holder runs, and two past the page.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

from objectstore.gcs import GCSStore, RetryPolicy
from taskqueue import layout
from taskqueue.claims import Claimer, ClaimOptions
from taskqueue.clock import Clock
from taskqueue.lease import HeldLease, encode, new_lease_body
from reporting.status import snapshot
from tests.fakegcs.server import Preconditions
from tests.workers import WaitingClock, renewing

PREFIX = "q"
REGIONS = 1002
IDS = [f"t{k:05d}" for k in range(REGIONS)]  # one task per region: a split at every id but the first
HELD = IDS[500:502]  # two regions of the first page: a live holder runs their tasks
BEYOND = IDS[1000:]  # the regions whose start is not on the first page of splits/ (1,000 splits there)
SWEPT = [t for t in IDS[:1000] if t not in HELD]


def commit(gcs, bucket: str, name: str, data: bytes = b"{}", metadata: dict | None = None) -> None:
    gcs.storage.commit(bucket, f"{PREFIX}/{name}", data, {"metadata": metadata or {}}, Preconditions(), None)


def seed_big_map(gcs, bucket: str) -> None:
    for k, task_id in enumerate(IDS):
        manifest = json.dumps({"id": task_id})
        commit(gcs, bucket, layout.task_object(task_id), manifest.encode(), {"manifest": manifest})
        if k:
            commit(gcs, bucket, layout.split_object(task_id))
    for task_id in SWEPT:
        end = IDS[IDS.index(task_id) + 1]
        commit(gcs, bucket, layout.done_object(task_id))
        commit(gcs, bucket, layout.lease_object(task_id), metadata={"state": "done"})
        commit(gcs, bucket, layout.swept_object(task_id if task_id != IDS[0] else layout.HEAD),
               metadata={"end": end, "tasks": "1", "failed": "0", "confirmed": "1"})  # fmt: skip


def hold(store, task_id: str, worker: str) -> HeldLease:
    body = new_lease_body(task_id, worker, 30.0, Clock())
    data, metadata = encode(body)
    return HeldLease(store, body, store.create(layout.lease_object(task_id), data, metadata=metadata), Clock())


def a_worker(store, seed: int = 1, idle_timeout_s: float = 1.5, clock: Clock | None = None) -> Claimer:
    options = ClaimOptions(worker="w", idle_timeout_s=idle_timeout_s, poll_min_s=0.02, poll_max_s=0.1, seed=seed)
    return Claimer(store, options, clock)


def run(claimer: Claimer) -> list[str]:
    return [c.task_id for c in claimer if c.lease.complete([], time.monotonic())]


def store_for(gcs, gcs_client, gcs_bucket) -> GCSStore:
    seed_big_map(gcs, gcs_bucket)
    store = GCSStore(gcs_bucket, PREFIX, client=gcs_client, policy=RetryPolicy(initial_s=0.01, cap_s=0.05, deadline_s=5))
    assert len(list(store.list(layout.SPLITS))) == REGIONS - 1 > 1000  # more than one page
    return store


def test_a_fresh_worker_finds_the_tasks_past_the_first_page_of_regions(gcs, gcs_client, gcs_bucket):
    store = store_for(gcs, gcs_client, gcs_bucket)
    held = [hold(store, t, "holder") for t in HELD]
    with contextlib.ExitStack() as stack:
        for lease in held:
            stack.enter_context(renewing(lease))
        worker = a_worker(store)
        ran = run(worker)
    assert sorted(ran) == BEYOND, f"exit {worker.exit_reason} having run {ran}"
    assert worker.exit_reason == "idle"  # the two held tasks are still held


def test_a_waiting_worker_takes_over_tasks_released_past_the_first_page_before_it_leaves(gcs, gcs_client, gcs_bucket):
    """Every task is held when the worker starts, so it waits; then the holder of the tasks past
    the first page gives them back. The worker's polls and last look must find them."""
    store = store_for(gcs, gcs_client, gcs_bucket)
    held = [hold(store, t, "holder") for t in HELD]
    beyond = [hold(store, t, "other") for t in BEYOND]
    clock = WaitingClock()
    worker = a_worker(store, idle_timeout_s=2.0, clock=clock)
    ran: list[str] = []
    thread = clock.thread = threading.Thread(target=lambda: ran.extend(run(worker)))
    with contextlib.ExitStack() as stack:
        for lease in held:
            stack.enter_context(renewing(lease))
        with contextlib.ExitStack() as others:
            for lease in beyond:
                others.enter_context(renewing(lease))
            thread.start()
            assert clock.waiting.wait(60), "the worker never waited"  # it found nothing and waits
        for lease in beyond:
            lease.release()
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert sorted(ran) == BEYOND, f"exit {worker.exit_reason} having run {ran}"


def test_status_counts_every_region_past_the_first_page(gcs, gcs_client, gcs_bucket):
    store = store_for(gcs, gcs_client, gcs_bucket)
    view = snapshot(store)
    assert (view["total"], view["done"], view["complete"]) == (REGIONS, len(SWEPT), False)

"""Sweeping a finished region: the swept marker that lets every reader count it from one object (docs/PROTOCOL.md, "Swept regions").

The rule that says when a region counts as swept is `layout.swept`, which the worker's view and
status both read; this module writes the markers that rule reads.
"""

from __future__ import annotations

import json
import logging
import threading

from objectstore import NotFound, ObjectStore, PreconditionFailed
from taskqueue import layout
from taskqueue.clock import Clock
from taskqueue.lease import DEAD, FINISHED, marker_of, sum_metadata_counters
from taskqueue.view import QueueView, offset

log = logging.getLogger(__name__)


class Sweeper:
    """Sweeps the regions a worker's view found finished, as `worker`; waits on `stop_event`."""

    def __init__(self, store: ObjectStore, view: QueueView, clock: Clock, worker: str, stop_event: threading.Event):
        self.store = store
        self.view = view
        self.clock = clock
        self.worker = worker
        self.stop_event = stop_event

    def sweep(self, region: str) -> None:
        """Mark a region whose every task is finished (docs/PROTOCOL.md, "Regions").

        The region's done markers and dead letters are listed first: a holder that died between
        its tombstone and its marker left the marker to whoever sweeps, who copies it from the
        tombstone. The swept marker's counts are therefore counts of markers. The tasks are listed
        again after the marker is written: a task submitted after the load shows up there (then the
        marker is taken back), and one submitted later finds the marker and removes it, so a swept
        marker never hides a task that is still to run.
        """
        if region in self.view.swept and self.view.is_swept(region):
            return
        end = self.view.region_end(region)
        ids = self.view.tasks.get(region, [])
        done, failed = self.markers(region)
        for task_id in ids:
            if task_id not in done and task_id not in failed and not self.mark_from_tombstone(task_id, done, failed):
                return
        record = {
            "region": region,
            "end": end,
            "tasks": len(ids),
            "failed": sum(t in failed for t in ids),
            "worker": self.worker,
            "swept_at": self.clock.wall_iso(),
        }
        metadata = {"end": end or "", "tasks": str(record["tasks"]), "failed": str(record["failed"])}
        counters = sum_metadata_counters(done[t] for t in ids if done.get(t))
        if counters:
            # Status counts a swept region from its marker alone, so the done markers' counters go with it.
            record["counters"] = counters
            metadata["counters"] = json.dumps(counters, separators=(",", ":"), sort_keys=True)
        name = layout.swept_object(region)
        try:
            generation = self.store.create(name, json.dumps(record).encode(), metadata=metadata)
        except PreconditionFailed:
            # Swept by someone else; if they never confirmed it (they died, or are about to), we do.
            page = self.store.list_page(layout.SWEPT, start_offset=name, page_size=1)
            current = next((e for e in page.entries if e.name == name), None)
            if current is None:
                return  # withdrawn: the next visit looks again
            generation = current.generation
            if current.metadata.get("confirmed"):
                self.view.swept[region] = {**metadata, "confirmed": "1"}
                return
        created = self.clock.monotonic()
        again = self.view.list_region_tasks(region)
        if set(again) != set(ids):
            # New tasks: unfinished ones must not be hidden, and finished ones (claimed and completed by
            # others since our task listing) are not in the marker's counts. Withdraw; a later sweep counts them.
            log.info("event=sweep_withdrawn region=%r reason=new_tasks", region)
            try:
                self.store.delete(layout.swept_object(region), if_generation=generation)
            except (NotFound, PreconditionFailed):
                pass  # the submitter removed it already
            self.view.tasks[region] = again
            return
        # Confirmed: its second task listing found nothing new. Only now may anyone take it for swept.
        # (GCS allows one write per second to an object: https://cloud.google.com/storage/quotas#objects)
        wait = self.store.same_object_write_gap_s - (self.clock.monotonic() - created)
        if wait > 0:
            self.clock.wait(self.stop_event, wait)
        try:
            self.store.write(name, json.dumps(record).encode(), if_generation=generation,
                             metadata={**metadata, "confirmed": "1"})  # fmt: skip
        except (NotFound, PreconditionFailed):
            return  # the submitter removed it, or another sweeper confirmed it first
        self.view.swept[region] = {**metadata, "confirmed": "1"}
        log.info("event=swept region=%r tasks=%d", region, len(ids))

    def markers(self, region: str) -> tuple[dict[str, str | None], set[str]]:
        """The region's done markers (id -> their `counters` metadata) and dead letters: two listings."""
        end = self.view.region_end(region)
        done: dict[str, str | None] = {}
        for entry in self.store.list(layout.DONE, start_offset=offset(layout.DONE, region), end_offset=offset(layout.DONE, end)):
            task_id = layout.id_from_object(entry.name, layout.DONE)
            if task_id is not None:
                done[task_id] = entry.metadata.get("counters")
        failed = set()
        for entry in self.store.list(layout.FAILED, start_offset=offset(layout.FAILED, region), end_offset=offset(layout.FAILED, end)):
            task_id = layout.id_from_object(entry.name, layout.FAILED)
            if task_id is not None:
                failed.add(task_id)
        return done, failed

    def mark_from_tombstone(self, task_id: str, done: dict[str, str | None], failed: set[str]) -> bool:
        """The marker a holder that died after its tombstone never wrote; False when the lease is no tombstone."""
        try:
            tombstone = json.loads(self.store.read(layout.lease_object(task_id)).data)
        except (NotFound, ValueError) as exc:
            log.error("event=sweep_refused task=%s reason=%r", task_id, f"lease unreadable: {exc}")
            return False
        if not isinstance(tombstone, dict) or tombstone.get("state") not in FINISHED:
            log.error("event=sweep_refused task=%s reason=lease_not_a_tombstone", task_id)
            return False
        name, data, metadata = marker_of(tombstone)
        try:
            self.store.create(name, data, metadata=metadata)
            log.info("event=marker_from_tombstone task=%s object=%s", task_id, name)
        except PreconditionFailed:
            pass  # its holder wrote it meanwhile: the same body
        if tombstone["state"] == DEAD:
            failed.add(task_id)
        else:
            done[task_id] = (metadata or {}).get("counters")
        return True

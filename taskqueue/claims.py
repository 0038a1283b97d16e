"""Finding and claiming tasks: the worker's view of the queue and the claim loop (docs/PROTOCOL.md, "Claim").

`Claimer` is an iterator of claimed tasks. The view is built from a few listings instead of a GET
per task; it only has to be fresh enough to keep the claim cheap, because every state change is
still decided by a conditional write.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
from collections.abc import Iterator

from objectstore import NotFound, ObjectStore, PreconditionFailed, StoreError, StoreUnavailable
from taskqueue import layout
from taskqueue.clock import Clock
from taskqueue.lease import DEAD, HELD, RELEASED, HeldLease, encode, new_lease_body

log = logging.getLogger(__name__)

LOOKAHEAD = 64  # done markers read ahead by each claim's done check
JUMP_TRIES = 4  # runs a jump re-lists before landing in the last one anyway
RELIST_PAGE = 1000  # done markers per re-list: one request steps over another worker's finished stretch


@dataclasses.dataclass
class Sighting:
    """A lease generation as first seen by this worker, on its own monotonic clock."""

    generation: int
    state: str
    worker: str
    ttl_s: float
    first_seen: float


@dataclasses.dataclass
class Claim:
    task_id: str
    lease: HeldLease
    manifest: dict | None  # None when the manifest is bad; `problem` says why
    problem: str | None = None


@dataclasses.dataclass(frozen=True)
class ClaimOptions:
    worker: str
    lease_ttl_s: float = 120.0
    idle_timeout_s: float = 300.0
    poll_min_s: float = 1.0
    poll_max_s: float = 30.0
    seed: int | None = None


class QueueView:
    """What one worker knows about the queue, from listings."""

    def __init__(self, store: ObjectStore, clock: Clock):
        self.store = store
        self.clock = clock
        self.order: list[str] = []
        self.position: dict[str, int] = {}
        self.manifests: dict[str, bytes | None] = {}
        self.sizes: dict[str, int] = {}
        self.finished: set[str] = set()
        self.leases: dict[str, Sighting] = {}

    def scan_tasks(self) -> int:
        """List tasks/; returns how many ids are new."""
        before = len(self.order)
        for entry in self.store.list(layout.TASKS):
            task_id = layout.id_from_object(entry.name, layout.TASKS)
            if task_id is None or task_id in self.sizes:
                continue
            copy = entry.metadata.get("manifest")
            self.manifests[task_id] = copy.encode() if copy is not None else None
            self.sizes[task_id] = entry.size
        self.order = sorted(self.sizes)
        self.position = {task_id: i for i, task_id in enumerate(self.order)}
        return len(self.order) - before

    def scan_finished(self) -> None:
        for prefix in (layout.DONE, layout.FAILED):
            for entry in self.store.list(prefix):
                task_id = layout.id_from_object(entry.name, prefix)
                if task_id is not None:
                    self.finished.add(task_id)

    def scan_leases(self) -> None:
        now = self.clock.monotonic()
        sightings: dict[str, Sighting] = {}
        for entry in self.store.list(layout.LEASES):
            task_id = layout.id_from_object(entry.name, layout.LEASES)
            if task_id is None:
                continue
            state = entry.metadata.get("state", HELD)
            if state == DEAD:
                self.finished.add(task_id)
                continue
            seen = self.leases.get(task_id)
            first_seen = seen.first_seen if seen and seen.generation == entry.generation else now
            sightings[task_id] = Sighting(
                entry.generation, state, entry.metadata.get("worker", "?"), _float(entry.metadata.get("ttl_s")), first_seen
            )
        self.leases = sightings

    def relist_done_from(self, task_id: str, page_size: int) -> None:
        """One listing of done/ from `task_id` on, learning the next `page_size` done markers."""
        page = self.store.list_page(layout.DONE, start_offset=layout.done_object(task_id), page_size=page_size)
        for entry in page.entries:
            done_id = layout.id_from_object(entry.name, layout.DONE)
            if done_id is not None:
                self.finished.add(done_id)

    def live(self, task_id: str) -> bool:
        """Held by someone and not yet seen unchanged for a whole TTL."""
        sighting = self.leases.get(task_id)
        if sighting is None or sighting.state != HELD:
            return False
        return self.clock.monotonic() - sighting.first_seen < sighting.ttl_s

    def pending(self) -> list[str]:
        return [t for t in self.order if t not in self.finished]


def _float(text: str | None) -> float:
    try:
        return float(text) if text is not None else float("inf")
    except ValueError:
        return float("inf")


class Claimer:
    """`for claim in Claimer(store, options): ...` yields claimed tasks until the queue is empty.

    After each yielded claim the caller must finish with its lease (complete, release, dead
    letter, or lose it) before asking for the next one.
    """

    def __init__(self, store: ObjectStore, options: ClaimOptions, clock: Clock | None = None):
        self.store = store
        self.options = options
        self.clock = clock or Clock()
        self.view = QueueView(store, self.clock)
        self.rng = random.Random(options.seed)
        self.stop_event = threading.Event()
        self.exit_reason = "running"
        self._cursor: int | None = None
        self._mine: set[str] = set()  # tasks this worker finished or dead-lettered itself

    def stop(self) -> None:
        self.stop_event.set()

    # -- the loop ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Claim]:
        self._retrying(self._full_scan)
        idle_since: float | None = None
        backoff = self.options.poll_min_s
        while not self.stop_event.is_set():
            claim = self._retrying(self._try_claim)
            if isinstance(claim, Claim):
                idle_since, backoff = None, self.options.poll_min_s
                yield claim
                self._learn_outcome(claim.lease)
                continue
            if claim is False:  # the view changed (a collision, finished work ahead): go round again at once
                continue
            if not self.view.pending():
                if self._retrying(self.view.scan_tasks) == 0:
                    self.exit_reason = "drained"
                    log.info("event=queue_drained tasks=%d", len(self.view.order))
                    return
                continue
            now = self.clock.monotonic()
            idle_since = idle_since if idle_since is not None else now
            if now - idle_since >= self.options.idle_timeout_s:
                self.exit_reason = "idle"
                log.info("event=idle_timeout waited_s=%.1f pending=%d", now - idle_since, len(self.view.pending()))
                return
            # Everything left is leased by someone else: wait for it to finish or expire.
            self.stop_event.wait(self.rng.uniform(0, backoff))
            backoff = min(backoff * 2, self.options.poll_max_s)
            self._retrying(self._poll)
        self.exit_reason = "stopped"

    def _retrying(self, step):
        """Storage outages must not kill the worker: back off and try again until stopped."""
        delay = self.options.poll_min_s
        while True:
            try:
                return step()
            except StoreUnavailable as exc:
                log.warning("event=store_unavailable step=%s error=%s retry_in_s=%.1f", step.__name__, exc, delay)
                if self.stop_event.wait(self.rng.uniform(0, delay)):
                    return None
                delay = min(delay * 2, self.options.poll_max_s)

    def _full_scan(self) -> None:
        self.view.scan_tasks()
        self.view.scan_finished()
        self.view.scan_leases()
        if self.view.finished or self.view.leases:
            self._jump()  # a late joiner: start as far from everyone as the view allows
        elif self.view.order:
            self._cursor = self.rng.randrange(len(self.view.order))  # workers starting together spread out
        log.info(
            "event=scan tasks=%d finished=%d leases=%d",
            len(self.view.order),
            len(self.view.finished),
            len(self.view.leases),
        )

    def _poll(self) -> None:
        pending = self.view.pending()
        self._relist(pending[0] if pending else None)

    def _relist(self, task_id: str | None) -> None:
        """Fresh leases, and the done markers from `task_id` on: after evidence that the view is stale."""
        self.view.scan_leases()
        if task_id is not None:
            self.view.relist_done_from(task_id, page_size=RELIST_PAGE)

    # -- one claim --------------------------------------------------------------------------

    def _next_candidate(self) -> str | None:
        """The next claimable task on the ring. Reaching a stretch someone else finished means a
        worker walks just ahead of us: following it would only collide, so jump instead."""
        order = self.view.order
        if not order:
            return None
        if self._cursor is None:
            self._cursor = self.rng.randrange(len(order))
        for attempt in range(2):
            for step in range(len(order)):
                task_id = order[(self._cursor + step) % len(order)]
                if task_id in self.view.finished or self.view.live(task_id):
                    continue
                if attempt == 0 and step and self._others_between(step):
                    self._jump()
                    break
                self._cursor = (self._cursor + step) % len(order)
                return task_id
        return None

    def _others_between(self, step: int) -> bool:
        order = self.view.order
        return any(order[(self._cursor + k) % len(order)] not in self._mine for k in range(step))

    def _try_claim(self) -> Claim | None | bool:
        """A claim; None when nothing is claimable; False when the view changed and it is worth going again."""
        task_id = self._next_candidate()
        if task_id is None:
            return None
        lease = self._acquire(task_id)
        if lease is None:  # someone is at this very task, and will walk on ahead of us: go elsewhere
            self.view.scan_leases()
            self._jump()
            return False
        if self._already_done(task_id):
            # A finished task has no lease, so our view was stale here: give the lease back and move.
            lease.abandon()
            self.view.scan_leases()
            self._jump()
            return False
        self._cursor = (self.view.position[task_id] + 1) % len(self.view.order)
        return self._with_manifest(task_id, lease)

    def _already_done(self, task_id: str) -> bool:
        """Checked while holding the lease, so nobody can finish the task between this check and our run.

        One listing of done/ from the task on answers exactly for this task (listings are strongly
        consistent) and also shows the done markers just ahead, so the walk sees another worker's
        finished stretch before reaching it.
        """
        page = self.store.list_page(layout.DONE, start_offset=layout.done_object(task_id), page_size=LOOKAHEAD)
        found = False
        for entry in page.entries:
            done_id = layout.id_from_object(entry.name, layout.DONE)
            if done_id is not None:
                self.view.finished.add(done_id)
                found = found or done_id == task_id
        return found

    def _learn_outcome(self, lease: HeldLease) -> None:
        """What this worker did with a claim is news its view can use without a listing."""
        state = lease.body["state"]
        if lease.lost:
            self.view.leases.pop(lease.task_id, None)
        elif state == RELEASED:
            self.view.leases[lease.task_id] = Sighting(
                lease.generation, RELEASED, self.options.worker, float(lease.body["ttl_s"]), self.clock.monotonic()
            )
        else:  # completed (lease deleted) or dead-lettered
            self.view.finished.add(lease.task_id)
            self._mine.add(lease.task_id)
            self.view.leases.pop(lease.task_id, None)

    def _acquire(self, task_id: str) -> HeldLease | None:
        """Create, take over or steal the lease; None when someone else won."""
        sighting = self.view.leases.get(task_id)
        name = layout.lease_object(task_id)
        if sighting is None:
            body = new_lease_body(task_id, self.options.worker, self.options.lease_ttl_s, self.clock)
            data, metadata = encode(body)
            try:
                generation = self.store.create(name, data, metadata=metadata)
            except PreconditionFailed:
                log.debug("event=claim_collision task=%s", task_id)
                return None
            log.info("event=claimed task=%s token=%d attempt=%d", task_id, generation, body["attempt"])
            return HeldLease(self.store, body, generation, self.clock)
        # Released, or expired by observation: read it, then rewrite at the generation we saw.
        try:
            current = self.store.read(name)
        except NotFound:
            self.view.leases.pop(task_id, None)
            return None
        if current.generation != sighting.generation:
            self.view.leases[task_id] = dataclasses.replace(
                sighting, generation=current.generation, first_seen=self.clock.monotonic()
            )
            return None
        previous = json.loads(current.data)
        if previous.get("state") == DEAD:
            self.view.finished.add(task_id)
            return None
        body = new_lease_body(task_id, self.options.worker, self.options.lease_ttl_s, self.clock, previous)
        data, metadata = encode(body)
        try:
            generation = self.store.write(name, data, if_generation=sighting.generation, metadata=metadata)
        except PreconditionFailed:
            return None
        how = "takeover" if previous.get("state") == RELEASED else "steal"
        log.info(
            "event=%s task=%s token=%d attempt=%d previous_worker=%s committed=%d",
            how,
            task_id,
            generation,
            body["attempt"],
            previous.get("worker"),
            len(body["progress"]),
        )
        return HeldLease(self.store, body, generation, self.clock)

    def _jump(self) -> None:
        """Land in the middle of the longest run of pending tasks, the spot farthest from every worker.

        Workers walk forward from the end of their trail of done markers, and hold a lease only
        while a task runs, so runs of pending tasks (not gaps between leases) show where nobody
        is. The view is stale away from where this worker has been, so the chosen run is re-listed
        first, and the landing is the middle of what is still pending in it.
        """
        order = self.view.order
        for _ in range(JUMP_TRIES):
            run = self._longest_pending_run()
            if run is None:
                return
            start, length = run
            self.view.relist_done_from(order[start], page_size=RELIST_PAGE)
            best_start, best_length, run_start = start, 0, None
            for k in range(length):
                position = (start + k) % len(order)
                if self._claimable(order[position]):
                    run_start = position if run_start is None else run_start
                    run_length = (position - run_start) % len(order) + 1
                    if run_length > best_length:
                        best_start, best_length = run_start, run_length
                else:
                    run_start = None
            self._cursor = (best_start + best_length // 2) % len(order)
            if best_length * 2 >= length:  # still mostly pending on fresh data: land here
                return

    def _claimable(self, task_id: str) -> bool:
        return task_id not in self.view.finished and not self.view.live(task_id)

    def _longest_pending_run(self) -> tuple[int, int] | None:
        """(start position, length) of the longest run of consecutive claimable tasks, around the ring."""
        order = self.view.order
        n = len(order)
        claimable = [self._claimable(t) for t in order]
        if not any(claimable):
            return None
        if all(claimable):
            return (self._cursor or 0, n)
        first_blocked = claimable.index(False)
        best, run_start, run_length = (0, 0), None, 0
        for k in range(1, n + 1):
            position = (first_blocked + k) % n
            if claimable[position]:
                if run_start is None:
                    run_start, run_length = position, 0
                run_length += 1
                if run_length > best[1]:
                    best = (run_start, run_length)
            else:
                run_start = None
        return best

    def _with_manifest(self, task_id: str, lease: HeldLease) -> Claim:
        where = self.store.url(layout.task_object(task_id))
        try:
            if self.view.sizes.get(task_id, 0) > layout.MAX_MANIFEST_BYTES:
                raise layout.BadManifest(
                    f"{where}: manifest is {self.view.sizes[task_id]} bytes, over the "
                    f"{layout.MAX_MANIFEST_BYTES}-byte limit"
                )
            data = self.view.manifests.get(task_id)
            if data is None:
                data = self.store.read(layout.task_object(task_id)).data
            return Claim(task_id, lease, layout.parse_manifest(data, task_id, where))
        except layout.BadManifest as exc:
            return Claim(task_id, lease, None, problem=str(exc))
        except NotFound:
            return Claim(task_id, lease, None, problem=f"{where}: manifest object is missing")
        except StoreError:
            # Could not read it now: give the task back rather than guessing.
            lease.release()
            raise

"""The claim policy: where a worker walks, what it claims, when it waits and when it leaves (docs/PROTOCOL.md, "Claim").

`Claimer` is an iterator of claimed tasks. It keeps a `QueueView` (taskqueue/view.py) of the region
map and the regions it loaded, and claims in one region at a time, so its first claim costs the same
at a thousand tasks or a million. It learns other regions only when it moves to them, and sweeps a
region once every task in it is finished (taskqueue/sweep.py), so that the last workers find what is
left, and know when nothing is, without listing the whole queue. Every state change is decided by a
conditional write.
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
from taskqueue.lease import DEAD, DONE, FINISHED, HELD, RELEASED, HeldLease, encode, new_lease_body, sum_metadata_counters
from taskqueue.sweep import Sweeper
from taskqueue.view import MAX_LOADED_REGIONS, QueueView, Sighting

log = logging.getLogger(__name__)

LOOKAHEAD = 64  # done markers read ahead by a takeover's done check
JUMP_TRIES = 2  # regions a move loads before giving up and waiting: at the end of a queue every load finds nothing
EXPLORE = 0.25  # a waiting worker's polls that look at a region it is not watching (two requests, not one)
MIN_RUN = 16  # after a collision, a run of work shorter than this in the same region is not worth staying for


POLL_CAP_S = 60.0
# A worker that found nothing to claim waits at least this share of its longest wait before its
# first poll: the work left is held by others, and freeing it takes a heartbeat's time or a task's,
# not a second; polling sooner mostly re-reads the same leases (docs/PROTOCOL.md, "Claim", step 8).
FIRST_WAIT = 0.125


def default_poll_max(poll_min_s: float, lease_ttl_s: float) -> float:
    """The longest wait between polls of a worker with nothing to claim: half the TTL (a worker
    watching a region sees a lease expire within 1.5 TTL), at most a minute. At the end of a queue
    most of the fleet waits, so with W workers waiting somebody polls every minute / W even so,
    and a released task is taken over within seconds; the long waits are what keeps a thousand
    waiting workers cheap (docs/PROTOCOL.md, "Cost")."""
    return max(poll_min_s, min(POLL_CAP_S, lease_ttl_s / 2))


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
    #: Regions whose task lists the view keeps; the least recently loaded is forgotten first.
    max_loaded_regions: int = MAX_LOADED_REGIONS


def _release_quietly(lease: HeldLease) -> None:
    try:
        lease.release()
    except Exception:  # noqa: BLE001 - best effort: otherwise the lease expires after its TTL
        log.warning("event=release_failed task=%s", lease.task_id)


class Claimer:
    """`for claim in Claimer(store, options): ...` yields claimed tasks until the queue is empty.

    After each yielded claim the caller must finish with its lease (complete, release, dead
    letter, or lose it) before asking for the next one. The iterator ends with `exit_reason`
    `drained` only when every region of the queue is swept, i.e. every task has a done or failed
    marker; `idle` when the rest stayed leased by others for `idle_timeout_s`; `stopped` after `stop()`.
    """

    def __init__(self, store: ObjectStore, options: ClaimOptions, clock: Clock | None = None):
        self.store = store
        self.options = options
        self.clock = clock or Clock()
        self.view = QueueView(store, self.clock, options.max_loaded_regions)
        self.rng = random.Random(options.seed)
        self.stop_event = threading.Event()
        self.sweeper = Sweeper(store, self.view, self.clock, options.worker, self.stop_event)
        self.exit_reason = "running"
        self._region: str | None = None  # where the walk is: a loaded region and a position in it
        self._index = 0
        self._mine: set[str] = set()  # tasks this worker finished or dead-lettered itself
        # A move found nothing: until the next claim only polls (one region each) look further, and a
        # failed claim does not set off another move (at the end of a queue that is most requests).
        self._waiting = False

    def stop(self) -> None:
        self.stop_event.set()

    # -- the loop ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Claim]:
        self._retrying(self._start)
        idle_since: float | None = None
        first_wait = max(self.options.poll_min_s, self.options.poll_max_s * FIRST_WAIT)
        backoff = first_wait
        while not self.stop_event.is_set():
            claim = self._retrying(self._try_claim)
            if isinstance(claim, Claim):
                idle_since, backoff, self._waiting = None, first_wait, False
                yield claim
                self._learn_outcome(claim.lease)
                continue
            if claim is False:  # the view changed (a collision, finished work ahead): go round again at once
                continue
            if not self._waiting and self._retrying(self._move):
                continue
            if self._retrying(self._drained):
                self.exit_reason = "drained"
                log.info("event=queue_drained regions=%d", len(self.view.splits))
                return
            now = self.clock.monotonic()
            idle_since = idle_since if idle_since is not None else now
            if now - idle_since >= self.options.idle_timeout_s and self._may_leave_idle():
                if self._retrying(self._last_look):
                    idle_since = None  # something to claim after all: go round again
                    continue
                if self._may_leave_idle():  # unless the last look found a lease to judge first
                    self.exit_reason = "idle"
                    log.info("event=idle_timeout waited_s=%.1f open_regions=%d", now - idle_since, len(self.view.open_regions()))
                    return
            # Everything left within reach is leased by someone else: wait for it to finish or expire.
            # Jitter over the upper half only: waiting workers spread out without polling twice as often.
            self.clock.wait(self.stop_event, self.rng.uniform(backoff / 2, backoff))
            backoff = min(backoff * 2, self.options.poll_max_s)
            self._retrying(self._poll)  # where it lands, the next turn of the loop claims
        self.exit_reason = "stopped"

    def _retrying(self, step):
        """Storage outages must not kill the worker: back off and try again until stopped."""
        delay = self.options.poll_min_s
        while True:
            try:
                return step()
            except StoreUnavailable as exc:
                log.warning("event=store_unavailable step=%s error=%s retry_in_s=%.1f", step.__name__, exc, delay)
                if self.clock.wait(self.stop_event, self.rng.uniform(0, delay)):
                    return None
                delay = min(delay * 2, self.options.poll_max_s)

    def _start(self) -> None:
        self.view.scan_map()
        self._move(first=True)
        log.info(
            "event=start regions=%d swept=%d map_complete=%s region=%r",
            len(self.view.splits),
            len(self.view.swept),
            self.view.map_complete,
            self._region,
        )

    def _drained(self) -> bool:
        """Every region swept, confirmed on a fresh listing of the map (free while the view knows an open region)."""
        if self.view.open_regions():
            return False
        # batches/ before and after the map: a batch that finished (or began) in between may have
        # added tasks the map's listings did not account for (docs/PROTOCOL.md, "Batches").
        self.view.scan_batches()
        before, pruned, newest = dict(self.view.batches or {}), self.view.pruned, self.view.newest
        self.view.scan_map()
        while not self.view.map_complete and not self.view.open_regions():
            self.view.extend_map()
        # The same markers at the same generations, and none that began after the first listing and was
        # deleted before the second (layout.PRUNED tells): such a batch would leave no other trace.
        return (self.view.all_swept() and self.view.batches == before
                and not layout.batch_unseen_between(pruned, self.view.pruned, newest))  # fmt: skip

    def _may_leave_idle(self) -> bool:
        """Not while a lease in view may be a dead holder's: every lease of an open region must
        have been seen renewing, or watched unchanged for its whole TTL from the moment this
        worker first saw it (then it is claimable, and the last look or a poll takes it over).
        Until then the worker polls on. The watch runs from the first sighting, not from when the
        worker became idle: a lease first seen in the last look is watched for a whole TTL too,
        so the last waiting worker never leaves beside a lease that nobody will judge (sim seed
        71606). How long this defers the exit: at most one TTL after the last lease first seen."""
        unjudged = self.view.unjudged()
        if unjudged:
            log.debug("event=idle_deferred unjudged=%d first=%s", len(unjudged), unjudged[0])
            return False
        return True

    def _last_look(self) -> bool:
        """Before leaving `idle`: batches/, then every open region of the whole map afresh, its tasks
        and its leases (two requests each). True when there is news or a region with a task to claim.
        Polls look at one region at a time, so a worker could otherwise leave with a released or
        unclaimed task in a region it never polled; and its cached task lists may miss a batch that came
        and went unseen (a worker whose clock stopped while its VM was suspended does not know how long
        it has been since it last listed `batches/`)."""
        if self._news():
            return True
        self.view.whole_map()
        for region in self.view.open_regions():
            self._visit(region, afresh=True)
            if self._land(region, first=False):
                self._waiting = False
                return True
        return False

    def _poll(self) -> None:
        """While waiting: the swept markers, and one open region afresh; the walk goes on there if it has work.

        One region per poll keeps a thousand waiting workers cheap. Mostly it is one the worker
        watches (loaded already: one listing of its leases), the one it looked at longest ago, so it
        sees each lease again within a few polls and can tell an expired one (unchanged for a TTL)
        from a live one; one poll in four loads a region it does not watch, so that between them
        the waiting workers watch every open region, however few they are.
        """
        # batches/ on every poll: a batch submitted or finished since is news, found within one poll
        # (docs/PROTOCOL.md, "Batches").
        if self._news():
            return
        self.view.freshen_swept()
        regions = self.view.open_regions()
        if not regions:
            return
        unseen = [r for r in regions if r not in self.view.loaded]
        watched = [r for r in regions if r in self.view.loaded]
        if unseen and (not watched or self.rng.random() < EXPLORE):
            region = self.rng.choice(unseen)
        else:
            region = min(watched, key=lambda r: self.view.loaded[r])
        self._visit(region)
        self._land(region, first=False)

    def _news(self) -> bool:
        """`batches/`; True when there is news, whoever listed it first (a drained check, a last look,
        a poll): the map is listed again, since a batch may have cut new regions and un-swept old ones,
        and the walk stops waiting, so that its next turn moves to the regions the news names first.
        News is kept until a region it names is visited, or until the fresh map shows it closed: a view
        whose swept markers are older than the batch's un-sweep must not drop it (sim seed 50001577)."""
        changed = self.view.scan_batches()
        if not changed and not self.view.news:
            return False
        self.view.scan_map(with_batches=False)
        self.view.news &= set(self.view.open_regions())
        self._waiting = False
        return True

    def _visit(self, region: str, afresh: bool = False) -> None:
        """Read a region afresh, and sweep it if every task in it is finished: its leases when its task
        list is known already (one request), else (or `afresh`) its tasks and leases (two). A region
        under a batch still running is read whole: its batch may have added tasks since its last listing."""
        if region in self.view.tasks and not afresh and not self.view.under_running_batch(region):
            self.view.refresh(region)
        else:
            self.view.load(region)
        if self.view.region_finished(region):
            self.sweeper.sweep(region)

    # -- moving between regions -------------------------------------------------------------

    def _move(self, first: bool = False) -> bool:
        """Go to a region with claimable tasks: True when the walk has a new place to start.

        Regions a batch brought news of come first, every one of them (a late task is claimed within a
        poll of its batch's `done`, however many regions the batch's range meets; each waiting worker
        visits each once in any case, so doing it at once costs nothing more). Then regions this worker
        has not loaded, in random order: nobody's trail is known there, and workers that start together
        spread out over the map; a region loaded before needs only its leases re-listed. A region
        found finished is swept on the way. When JUMP_TRIES of those have nothing claimable the worker
        is waiting: until its next claim, polls look further, one region each, and collisions and
        trails do not start moves.
        """
        view = self.view
        if self._waiting:
            return False  # polls look further, one region at a time
        view.freshen_map()
        left = self._region
        if left is not None and left in view.tasks and view.region_finished(left):
            # The walk leaves a region it knows finished (its last tasks were this worker's): sweep it
            # now. Otherwise only a poll or the last look would, after waits: a lone worker that ran the
            # whole queue would wait out its idle timeout and leave `idle`, not `drained`.
            self.sweeper.sweep(left)
        tries = 0
        while True:
            news = [r for r in view.open_regions() if r in view.news]
            fresh = [r for r in view.open_regions() if r not in view.tasks and r not in view.news]
            known = [r for r in view.open_regions() if r in view.tasks and r != self._region and self._has_claimable(r)]
            for regions in (news, fresh, known):
                self.rng.shuffle(regions)
            here = [self._region] if self._region is not None and self._region in view.tasks else []
            for region in news + fresh + known + here:
                if region not in view.news:
                    if tries >= JUMP_TRIES:
                        break
                    tries += 1
                view.news.discard(region)
                self._visit(region)
                if self._land(region, first):
                    return True
            if tries >= JUMP_TRIES or not view.extend_map():
                # Waiting: polls and the last look pick from every open region, so they must know them all.
                self._waiting = True
                view.whole_map()
                return False

    def _has_claimable(self, region: str) -> bool:
        return any(self.view.claimable(t) for t in self.view.tasks.get(region, ()))

    def _land(self, region: str | None, first: bool, at_least: int = 1) -> bool:
        """Start the walk in the middle of the region's longest run of claimable tasks, the spot
        farthest from every worker there (workers walk forward from the end of their trail of done
        markers). In a region nobody has touched, a random spot instead: workers that start
        together in it spread out."""
        if region is None:
            return False
        ids = self.view.tasks.get(region, [])
        claimable = [self.view.claimable(t) for t in ids]
        if not any(claimable):
            return False
        untouched = all(claimable) and not any(t in self.view.leases for t in ids)
        if first and untouched:
            self._region, self._index = region, self.rng.randrange(len(ids))
            return True
        best_start, best_length, run_start = 0, 0, None
        for k, ok in enumerate(claimable):
            if ok:
                run_start = k if run_start is None else run_start
                if k - run_start + 1 > best_length:
                    best_start, best_length = run_start, k - run_start + 1
            else:
                run_start = None
        if best_length < at_least:
            return False
        # Around the middle, not on it: workers that collided at the same task must not all land together again.
        middle = best_start + best_length // 2
        spread = best_length // 4
        self._region, self._index = region, middle + self.rng.randint(-spread, spread)
        return True

    # -- one claim --------------------------------------------------------------------------

    def _next_candidate(self, may_move: bool = True) -> str | None:
        """The next claimable task forward in the current region. Reaching a stretch someone else
        finished or holds means a worker walks just ahead of us: following it would only collide,
        so move to another region if there is one with work."""
        region = self._region
        if region is None or region not in self.view.tasks:
            return None
        ids = self.view.tasks[region]
        for step in range(self._index, len(ids)):
            task_id = ids[step]
            if not self.view.claimable(task_id):
                continue
            if may_move and step > self._index and any(ids[k] not in self._mine for k in range(self._index, step)):
                # Re-read this region's leases first (one request): with a long enough run of work left,
                # the middle of it is the cheapest place to go. The view changed either way: look again.
                self.view.refresh(region)
                if not self._land(region, first=False, at_least=MIN_RUN):
                    self._move()
                return self._next_candidate(may_move=False)
            self._index = step
            return task_id
        return None

    def _try_claim(self) -> Claim | None | bool:
        """A claim; None when nothing is claimable where the walk is; False when the view changed and it is worth going again."""
        task_id = self._next_candidate()
        if task_id is None:
            return None
        lease = self._acquire(task_id)
        if lease is None:
            # Someone holds or finished this very task: our view of the region is stale. Re-read its
            # leases (one request) and go where nobody is, the middle of its longest run of work.
            if self._region is not None and self._region in self.view.tasks:
                self.view.refresh(self._region)
            if not self._land(self._region, first=False, at_least=MIN_RUN):
                self._move()
            return False
        if self._region is not None and self._index < len(self.view.tasks.get(self._region, [])):
            self._index += 1
        return self._with_manifest(task_id, lease)

    def _finished_already(self, task_id: str) -> tuple[str, dict | None] | None:
        """For a lease taken over: is the task done or dead-lettered already? `(state, counters)` or None.

        Under this protocol the answer is always None: the tombstone is written first and its marker
        copied from it afterwards (docs/PROTOCOL.md, "Completion"), so a lease that is not a tombstone
        has no marker, and a lease created from nothing needs no check at all. The check is for
        queues whose leases an older version wrote, which wrote the marker first and the tombstone
        after: one of its holders may have died between the two, leaving a marker beside a live
        lease. Checked while holding the lease, so nobody can finish the task between this check and
        our run: a finished task is never run again. The done/ listing from the task on answers
        exactly for it (listings are strongly consistent) and shows the done markers just ahead too.
        Costs 2 listings per takeover (docs/PROTOCOL.md, "Claim" step 6); it can go once no queue
        of the older version is left.
        """
        page = self.store.list_page(layout.DONE, start_offset=layout.done_object(task_id), page_size=LOOKAHEAD)
        for entry in page.entries:
            done_id = layout.id_from_object(entry.name, layout.DONE)
            if done_id is not None:
                self.view.finished.add(done_id)
                if done_id == task_id:
                    text = entry.metadata.get("counters")
                    return DONE, sum_metadata_counters([text]) if text else None
        page = self.store.list_page(layout.FAILED, start_offset=layout.failed_object(task_id), page_size=1)
        if any(entry.name == layout.failed_object(task_id) for entry in page.entries):
            return DEAD, None
        return None

    def _learn_outcome(self, lease: HeldLease) -> None:
        """What this worker did with a claim is news its view can use without a listing."""
        state = lease.body["state"]  # the state of our last write that was confirmed
        if lease.lost:
            self.view.leases.pop(lease.task_id, None)
        elif state in FINISHED:  # the tombstone's write was confirmed: the task is finished for good
            self.view.finished.add(lease.task_id)
            self._mine.add(lease.task_id)
            self.view.leases.pop(lease.task_id, None)
        else:
            # Released, or still held: a write that failed (or whose answer never came) may or may not
            # have been applied. Only what we saw confirmed counts: the lease as our last confirmed
            # write left it, live until a TTL after we sent that write; a listing tells us more.
            self.view.leases[lease.task_id] = Sighting(
                lease.generation, state, self.options.worker, float(lease.body["ttl_s"]), lease.last_write
            )

    def _acquire(self, task_id: str) -> HeldLease | None:
        """Create, take over or steal the lease; None when someone else won."""
        if not self.view.claimable(task_id):
            return None  # never write a lease the view says is live or finished
        sighting = self.view.leases.get(task_id)
        name = layout.lease_object(task_id)
        if sighting is None:
            body = new_lease_body(task_id, self.options.worker, self.options.lease_ttl_s, self.clock)
            data, metadata = encode(body)
            sent = self.clock.monotonic()
            try:
                generation = self.store.create(name, data, metadata=metadata)
            except PreconditionFailed:
                log.debug("event=claim_collision task=%s", task_id)
                # Held by someone we have not seen yet: live until the next load of its region says more.
                self.view.leases[task_id] = Sighting(0, HELD, "?", float("inf"), self.clock.monotonic())
                return None
            log.info("event=claimed task=%s token=%d attempt=%d", task_id, generation, body["attempt"])
            return HeldLease(self.store, body, generation, self.clock, sent_at=sent)
        # Released, or expired by observation: read it, then rewrite at the generation we saw.
        try:
            current = self.store.read(name)
        except NotFound:
            self.view.leases.pop(task_id, None)
            return None
        if current.generation != sighting.generation:
            self.view.leases[task_id] = dataclasses.replace(
                sighting, generation=current.generation, first_seen=self.clock.monotonic(), renewed=False, last_seen=None
            )
            return None
        previous = json.loads(current.data)
        if previous.get("state") in FINISHED:
            self.view.finished.add(task_id)
            return None
        body = new_lease_body(task_id, self.options.worker, self.options.lease_ttl_s, self.clock, previous)
        data, metadata = encode(body)
        sent = self.clock.monotonic()
        try:
            generation = self.store.write(name, data, if_generation=sighting.generation, metadata=metadata)
        except PreconditionFailed:
            return None
        lease = HeldLease(self.store, body, generation, self.clock, sent_at=sent)
        try:
            finished = self._finished_already(task_id)
        except StoreError:
            _release_quietly(lease)  # unsure whether it is finished: give it back rather than guess
            raise
        if finished is not None:
            state, counters = finished
            log.info("event=tombstone task=%s state=%s previous_worker=%s", task_id, state, previous.get("worker"))
            lease.settle(state, counters)
            self.view.finished.add(task_id)
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
        return lease

    def _with_manifest(self, task_id: str, lease: HeldLease) -> Claim:
        where = self.store.url(layout.task_object(task_id))
        try:
            if self.view.sizes.get(task_id, 0) > layout.MAX_MANIFEST_BYTES:
                raise layout.BadManifest(
                    f"{where}: manifest is {self.view.sizes[task_id]} bytes, over the "
                    f"{layout.MAX_MANIFEST_BYTES}-byte limit"
                )
            copy = self.view.manifests.get(task_id)
            data = copy.encode() if copy is not None else None
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

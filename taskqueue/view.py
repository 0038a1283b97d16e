"""What one worker knows about the queue: the region map, the regions it loaded, and the lease sightings it judges by.

The queue is cut into regions of about a thousand tasks (`submit` writes a split marker at each
region's first id, docs/PROTOCOL.md, "Regions"). A `QueueView` lists the region map, loads one
region with two one-page listings (its tasks and its leases), and keeps at most a few regions: a
cache, fresh enough to keep claims cheap. Every state change is still decided by a conditional write
(`taskqueue.claims`), and the view decides nothing but what the listings say.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime as dt
import math
import sys

from objectstore import ObjectStore
from taskqueue import layout
from taskqueue.clock import Clock
from taskqueue.lease import FINISHED, HELD

MAP_REFRESH_S = 300.0  # the region map (splits/) is re-listed when older than this: splits change only on submit
SWEPT_REFRESH_S = 30.0  # swept/ is re-listed when older than this, so moves and polls skip finished regions
MAX_LOADED_REGIONS = 8  # the view is a cache: the least recently loaded region is forgotten first
MAX_SIGHTINGS = 100_000  # lease sightings kept for regions out of the cache (about 10 MB); the oldest go first


@dataclasses.dataclass
class Sighting:
    """A lease generation as first seen by this worker, on its own monotonic clock."""

    generation: int
    state: str
    worker: str
    ttl_s: float
    first_seen: float
    #: This worker saw the lease change generation between two listings less than a TTL apart: its
    #: holder wrote it within a TTL of this sighting. (A change seen across a longer gap says nothing
    #: of now: the holder may have written it long ago and died since.)
    renewed: bool = False
    #: When a listing last showed this generation (`first_seen` until one does again).
    last_seen: float | None = None

    def seen_until(self) -> float:
        return self.first_seen if self.last_seen is None else self.last_seen


def offset(prefix: str, task_id: str | None) -> str | None:
    """The listing offset of a region boundary; None for the head region's start or the keyspace's end."""
    return prefix + layout.key(task_id) if task_id else None


class QueueView:
    """What one worker knows about the queue: the region map, and the regions it has loaded."""

    def __init__(self, store: ObjectStore, clock: Clock, max_loaded_regions: int = MAX_LOADED_REGIONS):
        self.store = store
        self.clock = clock
        self.max_loaded_regions = max_loaded_regions
        self.splits: list[str] = [layout.HEAD]  # region starts, in key order
        self._split_keys: list[str] = [""]
        self.map_complete = False  # False: the last known split's region has no known end yet
        self._map_pages: float = 1  # pages of splits/ listed at each scan; infinite once the whole map is wanted
        self.map_at: float | None = None
        self.swept_at: float | None = None
        self.swept: dict[str, dict[str, str]] = {}  # region -> its confirmed swept marker's listing metadata
        self.tasks: dict[str, list[str]] = {}  # loaded region -> its task ids in key order
        self.loaded: dict[str, float] = {}  # loaded region -> when, least recent first
        # Cached task -> its manifest as the listing's metadata carried it (None: too big to ride along,
        # read at claim time), and the size of those read at claim time (over 64 KiB: a bad manifest).
        self.manifests: dict[str, str | None] = {}
        self.sizes: dict[str, int] = {}
        self.finished: set[str] = set()
        self.leases: dict[str, Sighting] = {}
        # Submit batches (docs/PROTOCOL.md, "Batches"): generation of each batch marker seen, the key
        # ranges of batches still running, and the regions a new or changed batch added tasks to.
        self.batches: dict[str, int] | None = None
        self.pruned: tuple[int, str | None] | None = None  # layout.PRUNED at the last listing (layout.pruned_mark)
        self.newest: dt.datetime | None = None  # the newest `updated` time in the last listing
        self._spans: dict[str, tuple[str, str]] = {}  # the key range of each batch still running at the last listing
        self.running: list[tuple[str, str]] = []  # the first and last ids of each batch still running
        self.news: set[str] = set()
        self._news_spans: list[tuple[str, str]] = []  # the last batches/ listing's news, as key ranges

    # -- the region map ---------------------------------------------------------------------

    def scan_map(self, with_batches: bool = True) -> None:
        """The split markers (one page per thousand regions: only as many pages as needed so far, or
        all of them once `whole_map` was called), the swept markers of those regions, then the batches.

        Batches come last: a worker that finds every region swept and then no batch running knows
        that every task submitted before that last listing is finished (docs/PROTOCOL.md, "Batches")."""
        splits, token, pages = [], None, 0
        while pages < self._map_pages:
            page = self.store.list_page(layout.SPLITS, page_token=token)
            pages += 1
            splits += [t for t in (layout.id_from_object(e.name, layout.SPLITS) for e in page.entries) if t]
            token = page.next_token
            if not token:
                break
        self.map_complete = token is None
        ends = {region: self.region_end(region) for region in self.tasks}
        self.splits = [layout.HEAD] + splits  # listings come in key order
        self._split_keys = [""] + [layout.key(t) for t in splits]
        for region, end in ends.items():
            if self.region_end(region) != end:
                self.forget(region, keep_sightings=True)  # `submit` cut it: its cached task list runs past its new end
        # The batch that brought news may have cut new regions out of the one it seemed to touch.
        self._mark_news(self._news_spans)
        self.scan_swept()
        self.map_at = self.clock.monotonic()
        if with_batches:
            self.scan_batches()

    def scan_batches(self) -> bool:
        """The batch markers (one request per thousand batches). True when one is new or changed
        since the last listing (the first listing is the baseline), or was running then and is gone
        now (deleted once done): its regions are news. Their task lists are forgotten, so the next
        visit lists them again and finds the tasks the batch added; a region under a batch still
        running has its tasks listed again at every visit (`Claimer._visit`), since its batch may
        add more. When a batch may have begun and been deleted since the last listing, unseen
        (`layout.batch_unseen_between`: a worker busy on a long task while submits came and went),
        every cached task list is forgotten instead: no news would name its regions."""
        seen: dict[str, int] = {}
        running, spans, running_spans = [], [], {}
        pruned, newest = None, None
        for entry in self.store.list(layout.BATCHES):
            newest = entry.updated if newest is None or entry.updated > newest else newest
            if entry.name == layout.PRUNED:
                pruned = layout.pruned_mark(entry)  # not news by itself: it says some done markers went
                continue
            first, last = entry.metadata.get("first"), entry.metadata.get("last")
            if not first or not last:
                continue
            seen[entry.name] = entry.generation
            span = (layout.key(first), layout.key(last))
            if entry.metadata.get("state") != layout.BATCH_DONE:
                running.append((first, last))
                running_spans[entry.name] = span
            if self.batches is not None and self.batches.get(entry.name) != entry.generation:
                spans.append(span)  # news once, when it starts or ends: a batch whose submitter died
                # stays running, and news on every poll would keep the worker on its regions alone
        gone = [span for name, span in self._spans.items() if name not in seen]  # finished, then deleted
        changed = self.batches is not None and (any(self.batches.get(n) != g for n, g in seen.items()) or bool(gone))
        if self.batches is not None and layout.batch_unseen_between(self.pruned, pruned, self.newest):
            changed = True
            for region in list(self.tasks):
                self.forget(region, keep_sightings=True)
        self.batches, self.running, self._news_spans = seen, running, spans + gone
        self.pruned, self.newest, self._spans = pruned, newest, running_spans
        self._mark_news(spans + gone)
        return changed

    def _mark_news(self, spans: list[tuple[str, str]]) -> None:
        for region in self.splits:
            if region not in self.news and any(self.overlaps(region, span) for span in spans):
                self.news.add(region)
                if region in self.tasks:
                    self.forget(region, keep_sightings=True)

    def overlaps(self, region: str, span: tuple[str, str]) -> bool:
        """Whether a region's key range meets a batch's [first, last]."""
        end = self.region_end(region)
        return (layout.key(region) if region else "") <= span[1] and (end is None or span[0] < layout.key(end))

    def freshen_map(self) -> None:
        """Re-list what is old: the splits every MAP_REFRESH_S (they change only when tasks are
        submitted), the swept markers every SWEPT_REFRESH_S. A region swept since is still found
        finished where the worker looks, and swept by it (or learnt from the marker's 412)."""
        if self.map_at is None or self.clock.monotonic() - self.map_at > MAP_REFRESH_S:
            self.scan_map()
        else:
            self.freshen_swept()

    def freshen_swept(self) -> None:
        """Re-list the swept markers when they are older than SWEPT_REFRESH_S."""
        if self.swept_at is None or self.clock.monotonic() - self.swept_at > SWEPT_REFRESH_S:
            self.scan_swept()

    def scan_swept(self) -> None:
        """The swept markers of the regions in the map: one request per thousand regions."""
        end = None if self.map_complete else layout.swept_object(self.splits[-1])
        swept = {}
        for entry in self.store.list(layout.SWEPT, end_offset=end):
            region = layout.region_from_swept(entry.name)
            # Only a confirmed marker counts: a sweeper's second task listing may still withdraw a new one.
            if region is not None and entry.metadata.get("confirmed"):
                swept[region] = dict(entry.metadata)
        self.swept = swept
        self.swept_at = self.clock.monotonic()
        cached = {t for ids in self.tasks.values() for t in ids}
        for task_id in [t for t in self.leases if t not in cached and self.is_swept(self.region_of(t))]:
            del self.leases[task_id]  # a finished region's: nothing there to judge any more

    def extend_map(self) -> bool:
        """List one more page of splits; False when the map was already complete."""
        if self.map_complete:
            return False
        self._map_pages += 1
        self.scan_map()
        return True

    def whole_map(self) -> None:
        """From now on every scan lists every page of splits (and the swept markers of every region):
        a waiting worker's polls and last look must be able to reach every region, not only those of
        the pages a claim needed (past a thousand regions, the first page is not the whole queue).
        Costs ceil(R / 1000) - 1 more requests per scan of the map."""
        self._map_pages = math.inf
        if not self.map_complete:
            self.scan_map(with_batches=False)

    def region_end(self, region: str) -> str | None:
        """The next region's start; None at the end of the keyspace."""
        i = bisect.bisect_left(self._split_keys, layout.key(region) if region else "")
        return self.splits[i + 1] if i + 1 < len(self.splits) else None

    def known_regions(self) -> list[str]:
        """Regions whose both ends are known (the last split's region is open until the map is complete)."""
        return self.splits if self.map_complete else self.splits[:-1]

    def under_running_batch(self, region: str) -> bool:
        return any(self.overlaps(region, (layout.key(first), layout.key(last))) for first, last in self.running)

    def is_swept(self, region: str) -> bool:
        """The swept rule (`layout.swept`) on this view: a region a submit still adds tasks to is not,
        whatever its marker says, since its swept marker may be about to go."""
        return layout.swept(region, self.region_end(region), self.swept.get(region), self.running)

    def open_regions(self) -> list[str]:
        return [r for r in self.known_regions() if not self.is_swept(r)]

    def all_swept(self) -> bool:
        return self.map_complete and not self.open_regions()

    # -- regions ----------------------------------------------------------------------------

    def list_region_tasks(self, region: str) -> list[str]:
        """Task ids of a region, from one listing (more pages only for a region over a thousand tasks)."""
        end = self.region_end(region)
        ids = []
        for entry in self.store.list(
            layout.TASKS, start_offset=offset(layout.TASKS, region), end_offset=offset(layout.TASKS, end)
        ):
            task_id = layout.id_from_object(entry.name, layout.TASKS)
            if task_id is None:
                continue
            ids.append(task_id)
            if task_id not in self.manifests:
                copy = entry.metadata.get("manifest")
                self.manifests[task_id] = copy
                if copy is None:
                    self.sizes[task_id] = entry.size
        return ids

    def load(self, region: str) -> None:
        """Tasks and leases of one region: two requests for a region of up to a thousand."""
        self.refresh(region, self.list_region_tasks(region))

    def refresh(self, region: str, ids: list[str] | None = None) -> None:
        """Fresh leases of a region (one request); with `ids`, its task list too.

        The leases say everything a claim needs: a finished task's lease stays as its tombstone
        (`done` or `dead`, written after its done or failed marker), so done markers need no listing.
        """
        end = self.region_end(region)
        ids = ids if ids is not None else self.tasks.get(region, [])
        now = self.clock.monotonic()
        seen: dict[str, Sighting] = {}
        lease_name = layout.object_pattern(layout.LEASES).fullmatch  # a thousand entries a page: keep the loop lean
        for entry in self.store.list(
            layout.LEASES, start_offset=offset(layout.LEASES, region), end_offset=offset(layout.LEASES, end)
        ):
            match = lease_name(entry.name)
            if match is None:
                continue
            task_id = sys.intern(match.group(1))  # the same string as the task list's (layout.id_from_object)
            state = entry.metadata.get("state", HELD)
            if state in FINISHED:
                self.finished.add(task_id)
                continue
            old = self.leases.get(task_id)
            same = old is not None and old.generation == entry.generation
            seen[task_id] = Sighting(
                entry.generation,
                state,
                entry.metadata.get("worker", "?"),
                _float(entry.metadata.get("ttl_s")),
                old.first_seen if same else now,
                renewed=old.renewed if same else (
                    old is not None and old.generation > 0 and now - old.seen_until() < old.ttl_s
                ),
                last_seen=now,
            )  # fmt: skip
        here = set(ids)
        for task_id in [t for t in self.leases if t not in seen and t in here]:
            del self.leases[task_id]  # gone from the listing: finished, or never there
        self.leases.update(seen)
        self.tasks[region] = ids
        self.loaded.pop(region, None)
        self.loaded[region] = now
        while len(self.loaded) > self.max_loaded_regions:
            self.forget(next(iter(self.loaded)))

    def forget(self, region: str, keep_sightings: bool = False) -> None:
        """Drop a region's cached task list (the next visit lists it again). `keep_sightings` keeps
        what its leases looked like and since when: a region re-listed for news (a batch, a cut)
        must not restart the TTL-long watch that tells an expired lease from a live one (a batch
        whose submitter died stays running, and would otherwise restart it on every poll).

        Without it (the cache is full), the region's finished tasks are dropped, but not its lease
        sightings: a lease seen at one generation since `first_seen` is judged the same whenever the
        region comes back, and a worker must not leave `idle` beside a lease it has not judged
        (`unjudged`). Had the cache dropped them, a waiting worker with more open regions than it
        caches would see some lease for the first time at every look, and never leave. Sightings go
        when their region is swept (`scan_swept`), or past MAX_SIGHTINGS, the oldest first."""
        self.loaded.pop(region, None)
        for task_id in self.tasks.pop(region, []):
            self.manifests.pop(task_id, None)
            self.sizes.pop(task_id, None)
            if not keep_sightings:
                self.finished.discard(task_id)
        if len(self.leases) > MAX_SIGHTINGS:
            cached = {t for ids in self.tasks.values() for t in ids}
            for task_id in sorted((t for t in self.leases if t not in cached), key=lambda t: self.leases[t].first_seen):
                del self.leases[task_id]
                if len(self.leases) <= MAX_SIGHTINGS:
                    break

    def region_finished(self, region: str) -> bool:
        return all(t in self.finished for t in self.tasks.get(region, ()))

    # -- one task ---------------------------------------------------------------------------

    def live(self, task_id: str) -> bool:
        """Held by someone and not yet seen unchanged for a whole TTL."""
        sighting = self.leases.get(task_id)
        if sighting is None or sighting.state != HELD:
            return False
        return self.clock.monotonic() - sighting.first_seen < sighting.ttl_s

    def claimable(self, task_id: str) -> bool:
        return task_id not in self.finished and not self.live(task_id)

    def unjudged(self) -> list[str]:
        """Leases of open regions held by someone this worker has neither seen renew nor watched
        unchanged for a whole TTL since it first saw them: each may be a dead holder's, which only
        a TTL of watching tells. Regions whose task lists the cache dropped count too (`forget`)."""
        return sorted(
            t for t, s in self.leases.items()
            if not s.renewed and math.isfinite(s.ttl_s) and t not in self.finished and self.live(t)
            and not self.is_swept(self.region_of(t))
        )  # fmt: skip

    def region_of(self, task_id: str) -> str:
        return self.splits[bisect.bisect_right(self._split_keys, layout.key(task_id)) - 1]



def _float(text: str | None) -> float:
    try:
        return float(text) if text is not None else float("inf")
    except ValueError:
        return float("inf")


"""A store that behaves like GCS, on virtual time: `SimStore`, held to the store contract (tests/store).

It follows what GCS documents, and what the queue relies on:
- generations that only grow, create-if-absent, writes and deletes conditional on a generation;
- listings in name order with startOffset/endOffset, at most `page_limit` entries a page (GCS's
  ceiling is 1000, https://cloud.google.com/storage/docs/json_api/v1/objects/list; a smaller limit
  lets a world of tens of regions list its map in several pages, as a million-task queue does);
- custom metadata returned by listings; `updated`, which GCS also moves when it changes an object's
  metadata itself (a lifecycle rule changing the storage class,
  https://cloud.google.com/storage/docs/json_api/v1/objects#resource): `touch`;
- per-request latency (lognormal around `Limits.latency_s`, a listing also pays per item, and a share
  `Limits.slow_share` of requests is slow);
- one mutation per second per object name, faster ones get 429
  (https://cloud.google.com/storage/quotas#objects);
- a bucket that starts at about 1,000 object writes/s and 5,000 reads/s and doubles every 20 minutes
  (https://cloud.google.com/storage/docs/request-rate); requests beyond that get 429.

Requests go through the production retry loop and ambiguous-write rule (`objectstore.retry`, what
`objectstore.gcs` runs), on virtual time, and every attempt is counted. `Faults` decides what goes
wrong with each attempt: a 503, a response lost after the write was applied, a response that comes
late, a timeout after which the store still applies the write (later, on its own), a 403. A request
is applied at the end of its latency; a signal or a death that reaches the sending actor meanwhile
is raised once it is applied (the process never reads the answer).

Outside every actor (a world's set-up, or a plain test) it is an in-memory store with no latency.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import datetime as dt
import io
import pathlib
import random
import zlib
from collections.abc import Mapping

from google.api_core import exceptions as gexc

from objectstore.base import (
    MAX_LIST_PAGE,
    Blob,
    Entry,
    NotFound,
    ObjectStore,
    Page,
    PreconditionFailed,
    check_name,
)
from objectstore.gcs import is_transient
from objectstore.retry import Retrier, RetryPolicy, delete_with_retries, write_with_nonce
from tests.simworld.scheduler import EPOCH, Scheduler

MACHINES = "machines/"


@dataclasses.dataclass
class Limits:
    latency_s: float = 0.030  # median request latency
    per_item_s: float = 0.00002  # extra per listed object (a full page of 1000 adds 20 ms)
    initial_writes_per_s: float = 1000.0
    initial_reads_per_s: float = 5000.0
    doubling_s: float = 1200.0
    per_object_mutation_s: float = 1.0
    retry_initial_s: float = 0.1
    retry_cap_s: float = 8.0
    retry_deadline_s: float = 120.0
    timeout_s: float = 10.0  # how long a client waits for an answer that never comes ("timeout" fault)
    slow_share: float = 0.0  # the tail: this share of requests takes 0.2 to 3 s more


class TooManyRequests(gexc.TooManyRequests):
    """429 from the simulated bucket; retried by objectstore.retry's loop, as objectstore.gcs retries it."""


class Faults:
    """What may go wrong with one request attempt.

    `before(op, name)` is called before the attempt goes out (it may raise, e.g. for a dead
    machine); `draw(op, name)`, after its latency and rate limits, returns None or one of:
    "transient" (503, not applied), "lost" (applied, then the connection is reset), "late" (applied,
    answered `late_s` later), "timeout" (the client gives up after `Limits.timeout_s`; the store
    applies it `apply_after_s` after it was sent, whatever the client did meanwhile), or raises what
    the attempt should raise instead (a 403, an expired credential)."""

    late_s = 0.0
    apply_after_s = 0.0

    def before(self, op: str, name: str) -> None:
        pass

    def draw(self, op: str, name: str) -> str | None:
        return None


#: Bodies longer than this are kept compressed: a fleet's store holds millions of lease bodies and markers.
_PACK_OVER = 160


class _Object:
    """One object's current generation (a few million of them in a fleet's store: kept small)."""

    __slots__ = ("generation", "updated", "mutated", "keys", "values", "body", "packed", "size", "nonce")

    def __init__(self, generation: int, now: float, metadata: Mapping[str, str], data: bytes, nonce: str | None):
        self.generation, self.nonce, self.size = generation, nonce, len(data)
        keys = tuple(metadata)
        self.keys = _KEYS.setdefault(keys, keys)  # one tuple per set of names: most objects of a prefix share it
        self.values = tuple(metadata.values())
        self.packed = len(data) > _PACK_OVER
        self.body = zlib.compress(data, 1) if self.packed else data
        self.updated = self.mutated = now  # `updated` moves with a lifecycle change too; `mutated` only with a write

    @property
    def data(self) -> bytes:
        return zlib.decompress(self.body) if self.packed else self.body

    @property
    def metadata(self) -> dict[str, str]:
        return dict(zip(self.keys, self.values))


_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {}


def _top(name: str) -> str:
    """The top-level prefix a name is indexed under (`tasks/`), or "" for a name without a `/`."""
    head, slash, _ = name.partition("/")
    return head + "/" if slash else ""


class SimStore(ObjectStore):
    """In-memory objects with GCS's generations, preconditions, listing pages, rate limits and faults.

    Requests are counted per (operation, prefix) and per actor; every retried attempt counts.
    `on_stored(name, data, metadata, generation, origin)` is told of every write the store applied,
    with the machine that sent it (the simulation's ground truth)."""

    def __init__(
        self, scheduler: Scheduler, limits: Limits | None = None, seed: int = 0, faults: Faults | None = None,
        page_limit: int = MAX_LIST_PAGE, root_url: str = "gs://sim-bucket/q",
    ) -> None:  # fmt: skip
        limits = limits or Limits()
        self.root_url = root_url
        self.same_object_write_gap_s = limits.per_object_mutation_s
        self.scheduler = scheduler
        self.limits = limits
        self.page_limit = max(1, min(page_limit, MAX_LIST_PAGE))
        self.rng = random.Random(seed)
        self._objects: dict[str, _Object] = {}
        self._names: dict[str, list[str]] = collections.defaultdict(list)  # by top-level prefix, sorted
        self._generation = 0
        self._deleted: dict[str, float] = {}  # when each deleted name was deleted (GCS's one mutation a second)
        self.by_kind: collections.Counter[str] = collections.Counter()
        self.by_actor: collections.Counter[str] = collections.Counter()
        self.records_by_actor: collections.Counter[str] = collections.Counter()  # of which machines/
        self.per_second: dict[str, collections.Counter[int]] = {"read": collections.Counter(), "write": collections.Counter()}
        self.throttled: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()  # 412s by kind
        self.counting = True
        self.uncounted: set[str] = set()  # actors whose requests are not counted (they are not the fleet's)
        self.faults = faults
        self.on_stored = None
        self.on_first_lease = None  # (actor name) before its first successful lease write: the fleet's first claims
        #: `on_listed(prefix, entries, origin)` is told of every listing page the store answered, with the
        #: machine that asked (what each worker saw, and when: the simulation's ground truth of its view).
        self.on_listed = None
        self._applying_for: object = None  # the sender of a write the store applies late
        self.retrier = Retrier(
            RetryPolicy(initial_s=limits.retry_initial_s, cap_s=limits.retry_cap_s, deadline_s=limits.retry_deadline_s),
            is_transient,
            sleep=lambda s: scheduler.sleep(s) if scheduler.current is not None else None,
            monotonic=lambda: scheduler.now,
            rng=self.rng,
        )

    # -- ground truth, no request ----------------------------------------------------------------

    def peek(self, name: str) -> tuple[Entry, bytes] | None:
        obj = self._objects.get(name)
        return None if obj is None else (self._entry(name, obj), obj.data)

    def exists(self, name: str) -> bool:
        return name in self._objects

    def __len__(self) -> int:
        """How many objects it holds."""
        return len(self._objects)

    def last_mutated(self, name: str) -> float | None:
        """When the object was last written or deleted (virtual time), if ever."""
        obj = self._objects.get(name)
        return obj.mutated if obj is not None else self._deleted.get(name)

    def names(self, prefix: str) -> list[str]:
        """Every name under a top-level prefix (`tasks/`), in order."""
        return list(self._names.get(prefix, ()))

    def touch(self, name: str) -> bool:
        """What a lifecycle rule does to an object when it changes its storage class: `updated`
        moves to now, the generation stays. False when there is no such object."""
        obj = self._objects.get(name)
        if obj is None:
            return False
        obj.updated = self.scheduler.now
        return True

    def _entry(self, name: str, obj: _Object) -> Entry:
        return Entry(name, obj.generation, obj.size, EPOCH + dt.timedelta(seconds=obj.updated), obj.metadata)

    # -- the request path ------------------------------------------------------------------------

    def _origin(self) -> object:
        if self._applying_for is not None:
            return self._applying_for
        actor = self.scheduler.current
        return actor.machine if actor is not None else None

    def _request(self, op: str, name: str, items: int = 0, tag: str = "") -> None:
        """Count one attempt, wait out its latency, and raise TooManyRequests when a limit is hit."""
        now = self.scheduler.now
        rw = "read" if op in ("read", "list") else "write"
        second = int(now)
        actor = self.scheduler.current
        if self.counting and (actor is None or actor.name not in self.uncounted):
            self.by_kind[f"{op} {_top(name) or name}{tag}"] += 1
            if actor is not None:
                self.by_actor[actor.name] += 1
                if name.startswith(MACHINES):
                    self.records_by_actor[actor.name] += 1
            self.per_second[rw][second] += 1
        if actor is None:
            return
        latency = self.limits.latency_s * self.rng.lognormvariate(0, 0.3) + items * self.limits.per_item_s
        if self.limits.slow_share and self.rng.random() < self.limits.slow_share:
            latency += self.rng.uniform(0.2, 3.0)
        self.scheduler.sleep(latency, deliver=False)
        capacity = self.capacity(rw, now)
        if self.per_second[rw][second] > capacity:
            self.throttled[f"{rw} bucket"] += 1
            raise TooManyRequests(f"{op} {name}: bucket {rw} rate over {capacity:.0f}/s")
        if rw == "write":
            last = self.last_mutated(name)
            if last is not None and self.scheduler.now - last < self.limits.per_object_mutation_s:
                self.throttled[f"write same object ({_top(name)})"] += 1
                raise TooManyRequests(f"{op} {name}: more than one mutation per second")

    def capacity(self, rw: str, now: float) -> float:
        base = self.limits.initial_writes_per_s if rw == "write" else self.limits.initial_reads_per_s
        return base * 2 ** (now / self.limits.doubling_s)

    def _attempt(self, op: str, name: str, apply, items: int = 0, tag: str = ""):
        """One attempt on the wire: latency, limits, the drawn fault, and the change itself."""
        if self.faults is not None:
            self.faults.before(op, name)
        self._request(op, name, items, tag)
        fault = self.faults.draw(op, name) if self.faults is not None else None
        if fault == "transient":
            self.scheduler.deliver()
            raise gexc.ServiceUnavailable(f"{op} {name}: simulated 503")
        if fault == "timeout":
            origin, delay = self._origin(), self.faults.apply_after_s
            self.scheduler.spawn("store", lambda: self._apply_late(apply, origin), self.scheduler.now + delay)
            self.scheduler.sleep(self.limits.timeout_s, deliver=False)
            self.scheduler.deliver()
            raise TimeoutError(f"{op} {name}: simulated timeout (the store applies it {delay:.0f}s after it was sent)")
        try:
            result = apply()
        except PreconditionFailed:
            if self.counting:
                self.refused[f"{op} {_top(name)}"] += 1
            self.scheduler.deliver()
            raise
        if fault == "lost":
            self.scheduler.deliver()
            raise ConnectionResetError(f"{op} {name}: simulated reset after the request was applied")
        if fault == "late":
            self.scheduler.sleep(self.faults.late_s, deliver=False)
        self.scheduler.deliver()  # a signal or death that came while it was out: applied, never read
        return result

    def _apply_late(self, apply, origin: object) -> None:
        """The store acting on a request whose client stopped waiting for it, with its preconditions as they are now."""
        self._applying_for = origin
        try:
            apply()
        except (PreconditionFailed, NotFound):
            pass
        finally:
            self._applying_for = None

    def _retrying(self, op: str, name: str, apply, items: int = 0, tag: str = ""):
        return self.retrier.call(f"{op} {name}", lambda: self._attempt(op, name, apply, items, tag))

    def _conditional(self, op: str, name: str, apply) -> int:
        """A create or a generation-matched write, through the production ambiguous-write rule."""

        def read_back() -> tuple[int, str | None]:
            def current():
                obj = self._objects.get(name)
                if obj is None:
                    raise NotFound(f"{self.url(name)} does not exist")
                return obj.generation, obj.nonce

            return self._attempt("read", name, current)

        return write_with_nonce(
            self.retrier, f"{op} {name}", lambda nonce: self._attempt(op, name, lambda: apply(nonce)), read_back
        )

    def _store(self, name: str, data: bytes, metadata: Mapping[str, str] | None, nonce: str | None = None) -> int:
        actor = self.scheduler.current
        if self.on_first_lease is not None and actor is not None and name.startswith("leases/"):
            self.on_first_lease(actor.name)
        self._generation += 1
        if name not in self._objects:
            bisect.insort(self._names[_top(name)], name)
        self._objects[name] = _Object(self._generation, self.scheduler.now, metadata or {}, bytes(data), nonce)
        self._deleted.pop(name, None)
        if self.on_stored is not None:
            self.on_stored(name, data, metadata or {}, self._generation, self._origin())
        return self._generation

    # -- the contract ----------------------------------------------------------------------------

    def read(self, name: str) -> Blob:
        check_name(name)

        def apply():
            obj = self._objects.get(name)
            if obj is None:
                raise NotFound(f"{self.url(name)} does not exist")
            return Blob(name, obj.generation, obj.data)

        return self._retrying("read", name, apply)

    def create(self, name: str, data: bytes, metadata: Mapping[str, str] | None = None) -> int:
        check_name(name)

        def apply(nonce):
            if name in self._objects:
                raise PreconditionFailed(f"{self.url(name)} already exists")
            return self._store(name, data, metadata, nonce)

        return self._conditional("create", name, apply)

    def write(self, name: str, data: bytes, if_generation: int, metadata: Mapping[str, str] | None = None) -> int:
        check_name(name)

        def apply(nonce):
            obj = self._objects.get(name)
            if obj is None or obj.generation != if_generation:
                raise PreconditionFailed(f"{self.url(name)} is not at generation {if_generation}")
            return self._store(name, data, metadata, nonce)

        return self._conditional("write", name, apply)

    def delete(self, name: str, if_generation: int | None = None) -> None:
        check_name(name)

        def apply():
            obj = self._objects.get(name)
            if obj is None:
                raise NotFound(f"{self.url(name)} does not exist")
            if if_generation is not None and obj.generation != if_generation:
                raise PreconditionFailed(f"{self.url(name)} is not at generation {if_generation}")
            del self._objects[name]
            names = self._names[_top(name)]
            del names[bisect.bisect_left(names, name)]
            self._deleted[name] = self.scheduler.now

        delete_with_retries(self.retrier, f"delete {name}", lambda: self._attempt("delete", name, apply), if_generation)

    def put(self, name: str, data, metadata: Mapping[str, str] | None = None, content_type: str | None = None) -> int:
        check_name(name)
        return self._retrying("put", name, lambda: self._store(name, bytes(data), metadata))  # content type: not kept

    def put_file(self, name: str, path) -> int:
        return self.put(name, pathlib.Path(path).read_bytes())

    def open_read(self, name: str):
        return io.BytesIO(self.read(name).data)

    def list_page(self, prefix, page_token=None, start_offset=None, page_size=MAX_LIST_PAGE, end_offset=None) -> Page:
        top = _top(prefix)
        if top == prefix:
            names = self._names.get(prefix, [])
        else:  # a deeper or partial prefix (out/t1/, or one without a slash): rare, read the whole index
            names = sorted(n for n in self._objects if n.startswith(prefix))
        tag = "" if page_size >= MAX_LIST_PAGE else f" page{page_size}"
        size = max(1, min(page_size, self.page_limit))

        def apply():
            lo = max(prefix, start_offset or "", page_token + "\x00" if page_token else "")
            i = bisect.bisect_left(names, lo)
            j = bisect.bisect_left(names, end_offset) if end_offset else len(names)
            picked = names[i : min(j, i + size)]
            more = i + size < j
            page = Page([self._entry(n, self._objects[n]) for n in picked], picked[-1] if more and picked else None)
            if self.on_listed is not None:
                self.on_listed(prefix, page.entries, self._origin())
            return page

        return self._retrying("list", prefix, apply, items=min(size, len(names)), tag=tag)

    def child(self, prefix: str) -> ObjectStore:
        return PrefixedStore(self, prefix)


class PrefixedStore(ObjectStore):
    """A store rooted at `prefix` under another (the same objects, names mapped both ways)."""

    def __init__(self, inner: ObjectStore, prefix: str) -> None:
        self.inner = inner
        self.prefix = check_name(prefix.strip("/")) + "/"
        self.root_url = inner.url(self.prefix.rstrip("/"))
        self.same_object_write_gap_s = inner.same_object_write_gap_s

    def _in(self, name: str) -> str:
        return self.prefix + check_name(name)

    def _out(self, entry: Entry) -> Entry:
        return dataclasses.replace(entry, name=entry.name[len(self.prefix) :])

    def read(self, name):
        blob = self.inner.read(self._in(name))
        return Blob(name, blob.generation, blob.data)

    def create(self, name, data, metadata=None):
        return self.inner.create(self._in(name), data, metadata)

    def write(self, name, data, if_generation, metadata=None):
        return self.inner.write(self._in(name), data, if_generation, metadata)

    def delete(self, name, if_generation=None):
        self.inner.delete(self._in(name), if_generation)

    def put(self, name, data, metadata=None, content_type=None):
        return self.inner.put(self._in(name), data, metadata, content_type)

    def put_file(self, name, path):
        return self.inner.put_file(self._in(name), path)

    def open_read(self, name):
        return self.inner.open_read(self._in(name))

    def list_page(self, prefix, page_token=None, start_offset=None, page_size=MAX_LIST_PAGE, end_offset=None):
        page = self.inner.list_page(
            self.prefix + prefix, page_token=self.prefix + page_token if page_token else None,
            start_offset=self.prefix + start_offset if start_offset else None, page_size=page_size,
            end_offset=self.prefix + end_offset if end_offset else None,
        )  # fmt: skip
        token = page.next_token[len(self.prefix) :] if page.next_token else None
        return Page([self._out(e) for e in page.entries], token)

    def child(self, prefix):
        return PrefixedStore(self.inner, self.prefix + prefix.strip("/"))

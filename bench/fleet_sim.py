"""A fleet on a virtual clock: the real `Claimer` and `HeldLease` against a store that behaves like GCS.

    python -m bench.fleet_sim [--workers 1000] [--tasks 100000] [--mean-task-s 60] [--preempt-per-hour 0]
                              [--faults 0.01] [--late-batch 500]

Each worker is a thread running the real claim loop (`taskqueue.claims.Claimer`) and the real lease
(`taskqueue.lease.HeldLease`), with the spawner's task handling reduced to what a no-op consumer
needs: heartbeats every `--heartbeat-s` committing the consumer's checkpoints, `complete` at the end,
`release` on a preemption, dead-lettering after `MAX_TAKEOVERS` steals (the spawner's constant). Each
machine also writes what a real one writes on GCP: startup.sh's two boot records, and the real
`fleet.machines.MachineRecorder` (its beat an actor of its own, on virtual time) told of every state
change as `taskqueue.spawner` and `taskqueue.cli` tell it. Only
one thread runs at a time: a scheduler hands the turn to whichever worker's virtual wake-up time
comes first, so a run is deterministic for a seed and 1,000 workers x 100,000 tasks take minutes.

The store (`SimStore`) follows what GCS documents:
- per-request latency (lognormal around `--latency-ms`; a listing also pays per item returned);
- listings of at most 1000 objects per page, in name order, with startOffset/endOffset
  (https://cloud.google.com/storage/docs/json_api/v1/objects/list);
- one mutation per second per object name; faster ones get 429
  (https://cloud.google.com/storage/quotas#objects: "a limit of one write per second to the same object name");
- a bucket that starts at about 1,000 object writes/s and 5,000 reads/s and doubles every 20 minutes
  (https://cloud.google.com/storage/docs/request-rate); requests beyond that get 429.
A 429 is retried like `objectstore.gcs` does (full-jitter exponential backoff), and every attempt counts.

`--faults P` makes P of the workers' request attempts fail: half of them a 503, a fifth applied with
the response lost (writes), a fifth applied and answered late (2 s, half a TTL or a TTL), a tenth a
403. A non-transient error, or a store error past the retry deadline, that escapes the worker ends
its process, as it would: its lease is left to expire, and the process restarts `--restart-s` later
(systemd) on the same machine. `--late-batch N` submits N more tasks at half the ideal makespan and
N more once the fleet has started waiting at the end, and reports how long they waited from their
creation to their first claim.

It reports requests per task by kind (`machines/` for the records), the record writes per task with
the beat rule and as if every change were written, requests and time before each worker's first claim, claim
collisions, makespan against the ideal (total work / workers), the machine time the fleet ran and
how much of it went to tasks, work lost to preemption, the peak request rate against the bucket's
limits, and an extrapolation to a bigger fleet from a cost model whose terms it prints. For the
extrapolation it also runs a companion fleet of a tenth of the workers and tasks (`--no-companion`
skips it), to measure how the per-worker share grows with the queue. It is a benchmark: it prints
figures, it asserts nothing.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import concurrent.futures
import dataclasses
import datetime as dt
import heapq
import io
import json
import logging
import math
import pathlib
import random
import sys
import threading
import time
from unittest import mock

from google.api_core import exceptions as gexc

from google.auth import exceptions as auth_exceptions

from fleet.machines import MachineRecorder, make_record, write_record
from objectstore.base import MAX_LIST_PAGE, Blob, Entry, NotFound, ObjectStore, Page, PreconditionFailed, StoreError
from objectstore.gcs import is_transient
from objectstore.retry import Retrier, RetryPolicy, delete_with_retries, write_with_nonce
from taskqueue import layout
from taskqueue.claims import Claimer, ClaimOptions, default_poll_max
from taskqueue.clock import Clock
from taskqueue.lease import LeaseLost
from taskqueue.worker import MAX_TAKEOVERS
from reporting.status import snapshot
from taskqueue.submit import submit

EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
#: What ends a worker's process when it escapes (a 403, an expired credential, a store error past the
#: retry deadline); systemd starts it again.
CRASHES = (StoreError, gexc.GoogleAPICallError, auth_exceptions.GoogleAuthError)
MACHINES = "machines/"
SUBMITTER = "submitter"
PREFIXES = (MACHINES, layout.TASKS, layout.LEASES, layout.DONE, layout.FAILED, layout.SPLITS, layout.SWEPT, layout.OUT)


# -- virtual time ---------------------------------------------------------------------------------


class Scheduler:
    """Runs one actor thread at a time, in order of virtual wake-up time."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, "Actor"]] = []
        self._seq = 0
        self._turn_over = threading.Semaphore(0)
        self.current: Actor | None = None

    def spawn(self, name: str, target, at: float) -> None:
        actor = Actor(self, name, target)
        self._push(at, actor)

    def _push(self, at: float, actor: "Actor") -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, actor))

    def sleep(self, seconds: float) -> None:
        """Called by the running actor: give the turn away until `seconds` of virtual time have passed."""
        actor = self.current
        assert actor is not None, "sleep outside an actor"
        self._push(self.now + max(0.0, seconds), actor)
        self._turn_over.release()
        actor.turn.acquire()

    def run(self, progress=None, every_s: float = 600.0) -> None:
        """Until every actor has finished; `progress(now)` is called every `every_s` of virtual time."""
        next_report = every_s
        while self._heap:
            at, _, actor = heapq.heappop(self._heap)
            self.now = max(self.now, at)
            if progress is not None and self.now >= next_report:
                progress(self.now)
                next_report += every_s
            self.current = actor
            actor.resume()
            self._turn_over.acquire()
            if actor.error is not None:
                raise RuntimeError(f"actor {actor.name} failed") from actor.error


class Actor:
    def __init__(self, scheduler: Scheduler, name: str, target) -> None:
        self.scheduler, self.name, self.target = scheduler, name, target
        self.turn = threading.Semaphore(0)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def resume(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            self.thread.start()
        else:
            self.turn.release()

    def _main(self) -> None:
        try:
            self.target()
        except BaseException as exc:  # handed to the scheduler, which stops the run with it
            self.error = exc
        finally:
            self.scheduler._turn_over.release()


class InlineExecutor:
    """`submit`'s thread pool, run inline (here and in bench/sim_seeds.py): in the simulation only one
    thread may act for an actor."""

    def __init__(self, max_workers: int | None = None) -> None:
        pass

    def __enter__(self) -> "InlineExecutor":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def map(self, fn, *iterables):
        return [fn(*args) for args in zip(*iterables)]


class SimLock:
    """A lock for actors: a waiter gives the turn away until it is free (a real lock held across a
    request would stop the whole simulation, since only one actor runs at a time)."""

    def __init__(self, scheduler: Scheduler, poll_s: float = 0.01) -> None:
        self.scheduler, self.poll_s, self.held = scheduler, poll_s, False

    def __enter__(self) -> "SimLock":
        while self.held:
            self.scheduler.sleep(self.poll_s)
        self.held = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.held = False


class SimClock(Clock):
    """The queue's clock on virtual time: monotonic is scheduler time (at `rate`, for a clock that runs
    a few percent off), waits give the turn away."""

    def __init__(self, scheduler: Scheduler, rate: float = 1.0) -> None:
        super().__init__(rate=rate)
        self.scheduler = scheduler

    def monotonic(self) -> float:
        return self.scheduler.now * self.rate

    def wall(self) -> dt.datetime:
        return EPOCH + dt.timedelta(seconds=self.scheduler.now)

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        if not stop.is_set():
            self.scheduler.sleep(seconds / self.rate)
        return stop.is_set()


# -- a store that behaves like GCS ----------------------------------------------------------------


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


class TooManyRequests(gexc.TooManyRequests):
    """429 from the simulated bucket; retried by objectstore.retry's loop, as objectstore.gcs retries it."""


class Faults:
    """What may go wrong with one request attempt (the deterministic simulation's, bench/sim_seeds.py).

    `draw(op, name)` is called once per attempt, after its latency and rate limits, and returns None,
    or one of: "transient" (503 before it is applied), "lost" (applied, then the response is lost:
    a connection reset), "late" (applied, the response comes `late_s` later), or raises what the
    attempt should raise instead (a 403, an expired credential, a killed machine).
    """

    late_s = 0.0

    def before(self, op: str, name: str) -> None:
        """Called before the attempt goes out (before its latency): may raise, e.g. for a dead machine."""

    def draw(self, op: str, name: str) -> str | None:
        return None


class FleetFaults(Faults):
    """`--faults P`: P of the workers' request attempts fail (the submitter's never do)."""

    def __init__(self, scheduler: "Scheduler", rate: float, lease_ttl_s: float, seed: int) -> None:
        self.scheduler, self.rate, self.lease_ttl_s = scheduler, rate, lease_ttl_s
        self.rng = random.Random(f"faults-{seed}")
        self.drawn: collections.Counter[str] = collections.Counter()

    def draw(self, op: str, name: str) -> str | None:
        actor = self.scheduler.current
        if actor is None or actor.name.startswith(SUBMITTER) or self.rng.random() >= self.rate:
            return None
        roll = self.rng.random()
        if roll < 0.1:
            self.drawn["403"] += 1
            raise gexc.Forbidden(f"{op} {name}: simulated 403")
        if roll < 0.3 and op in ("create", "write", "put", "delete"):
            self.drawn["lost"] += 1
            return "lost"
        if roll < 0.5 and op in ("create", "write", "put"):
            self.drawn["late"] += 1
            self.late_s = self.rng.choice([2.0, self.lease_ttl_s / 2, self.lease_ttl_s])
            return "late"
        self.drawn["503"] += 1
        return "transient"


class SimStore(ObjectStore):
    """In-memory objects with GCS's generations, preconditions, listing pages and rate limits.

    Requests are counted per (operation, prefix) and per worker; every retried attempt counts.
    """

    def __init__(self, scheduler: Scheduler, limits: Limits, seed: int, faults: Faults | None = None) -> None:
        self.root_url = "gs://sim-bucket/q"
        self.same_object_write_gap_s = limits.per_object_mutation_s
        self.scheduler = scheduler
        self.limits = limits
        self.rng = random.Random(seed)
        self.entries: dict[str, Entry] = {}
        self.data: dict[str, bytes] = {}
        self.names: dict[str, list[str]] = {p: [] for p in PREFIXES}
        self.generation = 0
        self.last_mutation: dict[str, float] = {}
        self.by_kind: collections.Counter[str] = collections.Counter()
        self.by_worker: collections.Counter[str] = collections.Counter()
        self.records_by_worker: collections.Counter[str] = collections.Counter()  # of which machines/
        #: `on_created(name, now)`, told when an object is created (the late tasks' pickup clock starts).
        self.on_created = None
        self.per_second: dict[str, collections.Counter[int]] = {"read": collections.Counter(), "write": collections.Counter()}
        self.throttled: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()  # 412s by kind
        #: worker -> (requests before its first claim, of which machines/, when); `first_claim_counted`: those reported
        self.first_claim: dict[str, tuple[int, int, float]] = {}
        self.first_claim_counted: set[str] = set()
        self.counting = True
        self.faults = faults
        self.nonces: dict[str, str | None] = {}  # the nonce each object was written with (objectstore.gcs: NONCE_KEY)
        #: `on_stored(name, data, generation)`, told of every write the store applied (the simulation's ground truth).
        self.on_stored = None
        # The production retry loop (objectstore.retry), on virtual time: the same backoff and deadline.
        self.retrier = Retrier(
            RetryPolicy(initial_s=limits.retry_initial_s, cap_s=limits.retry_cap_s, deadline_s=limits.retry_deadline_s),
            is_transient,
            sleep=scheduler.sleep,
            monotonic=lambda: scheduler.now,
            rng=self.rng,
        )

    # -- the request path

    def _request(self, op: str, name: str, items: int = 0, tag: str = "") -> None:
        """Count one attempt, wait out its latency, and raise TooManyRequests when a limit is hit."""
        now = self.scheduler.now
        rw = "read" if op in ("read", "list") else "write"
        second = int(now)
        if self.counting:
            self.by_kind[f"{op} {name.split('/', 1)[0]}/{tag}"] += 1
            actor = self.scheduler.current
            if actor is not None:
                self.by_worker[actor.name] += 1
                if name.startswith(MACHINES):
                    self.records_by_worker[actor.name] += 1
            self.per_second[rw][second] += 1
        latency = self.limits.latency_s * self.rng.lognormvariate(0, 0.3) + items * self.limits.per_item_s
        if self.scheduler.current is not None:
            self.scheduler.sleep(latency)
        capacity = self.capacity(rw, now)
        if self.per_second[rw][second] > capacity:
            self.throttled[f"{rw} bucket"] += 1
            raise TooManyRequests(f"{op} {name}: bucket {rw} rate over {capacity:.0f}/s")
        if rw == "write":
            actor_now = self.scheduler.current is not None
            last = self.last_mutation.get(name)
            # (Outside an actor, i.e. the set-up's submit, there is no time to wait: its batch marker's two writes pass.)
            if last is not None and actor_now and self.scheduler.now - last < self.limits.per_object_mutation_s:
                self.throttled[f"write same object ({name.split('/')[0]}/)"] += 1
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
            raise gexc.ServiceUnavailable(f"{op} {name}: simulated 503")
        try:
            result = apply()
        except PreconditionFailed:
            if self.counting:
                self.refused[f"{op} {name.split('/', 1)[0]}/"] += 1
            raise
        if fault == "lost":
            raise ConnectionResetError(f"{op} {name}: simulated reset after the request was applied")
        if fault == "late":
            self.scheduler.sleep(self.faults.late_s)
        return result

    def _retrying(self, op: str, name: str, apply, items: int = 0, tag: str = ""):
        """objectstore.gcs's policy (objectstore.retry.Retrier): full-jitter backoff, every attempt on the wire."""
        return self.retrier.call(f"{op} {name}", lambda: self._attempt(op, name, apply, items, tag))

    def _conditional(self, op: str, name: str, apply) -> int:
        """A create or a generation-matched write, through the production ambiguous-write rule."""

        def read_back() -> tuple[int, str | None]:
            def current():
                entry = self.entries.get(name)
                if entry is None:
                    raise NotFound(f"{name} does not exist")
                return entry.generation, self.nonces.get(name)

            return self._attempt("read", name, current)

        return write_with_nonce(
            self.retrier, f"{op} {name}", lambda nonce: self._attempt(op, name, lambda: apply(nonce)), read_back
        )

    def _prefix(self, name: str) -> str:
        return name.split("/", 1)[0] + "/"

    def _store(self, name: str, data: bytes, metadata, nonce: str | None = None) -> int:
        actor = self.scheduler.current
        if name.startswith(layout.LEASES) and actor is not None and actor.name not in self.first_claim:
            # A worker's first successful lease write is its first claim (heartbeats come later).
            self.first_claim[actor.name] = (self.by_worker[actor.name] - 1, self.records_by_worker[actor.name],
                                            self.scheduler.now)
        self.generation += 1
        if name not in self.entries:
            bisect.insort(self.names.setdefault(self._prefix(name), []), name)
            if self.on_created is not None:
                self.on_created(name, self.scheduler.now)
        self.entries[name] = Entry(name, self.generation, len(data), EPOCH + dt.timedelta(seconds=self.scheduler.now),
                                   dict(metadata or {}))
        self.data[name] = data
        self.nonces[name] = nonce
        self.last_mutation[name] = self.scheduler.now
        if self.on_stored is not None:
            self.on_stored(name, data, self.generation)
        return self.generation

    # -- the contract

    def read(self, name: str) -> Blob:
        def apply():
            entry = self.entries.get(name)
            if entry is None:
                raise NotFound(f"{name} does not exist")
            return Blob(name, entry.generation, self.data[name])

        return self._retrying("read", name, apply)

    def create(self, name: str, data: bytes, metadata=None) -> int:
        def apply(nonce):
            if name in self.entries:
                raise PreconditionFailed(f"{name} already exists")
            return self._store(name, data, metadata, nonce)

        return self._conditional("create", name, apply)

    def write(self, name: str, data: bytes, if_generation: int, metadata=None) -> int:
        def apply(nonce):
            entry = self.entries.get(name)
            if entry is None or entry.generation != if_generation:
                raise PreconditionFailed(f"{name} is not at generation {if_generation}")
            return self._store(name, data, metadata, nonce)

        return self._conditional("write", name, apply)

    def delete(self, name: str, if_generation: int | None = None) -> None:
        def apply():
            entry = self.entries.get(name)
            if entry is None:
                raise NotFound(f"{name} does not exist")
            if if_generation is not None and entry.generation != if_generation:
                raise PreconditionFailed(f"{name} is not at generation {if_generation}")
            del self.entries[name], self.data[name]
            names = self.names[self._prefix(name)]
            del names[bisect.bisect_left(names, name)]
            self.last_mutation[name] = self.scheduler.now

        delete_with_retries(self.retrier, f"delete {name}", lambda: self._attempt("delete", name, apply), if_generation)

    def put(self, name: str, data: bytes, metadata=None, content_type=None) -> int:
        return self._retrying("put", name, lambda: self._store(name, data, metadata))  # content type: not simulated

    def put_file(self, name, path):
        return self.put(name, pathlib.Path(path).read_bytes())

    def open_read(self, name):
        return io.BytesIO(self.read(name).data)

    def list_page(self, prefix, page_token=None, start_offset=None, page_size=MAX_LIST_PAGE, end_offset=None) -> Page:
        names = self.names.get(prefix, []) if prefix in self.names else sorted(n for n in self.entries if n.startswith(prefix))
        page_size = max(1, min(page_size, MAX_LIST_PAGE))

        def apply():
            lo = max(prefix, start_offset or "", page_token + "\x00" if page_token else "")
            i = bisect.bisect_left(names, lo)
            j = bisect.bisect_left(names, end_offset) if end_offset else len(names)
            picked = names[i : min(j, i + page_size)]
            more = i + page_size < j
            return Page([self.entries[n] for n in picked], picked[-1] if more and picked else None)

        page = None

        def listed():
            nonlocal page
            page = apply()
            return page

        tag = "" if page_size >= MAX_LIST_PAGE else f" page{page_size}"
        return self._retrying("list", prefix, listed, items=min(page_size, len(names)), tag=tag)

    def child(self, prefix):
        # Not a stub: every simulated worker shares the one queue at the root, and nothing in the
        # claim loop or the lease opens a child store. Simulating one would need names mapped both ways.
        raise NotImplementedError("the simulated bucket holds one queue, at its root")


# -- the fleet ------------------------------------------------------------------------------------


@dataclasses.dataclass
class FleetOptions:
    workers: int = 1000
    tasks: int = 100_000
    mean_task_s: float = 60.0
    task_sigma: float = 0.5  # lognormal shape of task durations
    lease_ttl_s: float = 120.0
    heartbeat_s: float = 30.0
    checkpoint_s: float = 30.0  # the consumer commits a progress record this often (resume point)
    preempt_per_hour: float = 0.0  # per worker
    boot_s: float = 60.0  # a preempted VM's replacement starts this much later
    start_spread_s: float = 30.0  # the first workers boot uniformly over this
    idle_timeout_s: float = 300.0
    poll_min_s: float = 1.0
    poll_max_s: float = 0.0  # 0: spawn.py's default for the TTL (taskqueue.claims.default_poll_max)
    faults: float = 0.0  # the share of the workers' request attempts that fail (FleetFaults)
    restart_s: float = 5.0  # a crashed worker process starts again this much later (systemd)
    late_batch: int = 0  # tasks submitted at half the ideal makespan, and as many again once workers wait at the end
    record_beat_s: float = 60.0  # the machine record's beat (fleet.machines.DEFAULT_BEAT_S)
    seed: int = 1


@dataclasses.dataclass
class Stats:
    first_claim_requests: list[int] = dataclasses.field(default_factory=list)
    first_claim_record_requests: list[int] = dataclasses.field(default_factory=list)  # of which machines/
    first_claim_s: list[float] = dataclasses.field(default_factory=list)
    completions: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    duplicates: int = 0
    collisions: int = 0
    preemptions: int = 0
    crashes: int = 0  # worker processes ended by an error (restarted)
    lost_work_s: float = 0.0
    lost_leases: int = 0
    dead_letters: int = 0
    exit_reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    last_done_s: float = 0.0
    first_done_s: float = 0.0  # the last of the first tasks (not the late ones) done
    heartbeats: int = 0
    machine_s: float = 0.0  # from each worker's boot to its exit: what the fleet pays for
    busy_s: float = 0.0  # of which running a task
    record_writes: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # by cause
    created_at: dict = dataclasses.field(default_factory=dict)  # late task -> when it was created
    claimed_at: dict = dataclasses.field(default_factory=dict)  # late task -> its first claim
    late_submitted_at: list = dataclasses.field(default_factory=list)  # when each late batch began


class Fleet:
    def __init__(self, options: FleetOptions, limits: Limits) -> None:
        self.o = options
        self.rng = random.Random(options.seed)
        self.scheduler = Scheduler()
        self.clock = SimClock(self.scheduler)
        faults = FleetFaults(self.scheduler, options.faults, options.lease_ttl_s, options.seed) if options.faults > 0 else None
        self.store = SimStore(self.scheduler, limits, options.seed, faults)
        self.stats = Stats()
        mu = math.log(options.mean_task_s) - options.task_sigma**2 / 2
        self.ids = [f"t{k:07d}" for k in range(options.tasks)]
        # Late tasks sort after the first ones: the first late batch fills a new region at the end.
        self.late = [[f"t{options.tasks + b * options.late_batch + k:07d}" for k in range(options.late_batch)]
                     for b in range(2 if options.late_batch > 0 else 0)]  # fmt: skip
        self.duration = {t: self.rng.lognormvariate(mu, options.task_sigma) for t in self.ids + sum(self.late, [])}
        self.first_late = f"t{options.tasks:07d}"
        self._spawned = 0
        self.store.on_created = self._created

    @property
    def total_tasks(self) -> int:
        return len(self.duration)

    def _created(self, name: str, now: float) -> None:
        if name.startswith(layout.TASKS):
            task_id = name[len(layout.TASKS) :].rsplit(".", 1)[0]
            if task_id in self.duration:
                self.stats.created_at.setdefault(task_id, now)

    def setup(self) -> None:
        self.store.counting = False
        submit(self.store, b"{}", [(t, json.dumps({"id": t}).encode()) for t in self.ids], parallel=1)
        self.stats.created_at.clear()  # only the late tasks' pickup is measured
        self.store.counting = True

    def _spawn_worker(self, at: float) -> None:
        self._spawned += 1
        name = f"w{self._spawned:05d}"
        lifetime = self.rng.expovariate(self.o.preempt_per_hour / 3600) if self.o.preempt_per_hour > 0 else math.inf
        seed = self.rng.randrange(2**32)
        self.scheduler.spawn(name, lambda: self._machine(name, at, at + lifetime, seed), at)

    def _machine(self, name: str, booted: float, preempt_at: float, seed: int) -> None:
        """One VM: startup.sh's boot records, then the worker process, restarted after a crash."""
        for state in ("booting", "installing"):  # startup.sh: one plain write per boot state, never fatal
            self.stats.record_writes["startup"] += 1
            try:
                write_record(self.store, make_record(name, state, at=self.clock.wall(), since=self.clock.wall().isoformat()))
            except CRASHES:
                self.stats.record_writes["startup_failed"] += 1
            # A real boot and install take minutes; here a second apart (one write per second per object).
            self.scheduler.sleep(self.store.same_object_write_gap_s)
        rng = random.Random(seed)
        while True:
            try:
                reason = self._worker(name, booted, preempt_at, rng.randrange(2**32))
            except CRASHES:
                self.stats.crashes += 1
                self.scheduler.sleep(self.o.restart_s)
                continue
            break
        self.stats.exit_reasons[reason] += 1
        self.stats.machine_s += self.scheduler.now - booted

    def _recorder(self, name: str, booted: float) -> MachineRecorder:
        """spawn.py's `machine_state`: the real recorder, carrying on this boot's spells (one read),
        its beat an actor of its own on virtual time."""
        recorder = MachineRecorder(self.store, name, beat_s=self.o.record_beat_s, now=self.clock.wall,
                                   wait=self.clock.wait, lock=SimLock(self.scheduler), accelerator="cpu",
                                   provisioning="spot")  # fmt: skip
        recorder.carry_on(EPOCH + dt.timedelta(seconds=booted))
        self.scheduler.spawn(f"{name}.record", lambda: self._beats(recorder), self.scheduler.now)
        return recorder

    def _beats(self, recorder: MachineRecorder) -> None:
        recorder.beat_loop()

    def _worker(self, name: str, booted: float, preempt_at: float, seed: int) -> str:
        """One worker process (taskqueue.spawner.Spawner.run and taskqueue.cli around it); returns why it ended."""
        o, store, stats = self.o, self.store, self.stats
        started = self.scheduler.now
        recorder = self._recorder(name, booted)
        try:
            claimer = Claimer(
                store,
                ClaimOptions(name, o.lease_ttl_s, o.idle_timeout_s, o.poll_min_s,
                             o.poll_max_s or default_poll_max(o.poll_min_s, o.lease_ttl_s), seed=seed),
                self.clock,
            )
            recorder.set("idle", worker=name)
            for claim in claimer:
                lease = claim.lease
                if name not in store.first_claim_counted:
                    store.first_claim_counted.add(name)
                    requests, records, at = store.first_claim[name]
                    stats.first_claim_requests.append(requests - records)
                    stats.first_claim_record_requests.append(records)
                    stats.first_claim_s.append(at - started)
                stats.claimed_at.setdefault(claim.task_id, self.scheduler.now)
                recorder.set("working", worker=name, task=claim.task_id, attempt=lease.attempt)
                if int(lease.body.get("takeovers", 0)) >= MAX_TAKEOVERS:
                    lease.dead_letter(f"its lease expired {lease.body['takeovers']} times", ())
                    stats.dead_letters += 1
                    recorder.set("idle", worker=name, last_task=claim.task_id)
                    continue
                started = self.scheduler.now
                finished = self._run(claim.task_id, lease, preempt_at)
                stats.busy_s += self.scheduler.now - started
                if not finished:
                    stats.preemptions += 1
                    self._spawn_worker(self.scheduler.now + o.boot_s)
                    recorder.set("exited", worker=name, reason="stopped")  # taskqueue.cli after a stop
                    return "preempted"
                recorder.set("idle", worker=name, last_task=claim.task_id)
            # taskqueue.cli: a fleet deletes itself when the queue is empty (--on-empty delete)
            recorder.set("deleting" if claimer.exit_reason in ("drained", "idle") else "exited", worker=name,
                         reason=f"queue {claimer.exit_reason}")  # fmt: skip
            return claimer.exit_reason
        finally:
            recorder.stop()  # a crashed process writes nothing more; its beat ends at its next wake-up
            for cause, n in recorder.writes.items():
                stats.record_writes[cause] += n

    def _run(self, task_id: str, lease, preempt_at: float) -> bool:
        """The consumer and its heartbeats on virtual time; False when the VM was preempted."""
        o, now = self.o, self.scheduler
        done_before = len(lease.committed) * o.checkpoint_s
        need = max(0.0, self.duration[task_id] - done_before)
        started = now.now
        worked = 0.0
        committed = done_before
        while True:
            step = min(o.heartbeat_s, need - worked, preempt_at - now.now)
            if step > 0:
                now.sleep(step)
                worked += step
            checkpoints = int((done_before + worked) // o.checkpoint_s) - len(lease.committed)
            records = [{"checkpoint": len(lease.committed) + k} for k in range(max(0, checkpoints))]
            if now.now >= preempt_at:
                self.stats.lost_work_s += done_before + worked - max(committed, (len(lease.committed) + len(records)) * o.checkpoint_s)
                try:
                    lease.release(records)
                except LeaseLost:
                    self.stats.lost_leases += 1
                return False
            if worked >= need:
                try:
                    if lease.complete(records, started):
                        self.stats.completions[task_id] += 1
                        self.stats.last_done_s = max(self.stats.last_done_s, now.now)
                        if task_id < self.first_late:
                            self.stats.first_done_s = max(self.stats.first_done_s, now.now)
                    else:
                        self.stats.duplicates += 1
                except LeaseLost:
                    self.stats.lost_leases += 1
                return True
            try:
                self.stats.heartbeats += 1
                lease.heartbeat(records)
                committed = len(lease.committed) * o.checkpoint_s
            except LeaseLost:
                self.stats.lost_leases += 1
                return True

    def _submitter(self) -> None:
        """The late batches: one at half the ideal makespan, one once the fleet waits at the end
        (the first tasks all claimed: every worker that finishes now finds nothing)."""
        ideal = sum(self.duration.values()) / self.o.workers
        self.scheduler.sleep(ideal / 2)
        for k, batch in enumerate(self.late):
            if k == 1:
                # Every task so far claimed, and half the fleet done with its last one: waiting.
                so_far = self.ids + self.late[0]
                while (any(t not in self.stats.claimed_at for t in so_far[-self.o.late_batch:])
                       or len(self.stats.completions) < len(so_far) - self.o.workers // 2):
                    self.scheduler.sleep(5.0)
            self.stats.late_submitted_at.append(self.scheduler.now)
            with mock.patch.object(concurrent.futures, "ThreadPoolExecutor", InlineExecutor):
                submit(self.store, None, [(t, json.dumps({"id": t}).encode()) for t in batch], parallel=1)

    def run(self) -> None:
        for _ in range(self.o.workers):
            self._spawn_worker(self.rng.uniform(0, self.o.start_spread_s))
        if self.late:
            self.scheduler.spawn(SUBMITTER, self._submitter, 0.0)
        started = time.monotonic()
        self.scheduler.run(
            lambda now: print(
                f"event=progress virtual_s={now:.0f} done={len(self.stats.completions)}/{self.total_tasks} "
                f"requests={sum(self.store.by_kind.values())} wall_s={time.monotonic() - started:.0f}",
                file=sys.stderr,
                flush=True,
            )
        )


# -- report ---------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _spread(values: list[float]) -> dict:
    return {"p50": round(percentile(values, 0.5), 1), "p99": round(percentile(values, 0.99), 1),
            "max": round(max(values, default=float("nan")), 1)}  # fmt: skip


def report(fleet: Fleet, seconds: float) -> dict:
    o, s, store = fleet.o, fleet.stats, fleet.store
    tasks = fleet.total_tasks
    total = sum(store.by_kind.values())
    heartbeats = s.heartbeats  # lease writes that renew (the tombstone and takeovers are lease writes too)
    by_kind = {k: round(v / tasks, 4) for k, v in sorted(store.by_kind.items())}
    work = sum(fleet.duration.values())
    ideal = work / o.workers
    done = len(s.completions)
    records = sum(v for k, v in store.by_kind.items() if k.startswith(("put " + MACHINES, "read " + MACHINES)))
    w = s.record_writes
    waited = [s.claimed_at[t] - s.created_at[t] for batch in fleet.late for t in batch if t in s.claimed_at and t in s.created_at]
    late = [{"tasks": len(batch), "submitted_at_s": round(at, 1),
             "waited_s": _spread([s.claimed_at[t] - s.created_at[t] for t in batch if t in s.claimed_at and t in s.created_at]),
             "never_claimed": sum(1 for t in batch if t not in s.claimed_at)}
            for batch, at in zip(fleet.late, s.late_submitted_at)]  # fmt: skip
    peak = {rw: max(c.values(), default=0) for rw, c in store.per_second.items()}
    peak_at = {rw: max(c, key=c.get, default=0) for rw, c in store.per_second.items()}
    return {
        "workers": o.workers,
        "tasks": tasks,
        "wall_seconds": round(seconds, 1),
        "done": done,
        "double_completions": sum(1 for n in s.completions.values() if n > 1) + s.duplicates,
        "requests_per_task": round(total / tasks, 3),
        "heartbeats_per_task": round(heartbeats / tasks, 3),
        "requests_per_task_without_heartbeats": round((total - heartbeats) / tasks, 3),
        "machine_record_requests_per_task": round(records / tasks, 3),
        "requests_per_task_without_records": round((total - records) / tasks, 3),
        # Writes by cause: startup.sh's two per boot, changes written at once (first and final states),
        # beats; "every_change" is what the same run would have written with each change written at once.
        "machine_record_writes_per_task": {
            "startup": round(w["startup"] / tasks, 3), "change": round(w["change"] / tasks, 3),
            "beat": round(w["beat"] / tasks, 3), "total": round((w["startup"] + w["change"] + w["beat"]) / tasks, 3),
            "every_change": round((w["startup"] + w["change"] + w["deferred"] + w["beat"]) / tasks, 3)},
        "by_kind_per_task": by_kind,
        "first_claim_requests": {"max": max(s.first_claim_requests, default=0),
                                  "p50": percentile(s.first_claim_requests, 0.5),
                                  "p99": percentile(s.first_claim_requests, 0.99)},
        "first_claim_record_requests": {"max": max(s.first_claim_record_requests, default=0),
                                         "p50": percentile(s.first_claim_record_requests, 0.5)},
        "late_batches": late,
        "late_waited_s": _spread(waited),
        "faults": dict(store.faults.drawn) if isinstance(store.faults, FleetFaults) else {},
        "crashes": s.crashes,
        "first_claim_s": {"max": round(max(s.first_claim_s, default=0), 2),
                          "p50": round(percentile(s.first_claim_s, 0.5), 2)},
        "claim_collisions": store.refused.get("create leases/", 0),
        "refused_412": dict(store.refused),
        "makespan_s": round(s.last_done_s, 1),
        "ideal_s": round(ideal, 1),
        "makespan_over_ideal": round(s.last_done_s / ideal, 4) if ideal else None,
        "first_tasks_done_s": round(s.first_done_s, 1),
        "machine_hours": round(s.machine_s / 3600, 1),
        "busy_fraction": round(s.busy_s / s.machine_s, 4) if s.machine_s else None,
        "preemptions": s.preemptions,
        "work_lost_s": round(s.lost_work_s, 1),
        "work_lost_fraction": round(s.lost_work_s / work, 5),
        "lost_leases": s.lost_leases,
        "dead_letters": s.dead_letters,
        "exit_reasons": dict(s.exit_reasons),
        "peak_per_s": peak,
        "peak_at_s": peak_at,
        "limit_at_peak_per_s": {rw: round(store.capacity(rw, peak_at[rw])) for rw in peak},
        "throttled": dict(store.throttled),
        "mean_task_s": o.mean_task_s,
        "heartbeat_s": o.heartbeat_s,
    }


# Requests that belong to one task's own objects, whatever the fleet's size: its lease (create,
# heartbeats, takeover reads and writes, tombstone), a takeover's done check, its done marker.
PER_TASK_KINDS = ("create leases/", "write leases/", "read leases/", "create done/", "list done/ page64",
                  "list failed/ page1", "create failed/", "read tasks/")


def per_task_and_worker(result: dict) -> tuple[float, float]:
    """Requests on each task's own objects (lease, heartbeats, tombstone, done marker), which do not
    depend on W or T; and everything else (start-up, moving between regions, sweeping, waiting at
    the end) per worker that ran."""
    per_task = sum(v for k, v in result["by_kind_per_task"].items() if k in PER_TASK_KINDS)
    other = result["requests_per_task"] - per_task
    return per_task, other * result["tasks"] / (result["workers"] + result["preemptions"])


def extrapolate(result: dict, companion: dict | None, workers: int, tasks: int) -> dict:
    """R(W, T) = T * per_task + W * per_worker(T), both terms measured.

    per_worker grows with the queue: the last tasks take longer at more tasks (the slowest of more
    draws), so the fleet waits longer at the end, and it watches more regions while it does. The
    companion run (a tenth of the workers and tasks, the same W / T and task durations) gives the
    growth per tenfold of tasks, taken as constant (never negative) beyond the main run.
    """
    per_task, per_worker = per_task_and_worker(result)
    growth = 0.0
    if companion is not None:
        _, small = per_task_and_worker(companion)
        growth = max(0.0, (per_worker - small) / math.log10(result["tasks"] / companion["tasks"]))
    target = per_worker + growth * math.log10(tasks / result["tasks"])
    scaled_workers = workers * (result["workers"] + result["preemptions"]) / result["workers"]
    return {
        "workers": workers,
        "tasks": tasks,
        "per_task_requests": round(per_task, 3),
        "per_worker_requests": round(per_worker, 1),
        "per_worker_requests_companion": round(small, 1) if companion is not None else None,
        "per_worker_growth_per_tenfold": round(growth, 1),
        "per_worker_requests_extrapolated": round(target, 1),
        "requests_per_task": round(per_task + target * scaled_workers / tasks, 3),
        "requests_per_task_without_heartbeats": round(
            per_task - result["heartbeats_per_task"] + target * scaled_workers / tasks, 3
        ),
        "total_requests": round(per_task * tasks + target * scaled_workers),
        # The map is listed one page at a time (a thousand regions), so start-up does not grow with T.
        "first_claim_requests_max": result["first_claim_requests"]["max"],
        "peak_writes_per_s": round(result["peak_per_s"]["write"] * workers / result["workers"]),
        "peak_reads_per_s": round(result["peak_per_s"]["read"] * workers / result["workers"]),
    }


def simulate(options: FleetOptions, limits: Limits) -> dict:
    fleet = Fleet(options, limits)
    started = time.monotonic()
    fleet.setup()
    setup_s = time.monotonic() - started
    fleet.run()
    result = report(fleet, time.monotonic() - started)
    # What tools/status.py says of the queue at the end (uncounted, fault-free): the ground truth the
    # worker-side figures above may miss (a task whose tombstone was written by a process that crashed).
    fleet.scheduler.current = None
    fleet.store.counting, fleet.store.faults = False, None
    view = snapshot(fleet.store, now=EPOCH + dt.timedelta(seconds=fleet.scheduler.now))
    result["status"] = {k: view[k] for k in ("total", "done", "failed", "complete")}
    result["setup_seconds"] = round(setup_s, 1)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = FleetOptions()
    for field in dataclasses.fields(FleetOptions):
        p.add_argument("--" + field.name.replace("_", "-"), type=type(getattr(defaults, field.name)),
                       default=getattr(defaults, field.name))
    p.add_argument("--latency-ms", type=float, default=30.0)
    p.add_argument("--extrapolate", default="10000x1000000", help="WORKERSxTASKS to extrapolate to")
    p.add_argument("--no-companion", action="store_true",
                   help="skip the run at a tenth of the workers and tasks that measures how per-worker requests grow")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for noisy in ("taskqueue", "objectstore"):  # a million event lines would cost more than the run
        logging.getLogger(noisy).setLevel(logging.ERROR)
    threading.stack_size(512 * 1024)
    options = FleetOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(FleetOptions)})
    limits = Limits(latency_s=args.latency_ms / 1000)
    result = simulate(options, limits)
    companion = None
    if not args.no_companion and options.workers >= 10 and options.tasks >= 10:
        small = dataclasses.replace(options, workers=options.workers // 10, tasks=options.tasks // 10)
        companion = simulate(small, limits)
        result["companion"] = {k: companion[k] for k in ("workers", "tasks", "requests_per_task", "wall_seconds")}
    ew, et = (int(x) for x in args.extrapolate.lower().split("x"))
    result["extrapolated"] = extrapolate(result, companion, ew, et)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    r = result
    print(f"fleet  {r['workers']} workers x {r['tasks']} tasks, tasks ~{options.mean_task_s:g}s (lognormal sigma "
          f"{options.task_sigma}), heartbeat {options.heartbeat_s:g}s, preemptions {options.preempt_per_hour:g}/worker-hour, "
          f"faults {options.faults:g} of attempts {r['faults']}, late batches {options.late_batch}; "
          f"simulated in {r['wall_seconds']}s (setup {r['setup_seconds']}s)")
    print(f"done   {r['done']}/{r['tasks']} seen by the workers (status at the end: {r['status']}), double completions {r['double_completions']}, dead letters {r['dead_letters']}, "
          f"exits {r['exit_reasons']}, crashed processes {r['crashes']}")
    print(f"cost   {r['requests_per_task']} requests/task, of which {r['heartbeats_per_task']} heartbeats "
          f"({r['requests_per_task_without_heartbeats']} without them)")
    print("       per task by kind: " + ", ".join(f"{k}={v}" for k, v in r["by_kind_per_task"].items()))
    mw = r["machine_record_writes_per_task"]
    print(f"record machine records {r['machine_record_requests_per_task']} requests/task "
          f"({r['requests_per_task_without_records']} requests/task without them); writes/task: startup.sh "
          f"{mw['startup']}, changes {mw['change']}, beats {mw['beat']}: {mw['total']} "
          f"(every change written at once: {mw['every_change']})")
    fc = r["first_claim_requests"]
    print(f"start  requests before first claim: max {fc['max']}, p50 {fc['p50']}, p99 {fc['p99']} "
          f"(queue; plus machine records: max {r['first_claim_record_requests']['max']}); "
          f"time to first claim: max {r['first_claim_s']['max']}s, p50 {r['first_claim_s']['p50']}s")
    print(f"claims collisions (412 on lease create) {r['claim_collisions']}; all 412s {r['refused_412']}")
    print(f"time   makespan {r['makespan_s']}s vs ideal {r['ideal_s']}s (total work / workers; the fleet boots over "
          f"{options.start_spread_s:g}s): "
          f"{r['makespan_over_ideal']}x (first tasks all done at {r['first_tasks_done_s']}s); machines ran {r['machine_hours']} worker-hours, "
          f"{100 * r['busy_fraction']:.1f}% of it running tasks (the rest: boot spread, moving, waiting at the end)")
    for k, batch in enumerate(r["late_batches"]):
        print(f"late   batch {k + 1}: {batch['tasks']} tasks submitted at t={batch['submitted_at_s']}s, waited from "
              f"creation to claim p50 {batch['waited_s']['p50']}s, p99 {batch['waited_s']['p99']}s, "
              f"max {batch['waited_s']['max']}s; never claimed {batch['never_claimed']}")
    print(f"loss   preemptions {r['preemptions']}, work lost {r['work_lost_s']}s = {100 * r['work_lost_fraction']:.3f}% "
          f"of all work, leases lost {r['lost_leases']}")
    print(f"rate   peak {r['peak_per_s']['write']} writes/s at t={r['peak_at_s']['write']}s "
          f"(bucket limit then {r['limit_at_peak_per_s']['write']}/s), peak {r['peak_per_s']['read']} reads/s at "
          f"t={r['peak_at_s']['read']}s (limit {r['limit_at_peak_per_s']['read']}/s); throttled {r['throttled']}")
    e = r["extrapolated"]
    grows = (f"{e['per_worker_requests_companion']} at {r['companion']['workers']} x {r['companion']['tasks']}, "
             f"so +{e['per_worker_growth_per_tenfold']} per tenfold of tasks" if "companion" in r else "no companion run: held constant")  # fmt: skip
    print(f"model  R(W,T) = T x {e['per_task_requests']} (per task: lease, heartbeats, done marker, tombstone) "
          f"+ W x per_worker(T) (start, moves, sweeps, waiting at the end): {e['per_worker_requests']} here, {grows}")
    print(f"extrap {e['workers']} workers x {e['tasks']} tasks: per_worker {e['per_worker_requests_extrapolated']}, "
          f"{e['requests_per_task']} requests/task ({e['requests_per_task_without_heartbeats']} without heartbeats), "
          f"{e['total_requests']:.3g} requests, first claim <= "
          f"{e['first_claim_requests_max']} requests, peak ~{e['peak_writes_per_s']} writes/s and "
          f"~{e['peak_reads_per_s']} reads/s if the fleet boots as fast")


if __name__ == "__main__":
    main()

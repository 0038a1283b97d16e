"""Seeded worlds: whole workers, submitters and status on one simulated store, checked after every run.

In the spirit of FoundationDB's simulator and TigerBeetle's VOPR, the code under test is the
production code: `Claimer`, `HeldLease`, `submit`, `finish`-ing batches, `reporting.status.snapshot`,
the worker core (`taskqueue.worker.TaskRun`, the same decisions `taskqueue.spawner` makes) and the
store's retry loop and ambiguous-write rule (`objectstore.retry`). Around them a simulated world on
virtual time (`tests.simworld.scheduler`, `tests.simworld.store`) and a scripted consumer in place
of the subprocess. One seed decides everything, so a failure replays exactly
(`python -m bench.sim_seeds --seed N --verbose`). Every knob is passed in: the store's page limit,
the claim loop's `ClaimOptions` (cached regions, batch keep time), the submit's executor, region
size and keep time.

What a seed draws:
- a few workers (each with a clock that runs a few percent fast or slow; while a VM is suspended its
  actors do not run, and its clock either counts the suspension, as taskqueue.clock's does on Linux,
  or stands still, as CLOCK_MONOTONIC does), tens of tasks,
  regions of a few tasks, and listing pages of a few entries in half the worlds, so that the region
  map spans several pages as a million-task queue's does; in half the worlds the workers cache 2 or 3
  regions instead of 8, so that their view drops regions all the time;
- store faults during a chaos window: transient errors (some outages outlast the retry deadline),
  ambiguous writes (applied, then the response lost, or returned late), timeouts after which the
  store applies the write anyway (before the client's retry, or after it gave up), non-transient
  errors (403, an expired credential) on any call; a lifecycle rule moving objects' `updated` times;
- machines killed at any request or at any moment (requests in flight are applied after), SIGTERM and
  preemption at any time, suspensions, replacements booting after them;
- each attempt's consumer: outputs written, then exit 0, 1 or 65, a crash, or a hang (the stuck-task
  backstop stops it), and how it answers SIGTERM; in half the worlds the consumer is resident
  (`spawn.py --resident`): one process per worker serves its tasks while the worker core lets it
  (`TaskRun.consumer_stays`), and now and then dies between tasks (no consumer's start-up is timed: a
  resident world runs as its per-task twin would, so the seeds that found bugs replay the same worlds);
- late submissions of any size, before the first split, into existing regions and after the last,
  while workers run, wait or leave, their creates in flight together on a pool of 1 to 16; a
  submitter killed at any point, interrupted once or twice (Ctrl-C, SIGTERM) at any point, and one
  refused because a task of its batch exists with another manifest. What status tells their operator
  is done: a submit that died, failed or was left running is run again (the same command), a refused
  task is submitted again under a new id;
- `reporting.status.snapshot` at random times, on the same faulty store, some suspended midway;
- done batch markers deleted after a keep time of 30 s or two minutes, so that a world sees it;
- in a quarter of the worlds, at the end, a batch that comes and goes between the two listings of
  batches/ of a status snapshot, then of a worker's drained check, so that only layout.PRUNED tells
  (`World.straddle`; invariants 8 and 4 see it).

Invariants, checked for every seed (`Violation.invariant` is the number):
1. every task that exists has exactly one done marker or exactly one dead letter (never both, never
   neither), once the fleet (plus fault-free closers) has finished;
2. no consumer starts on a task whose done marker exists (but where a machine's clock stood still while
   it was suspended, it cannot tell that its claim went stale: its lease must be someone else's by then,
   so that its first heartbeat is refused and nothing it does counts);
3. every output a lease write committed is in the done marker;
4. no worker exits `drained` while a task lacks a marker, counting every task of a submit in progress
   (from its first applied write on: before that no worker can know of it);
5. `reporting.status.snapshot`'s totals, counters and `complete` at the end equal the ground truth;
6. liveness: a task submitted after the chaos window, while some worker has been waiting without a
   task, is claimed within `pickup_bound_s` (two poll caps plus 10 s); no worker exits `idle` while
   a task nobody holds has been claimable for longer than that bound, nor beside a lease that nobody
   runs (its holder died or moved on) which it has neither seen renew nor watched for its TTL (a
   renewal judged from what the store answered the worker's listings, `World.saw_renew`, never from
   the worker's own flag);
7. no batch marker outlives its submitter's failure: a submit that began its batch and then failed
   leaves it `running` only if it says so (the store refused the finishing writes, or a second
   interrupt cut its wait short); at the end, after the runs again, no batch is `running`;
8. whenever a status snapshot says `complete`, every task in the store has its marker;
9. every task create the store applies lands while a `running` batch marker covers the task: no
   submit finishes its batch while one of its creates can still be applied;
10. a resident consumer that was signalled (a stop, the backstop, a lost lease) or that did not say its
   state is sound never serves another task.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import hashlib
import itertools
import json
import math
import os
import pathlib
import random
import signal as signals
import subprocess
import threading

from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exceptions

from objectstore.base import NotFound, StoreError
from reporting.status import snapshot
from taskqueue import layout
from taskqueue.claims import Claimer, ClaimOptions, default_poll_max
from taskqueue.lease import sum_counters
from taskqueue.submit import SubmitError, batch_name, prune_batches, submit
from taskqueue.worker import (
    DeadLetter,
    Phase,
    RunOptions,
    Signal,
    Tally,
    TaskRun,
    perform_final,
    perform_renew,
    resident_exit_code,
    verdict_before_start,
)
from tests.simworld.scheduler import EPOCH, Actor, InlineExecutor, Scheduler, SimClock, SimExecutor
from tests.simworld.store import Faults, Limits, SimStore

REPO = pathlib.Path(__file__).resolve().parents[2]
STATUS_LOOKS = 6  # snapshots taken by status at random times of a world (invariant 8)
#: How far apart in time a listing may be as the store answered it and as its worker sent it (a slow
#: request, a page more): a renewal seen across a gap this close to a TTL is not judged (invariant 6).
RENEW_MARGIN_S = 5.0
TICK_S = 2.0  # how often the simulated shell ticks the core while a consumer runs (the real one: 0.2 s)
JOB = json.dumps({"name": "sim"}).encode()


class Killed(BaseException):
    """The machine died: raised at a request, or at the next turn of each of its actors. A
    BaseException, so that no `except Exception` in the production code can catch it (a dead machine
    runs no handler)."""


class Runaway(BaseException):
    """Virtual time ran past MAX_VIRTUAL_S: something waits or retries forever (a liveness failure)."""


#: The claim loop's own cache size; worlds draw it or a smaller one.
CACHED_REGIONS = ClaimOptions.__dataclass_fields__["max_loaded_regions"].default
MAX_VIRTUAL_S = 5_000.0  # a world ends within about 3,000 s (chaos, late submits, idle timeouts, closers)
#: A non-transient error that escapes the worker ends its process; systemd starts it again.
CRASHES = (gexc.GoogleAPICallError, auth_exceptions.GoogleAuthError)


# -- the world -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorldConfig:
    """Everything a seed decides before the run; the rest is drawn as the run goes, from the same seed."""

    seed: int
    workers: int
    tasks: int
    lease_ttl_s: float
    heartbeat_s: float
    poll_max_s: float
    idle_timeout_s: float
    stuck_after_s: float
    max_attempts: int
    chaos_s: float  # faults, kills, stops and suspensions happen before this; replacements after it are fault-free
    p_transient: float
    p_lost: float
    p_late: float
    p_timeout: float  # a write the client gives up on, which the store applies later all the same
    p_forbidden: float
    outages: tuple[tuple[float, float], ...]  # (start, seconds) windows in which every request fails transiently
    retry_deadline_s: float
    p_kill: float  # chance a worker machine is killed at some request
    p_stop: float  # chance a worker gets SIGTERM or a preemption notice at some time
    p_suspend: float  # chance a worker or a status run is suspended (its clock stands still)
    late_batches: int
    cached_regions: int  # ClaimOptions.max_loaded_regions: small caches evict often
    region_tasks: int  # where submit cuts regions
    page_limit: int  # the store's most entries per listing page
    batch_keep_s: float  # done batch markers are deleted this long after
    submit_parallel: int  # a submit's creates in flight at once
    p_interrupt: float  # chance a submit gets Ctrl-C or SIGTERM (once or twice) at some moment
    lifecycle: bool  # a lifecycle rule moves objects' `updated` times now and then
    #: At the end, a batch comes and goes between the two listings of batches/ of a status snapshot, then
    #: of a worker's drained check (`World.straddle`): only layout.PRUNED tells (invariants 8 and 4).
    straddle: bool = False
    #: Resident consumers (spawn.py --resident); drawn from a generator of its own, so that every other draw of
    #: a seed's world is what it was before resident consumers existed.
    resident: bool = False

    @property
    def pickup_bound_s(self) -> float:
        return 2 * self.poll_max_s + 10.0

    @classmethod
    def draw(cls, seed: int) -> "WorldConfig":
        rng = random.Random(f"config-{seed}")
        ttl = rng.choice([20.0, 30.0, 60.0])
        chaos = rng.uniform(100, 400)
        outages = tuple((rng.uniform(0, chaos), rng.choice([5.0, 20.0, 45.0])) for _ in range(rng.choice([0, 0, 1, 2])))
        return cls(
            seed=seed,
            workers=rng.randint(1, 4),
            tasks=rng.randint(1, 30),
            lease_ttl_s=ttl,
            heartbeat_s=ttl / rng.choice([3, 4]),
            poll_max_s=default_poll_max(1.0, ttl),
            idle_timeout_s=rng.choice([60.0, 150.0]),
            stuck_after_s=rng.choice([40.0, 90.0]),
            max_attempts=rng.choice([1, 2, 3]),
            chaos_s=chaos,
            p_transient=rng.choice([0.0, 0.02, 0.1]),
            p_lost=rng.choice([0.0, 0.02, 0.08]),
            p_late=rng.choice([0.0, 0.02]),
            p_timeout=rng.choice([0.0, 0.0, 0.02]),
            p_forbidden=rng.choice([0.0, 0.0, 0.005]),
            outages=outages,
            retry_deadline_s=rng.choice([10.0, 30.0]),
            p_kill=rng.choice([0.0, 0.3]),
            p_stop=rng.choice([0.0, 0.3]),
            p_suspend=rng.choice([0.0, 0.0, 0.3]),
            late_batches=rng.choice([0, 1, 2, 3, 4]),
            cached_regions=rng.choice([CACHED_REGIONS, CACHED_REGIONS, 3, 2]),
            region_tasks=rng.choice([3, 8]),
            page_limit=rng.choice([1000, 1000, 2, 4]),
            batch_keep_s=rng.choice([30.0, 120.0]),
            submit_parallel=rng.choice([1, 4, 16]),
            p_interrupt=rng.choice([0.0, 0.3]),
            lifecycle=rng.random() < 0.3,
            straddle=rng.random() < 0.25,  # drawn last: the draws before it make the same worlds as before it was
            resident=random.Random(f"resident-{seed}").random() < 0.5,
        )


@dataclasses.dataclass
class Violation:
    invariant: int
    what: str

    def __str__(self) -> str:
        return f"invariant {self.invariant}: {self.what}"


@dataclasses.dataclass
class Result:
    seed: int
    violations: list[Violation]
    digest: str
    virtual_s: float
    tasks: int
    stats: dict

    @property
    def ok(self) -> bool:
        return not self.violations

    def replay_command(self) -> str:
        return f"python -m bench.sim_seeds --seed {self.seed} --verbose"


@dataclasses.dataclass(eq=False)
class Machine:
    """A VM (or a submitter's or status's process): what kills, stops and suspensions act on."""

    name: str
    kill_at: int | None  # killed at this request (its own count, all its actors), if ever
    fault_free: bool
    requests: int = 0
    dead: bool = False
    stop_reason: str | None = None
    claimer: Claimer | None = None
    waiting_since: float | None = None  # alive and without a task since
    running: str | None = None  # the task its shell runs now
    stops: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # suspended (start, end)
    #: Its clock stands still while it is suspended (CLOCK_MONOTONIC, where the system has no CLOCK_BOOTTIME);
    #: else it counts the suspension, as taskqueue.clock does on Linux.
    clock_stops: bool = False
    submitting: bool = False  # its submit has not returned: a signal still reaches it
    clock: SimClock | None = None  # its worker's clock, once a worker runs on it
    before_listing: object = None  # called with the prefix before each listing it sends (World.straddle)


class SeedFaults(Faults):
    """The store's faults for one seed: per attempt, by the acting machine, inside the chaos window."""

    def __init__(self, world: "World") -> None:
        self.world = world
        self.rng = random.Random(f"faults-{world.config.seed}")

    def before(self, op: str, name: str) -> None:
        world = self.world
        if world.scheduler.now > MAX_VIRTUAL_S:
            raise Runaway(f"{op} {name} at virtual {world.scheduler.now:.0f}s")
        machine = world.acting_machine()
        if machine is not None and op == "list" and machine.before_listing is not None:
            machine.before_listing(name)
        if machine is not None:
            machine.requests += 1
            if not machine.dead and machine.kill_at is not None and machine.requests >= machine.kill_at:
                world.kill(machine, f"at request {machine.requests} ({op} {name})")
            if machine.dead:
                raise Killed(f"{machine.name} is dead ({op} {name})")

    def draw(self, op: str, name: str) -> str | None:
        world, c = self.world, self.world.config
        machine = world.acting_machine()
        now = world.scheduler.now
        if machine is None or machine.fault_free or now >= c.chaos_s or name.startswith(layout.OUT):
            return None
        if any(start <= now < start + length for start, length in c.outages):
            return "transient"
        roll = self.rng.random()
        if roll < c.p_forbidden:
            world.stats["non_transient"] += 1
            if self.rng.random() < 0.5:
                raise gexc.Forbidden(f"{op} {name}: simulated 403")
            raise auth_exceptions.RefreshError(f"{op} {name}: simulated expired credential")
        roll -= c.p_forbidden
        if roll < c.p_transient:
            return "transient"
        roll -= c.p_transient
        if op in ("create", "write", "delete") and roll < c.p_lost:
            world.stats["lost_responses"] += 1
            return "lost"
        roll -= c.p_lost
        if op in ("create", "write") and roll < c.p_late:
            world.stats["late_responses"] += 1
            self.late_s = self.rng.choice([2.0, c.lease_ttl_s / 2, c.lease_ttl_s])
            return "late"
        roll -= c.p_late
        if op in ("create", "write", "delete") and roll < c.p_timeout:
            world.stats["applied_after_timeout"] += 1
            self.apply_after_s = self.rng.choice([2.0, 15.0, 60.0])  # before a retry, or after it gave up
            return "timeout"
        return None


class WorldClock(SimClock):
    """A worker's clock on virtual time, running at its own rate, that stops a runaway seed."""

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        if self.scheduler.now > MAX_VIRTUAL_S:
            raise Runaway(f"a wait at virtual {self.scheduler.now:.0f}s")
        return super().wait(stop, seconds)


class SetUpClock(SimClock):
    """Virtual time that stands still: the world's set-up, before any actor runs."""

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        return stop.is_set()


class ScriptedConsumer:
    """A consumer in virtual time: outputs one by one, then an ending; answers SIGTERM and SIGKILL."""

    def __init__(self, world: "World", task_id: str, attempt: int, token: int, first: int, now: float):
        rng = random.Random(f"consumer-{world.config.seed}-{task_id}-{attempt}-{token}")
        self.world, self.task_id, self.token = world, task_id, token
        self.first, self.index, self.total = first, first, world.outputs[task_id]
        self.ending = rng.choices(["exit0", "exit1", "exit65", "crash", "hang"], weights=[75, 9, 3, 5, 8])[0]
        self.stop_after = rng.randint(0, max(0, self.total - first))  # outputs before a non-zero ending
        # One in six writes its outputs slowly (each inside the stuck-task backstop): tasks of minutes,
        # so that waiting workers reach their idle timeout beside live holders.
        self.step_s = rng.uniform(20.0, 35.0) if rng.random() < 1 / 6 else rng.uniform(1.0, 12.0)
        self.term_s = rng.choice([0.5, 2.0, None])  # None: ignores SIGTERM
        self.next_at = now + self.step_s
        self.exit_code: int | None = None
        self.exit_at: float | None = None

    def advance(self, store: SimStore, now: float) -> list[dict]:
        """What it did up to `now`: progress records of the outputs it wrote."""
        records = []
        while self.exit_code is None and self.exit_at is None and now >= self.next_at:
            ends_here = self.index >= self.total or (self.ending != "exit0" and self.index - self.first >= self.stop_after)
            if ends_here:
                if self.ending == "hang":
                    self.next_at = math.inf
                    break
                self.exit_code = {"exit0": 0, "exit1": 1, "exit65": 65, "crash": -signals.SIGSEGV}[self.ending]
                break
            name = f"{layout.output_prefix(self.task_id, self.token)}/part-{self.index}"
            try:
                store.put(name, f"{self.task_id}:{self.index}".encode())
            except Exception:  # noqa: BLE001 - a consumer whose write failed exits non-zero, as consume.py does
                self.exit_code = 1
                break
            records.append({"task": self.task_id, "token": self.token, "index": self.index, "output": name,
                            "counters": {"rows": 1 + self.index % 3}})  # fmt: skip
            self.index += 1
            self.next_at += self.step_s
        if self.exit_at is not None and now >= self.exit_at and self.exit_code is None:
            self.exit_code = 128 + signals.SIGTERM
        return records

    def signal(self, signum: int, now: float) -> None:
        if self.exit_code is not None:
            return
        if signum == signals.SIGKILL:
            self.exit_code = -signals.SIGKILL
        elif self.term_s is not None and self.exit_at is None:
            self.exit_at = now + self.term_s

    def wake_at(self) -> float:
        """When it next does something: its exit once SIGTERM reached it (it writes nothing more), else its next step."""
        return self.exit_at if self.exit_at is not None else self.next_at


class SimResident:
    """A resident consumer process (taskqueue.process.ResidentConsumer) in virtual time: which tasks it served,
    whether a signal reached it, whether it said its state was sound, and whether it dies before its next task."""

    def __init__(self, world: "World", machine: str, number: int) -> None:
        self.name = f"{machine}/resident-{number}"
        self.signalled = False
        self.sound = True  # it said it stays (its last reply's `stays`)
        self.served: list[str] = []
        self.dies_idle = random.Random(f"resident-{world.config.seed}-{self.name}").random() < 0.1

    def reply(self, consumer: ScriptedConsumer) -> tuple[int | None, bool]:
        """Its reply to the task `consumer` scripted: (exit code, stays), or (None, False) when it died on the task
        without one (a crash, SIGKILL). A clean end or the task's bad input keeps it; exit 1 and a SIGTERM it acted
        on do not. One that ignores SIGTERM knows of no stop, and says it stays: only the worker core keeps it out."""
        code = consumer.exit_code
        if code is None or code < 0:
            return None, False
        return code, code in (0, 65) and consumer.exit_at is None


class World:
    def __init__(self, config: WorldConfig) -> None:
        self.config = config
        self.rng = random.Random(f"world-{config.seed}")
        self.scheduler = Scheduler(gate=self._gate, ends=(Killed,))
        limits = Limits(latency_s=0.02, retry_initial_s=0.1, retry_cap_s=4.0, retry_deadline_s=config.retry_deadline_s,
                        timeout_s=5.0, slow_share=0.02)  # fmt: skip
        self.faults = SeedFaults(self)
        self.store = SimStore(self.scheduler, limits, config.seed, faults=self.faults, page_limit=config.page_limit)
        self.store.on_stored = self._stored
        self.store.on_listed = self._listed
        self.machines: dict[str, Machine] = {}
        self.violations: list[Violation] = []
        self.stats: collections.Counter[str] = collections.Counter()
        self.outputs: dict[str, int] = {}  # task -> outputs its consumer writes in all
        self.created_at: dict[str, float] = {}
        self.applied_late: set[str] = set()  # tasks whose create the store applied after its client gave up
        self.straddled: set[str] = set()  # tasks of batches that came and went unseen (`straddle`): readers waited
        self.first_claim_at: dict[str, float] = {}
        self.committed: dict[str, set[str]] = collections.defaultdict(set)  # task -> records a lease write carried
        self.submits_starting: dict[str, list[str]] = {}  # submitter -> its ids, before its first write
        self.submits_in_progress: dict[str, list[str]] = {}  # submitter -> its ids, from its first write on
        self.waiting_log: list[tuple[str, float, float]] = []  # (worker, from, to): alive without a task
        self.batch_writers: set[str] = set()  # machines that wrote a batch marker (a submit that began its batch)
        #: (worker machine, task) -> [(its clock, generation)]: every listing that showed it the task's lease
        #: unfinished, in order (what invariant 6 judges a renewal by, never the worker's own flag)
        self.lease_views: dict[tuple[str, str], list[tuple[float, int]]] = collections.defaultdict(list)
        self.setting_up = True
        self._spawned = 0
        self.trace = hashlib.sha256()

    # -- machines

    def acting_machine(self) -> Machine | None:
        actor = self.scheduler.current
        return actor.machine if actor is not None and isinstance(actor.machine, Machine) else None

    def _gate(self, actor: Actor, at: float) -> float:
        machine = actor.machine
        if isinstance(machine, Machine):
            for start, end in machine.stops:
                if start <= at < end:
                    return end
        return at

    def kill(self, machine: Machine, why: str) -> None:
        """The machine dies: each of its actors gets Killed at its next turn (a request it has in flight
        is applied first: the store has it)."""
        if machine.dead:
            return
        machine.dead = True
        self.trace.update(f"{self.scheduler.now:.6f} kill {machine.name} {why}\n".encode())
        for actor in self.scheduler.actors_of(machine):
            self.scheduler.interrupt(actor, Killed(f"{machine.name} killed {why}"))

    def _suspension(self, at: float, machine: Machine, soon: bool = False) -> None:
        """Maybe suspend `machine` once inside the chaos window: its actors wait, its clock stands still."""
        c = self.config
        if self.rng.random() >= c.p_suspend:
            return
        length = self.rng.choice([c.lease_ttl_s / 2, 2 * c.lease_ttl_s, 1.5 * c.batch_keep_s])
        start = at + (self.rng.uniform(0.05, 0.5) if soon else self.rng.uniform(0, max(0.0, c.chaos_s - at)))
        machine.stops.append((start, start + length))
        machine.clock_stops = self.rng.random() < 0.5
        self.stats["suspended"] += 1

    # -- ground truth from every applied write

    def _stored(self, name: str, data: bytes, metadata: dict, generation: int, origin: object) -> None:
        now = self.scheduler.now
        self.trace.update(f"{now:.6f} {name} {generation}\n".encode())
        sender = origin.name if isinstance(origin, Machine) else None
        if sender in self.submits_starting:
            # Its first write is where a submit starts to exist for the workers: no protocol can see it sooner.
            self.submits_in_progress[sender] = self.submits_starting.pop(sender)
        if name.startswith(layout.BATCHES) and sender is not None:
            self.batch_writers.add(sender)
        if name.startswith(layout.TASKS):
            task_id = layout.id_from_object(name, layout.TASKS)
            if task_id is not None:
                self.created_at.setdefault(task_id, now)
                if self.scheduler.current is not None and self.scheduler.current.name == "store":
                    self.applied_late.add(task_id)
                if not self.setting_up and not self._covered_by_running_batch(task_id):
                    self.violation(9, f"task {task_id} was created while no running batch covers it "
                                      f"(sent by {sender}): its submit had finished the batch")  # fmt: skip
        elif name.startswith(layout.LEASES):
            task_id = layout.id_from_object(name, layout.LEASES)
            body = json.loads(data)
            self.first_claim_at.setdefault(task_id, now)
            self.committed[task_id].update(_key(r) for r in body.get("progress", []))

    def _listed(self, prefix: str, entries: list, origin: object) -> None:
        if prefix != layout.LEASES or not isinstance(origin, Machine) or origin.clock is None:
            return
        now = origin.clock.monotonic()
        for entry in entries:
            task_id = layout.id_from_object(entry.name, layout.LEASES)
            if task_id is not None and entry.metadata.get("state", "held") not in ("done", "dead"):
                self.lease_views[(origin.name, task_id)].append((now, entry.generation))

    def saw_renew(self, machine: str, task_id: str, generation: int) -> bool | None:
        """Whether `machine`'s listings showed the lease change to `generation` between two listings
        less than a TTL apart on its own clock (a renewal seen: its holder wrote within a TTL); None
        when the gap is too close to a TTL to tell (a listing's time here is when the store answered
        it, the worker's when it sent it: a slow request or a page more apart)."""
        views = self.lease_views.get((machine, task_id), [])
        first = next((i for i, (_, g) in enumerate(views) if g == generation), None)
        if first is None or first == 0:
            return False  # never listed at that generation, or first seen at it: nothing seen to change
        gap = views[first][0] - views[first - 1][0]
        ttl = self.config.lease_ttl_s
        if abs(gap - ttl) <= RENEW_MARGIN_S:
            return None
        return gap < ttl

    def _covered_by_running_batch(self, task_id: str) -> bool:
        key = layout.key(task_id)
        for name in self.store.names(layout.BATCHES):
            entry, _ = self.store.peek(name)
            first, last = entry.metadata.get("first"), entry.metadata.get("last")
            if first and last and entry.metadata.get("state") == layout.BATCH_RUNNING and layout.key(first) <= key <= layout.key(last):
                return True
        return False

    def violation(self, invariant: int, what: str) -> None:
        self.violations.append(Violation(invariant, f"t={self.scheduler.now:.1f}s {what}"))

    def marker_of(self, task_id: str) -> tuple[bool, bool]:
        return self.store.exists(layout.done_object(task_id)), self.store.exists(layout.failed_object(task_id))

    def existing_tasks(self) -> list[str]:
        return [t for t in (layout.id_from_object(n, layout.TASKS) for n in self.store.names(layout.TASKS)) if t]

    def unfinished(self) -> list[str]:
        pending = set(self.existing_tasks())
        for ids in self.submits_in_progress.values():
            pending.update(ids)
        return sorted(t for t in pending if not any(self.marker_of(t)))

    def lease_state(self, task_id: str) -> str | None:
        found = self.store.peek(layout.lease_object(task_id))
        return json.loads(found[1]).get("state") if found else None

    # -- actors

    def machine(self, at: float, fault_free: bool) -> None:
        self._spawned += 1
        name = f"w{self._spawned:02d}"
        c = self.config
        in_chaos = not fault_free and at < c.chaos_s
        kill_at = self.rng.randint(1, 400) if in_chaos and self.rng.random() < c.p_kill else None
        machine = self.machines[name] = Machine(name, kill_at, fault_free=fault_free or at >= c.chaos_s)
        if in_chaos and self.rng.random() < c.p_stop:
            when = at + self.rng.uniform(0, c.chaos_s)
            reason = self.rng.choice(["SIGTERM", "preempted"])
            self.scheduler.spawn(f"stop-{name}", lambda: self._stop(machine, reason), when)
        if in_chaos:
            self._suspension(at, machine)
        rate = self.rng.uniform(0.97, 1.03)
        seed = self.rng.randrange(2**32)
        self.scheduler.spawn(name, lambda: self._worker_main(machine, rate, seed), at, machine=machine)

    def _stop(self, machine: Machine, reason: str) -> None:
        if machine.dead or machine.claimer is None or machine.stop_reason is not None:
            return
        machine.stop_reason = reason
        machine.claimer.stop()

    def _replace(self, machine: Machine, why: str) -> None:
        """A preempted, killed or crashed machine comes back (a MIG recreates it, systemd restarts the worker)."""
        self.stats[why] += 1
        now = self.scheduler.now
        self.machine(now + self.rng.uniform(5, 30), fault_free=now >= self.config.chaos_s)

    def _worker_main(self, machine: Machine, rate: float, seed: int) -> None:
        worker = SimWorker(self, machine, rate, seed)
        try:
            reason = worker.run()
        except Killed:
            machine.dead = True
            worker.left_waiting()
            self._replace(machine, "killed")
            return
        except Runaway as exc:
            machine.dead = True
            self.violation(6, f"{machine.name} still running at the end of virtual time: {exc}")
            return
        except CRASHES as exc:  # a 403 escaped the claim loop: the worker crashed, systemd restarts it
            machine.dead = True
            worker.left_waiting()
            self.stats["crashed"] += 1
            self.trace.update(f"crash {machine.name} {exc!r}\n".encode())
            self._replace(machine, "crash_restart")
            return
        worker.left_waiting()
        self.stats[f"exit_{reason}"] += 1
        if reason == "stopped":
            self._replace(machine, "stopped")

    def _submit_later(self, batch: list[tuple[str, bytes]], name: str, at: float, tries: int = 1, chaos: bool = True) -> None:
        """`tools/submit.py` run at `at`: in the chaos window it may be killed (at a request, or at a
        moment) or interrupted once or twice (Ctrl-C, SIGTERM), at any point of its run."""
        c = self.config
        in_chaos = chaos and at < c.chaos_s
        kill_at = self.rng.randint(1, 2 * len(batch) + 4) if in_chaos and self.rng.random() < 0.2 else None
        machine = Machine(name, kill_at, fault_free=False)
        actor = self.scheduler.spawn(name, lambda: self._submitter(batch, machine, tries), at, machine=machine)
        # How long a submit of this size takes, roughly (its creates `submit_parallel` at a time, about 20 ms
        # each): kills and signals land anywhere in it, while its creates are in flight most often.
        span = 0.1 + 0.04 * len(batch) / c.submit_parallel
        if in_chaos and self.rng.random() < 0.15:
            when = at + self.rng.uniform(0, span)
            self.scheduler.spawn(f"kill-{name}", lambda: self.kill(machine, "at a moment"), when)
        if in_chaos and self.rng.random() < c.p_interrupt:
            first = at + self.rng.uniform(0.04, span)  # (its first 40 ms: the job's create and read, the batch's begin)
            signum = self.rng.choice(["SIGINT", "SIGTERM"])
            times = self.rng.choice([1, 2])
            gap = self.rng.choice([0.005, 0.05, 0.5])
            for k in range(times):
                when = first + k * gap
                self.scheduler.spawn(f"signal-{name}", lambda signum=signum: self._signal(machine, actor, signum), when)
            self.stats[f"interrupted_{times}x"] += 1

    def _signal(self, machine: Machine, actor: Actor, signum: str) -> None:
        """A signal to the submit's process: Python raises KeyboardInterrupt in its main thread
        (tools/submit.py turns SIGTERM into the same)."""
        if machine.submitting and not machine.dead:
            self.scheduler.interrupt(actor, KeyboardInterrupt(signum))

    def _submitter(self, batch: list[tuple[str, bytes]], machine: Machine, tries: int) -> None:
        """One run of `tools/submit.py`. One that dies, fails or is left running is run again later, the
        same command, as status tells its operator to (a refused task is submitted again under a new id)."""
        c = self.config
        name = machine.name
        self.machines[name] = machine
        ids = [t for t, _ in batch]
        self.submits_starting[name] = ids
        marker = batch_name(ids)
        machine.submitting = True
        pool = SimExecutor(self.scheduler, c.submit_parallel, name="create")
        ended = True  # it ended: rerun only if status names its batch as running
        try:
            submit(self.store, JOB, batch, c.submit_parallel, WorldClock(self.scheduler), executor=pool,
                   region_tasks=c.region_tasks, batch_keep_s=c.batch_keep_s)  # fmt: skip
        except Killed:
            machine.dead = True
            self.stats["submitter_killed"] += 1
            ended = False
        except KeyboardInterrupt as exc:
            self.stats["submit_interrupted"] += 1
            self._check_batch_finished(marker, name, exc)
        except SubmitError as exc:  # a task exists with another manifest: the rest of the batch is submitted
            self.stats["submit_refused"] += 1
            self._check_batch_finished(marker, name, exc)
            if "already exist" in str(exc):
                self._resubmit_refused(batch, name)
        except (StoreError, *CRASHES) as exc:  # a submit that failed (403, outage) must finish its batch first
            self.stats["submit_failed"] += 1
            self.trace.update(f"submit failed {exc!r}\n".encode())
            self._check_batch_finished(marker, name, exc)
            ended = False
        finally:
            machine.submitting = False
            self.submits_starting.pop(name, None)
            self.submits_in_progress.pop(name, None)
        if tries < 4:
            # Its operator runs it again if it did not complete, or once status names the batch as running
            # (a write the store applied late may begin it after the submit ended): a while later, after
            # the chaos by the last try.
            at = self.scheduler.now + self.rng.uniform(70, 300)
            at = max(at, c.chaos_s) if tries == 3 else at
            self.scheduler.spawn(f"operator-{name}", lambda: self._operator(batch, marker, name, ended, tries), at)

    def _operator(self, batch: list[tuple[str, bytes]], marker: str, name: str, ended: bool, tries: int) -> None:
        if not ended or self._running(marker):
            self._submit_later(batch, f"{name}r", self.scheduler.now, tries + 1, chaos=tries < 3)

    def _status(self, name: str) -> None:
        """Invariant 8: whenever `tools/status.py` says complete, every task in the store has a marker.

        The simulation runs one actor at a time and a listing is applied at one instant, so the store
        right after the snapshot returns is the store its last listing saw."""
        try:
            view = snapshot(self.store, now=EPOCH + dt.timedelta(seconds=self.scheduler.now))
        except (StoreError, *CRASHES):
            return  # an outage or a 403: status fails loudly, and says nothing about completion
        self.stats["status_looks"] += 1
        if view["complete"]:
            pending = [t for t in self.existing_tasks() if not any(self.marker_of(t))]
            if pending:
                self.violation(8, f"{name} says complete while {len(pending)} tasks lack a marker: {pending[:5]}")

    def _running(self, marker: str) -> bool:
        found = self.store.peek(marker)
        return found is not None and found[0].metadata.get("state") == layout.BATCH_RUNNING

    def _check_batch_finished(self, marker: str, name: str, exc: BaseException) -> None:
        """Invariant 7: a submit that failed after it began its batch, and could still write, leaves no
        batch running. One whose store refused the finishing writes too, or whose wait a second
        interrupt cut short, says so in a note (and is run again); one that failed before it began its
        batch has nothing to finish."""
        if name in self.batch_writers and self._running(marker) and not getattr(exc, "__notes__", None):
            self.violation(7, f"{name} failed ({exc!r}) and left its batch {marker} running without a word")

    def _resubmit_refused(self, batch: list[tuple[str, bytes]], name: str) -> None:
        """What the error tells its operator: the changed task again, under a new id."""
        changed = [(t, data) for t, data in batch if json.loads(data).get("changed")]
        renamed = [(f"{t}.v2", json.dumps({**json.loads(data), "id": f"{t}.v2"}).encode()) for t, data in changed]
        for t, _ in renamed:
            self.outputs[t] = self.rng.randint(0, 4)
        if renamed:
            self._submit_later(renamed, f"{name}v2", self.scheduler.now + self.rng.uniform(10, 200))

    def _lifecycle(self) -> None:
        """A lifecycle rule at work: now and then an object's storage class changes, moving its `updated`."""
        while self.scheduler.now < self.config.chaos_s + 400:
            self.scheduler.sleep(self.rng.uniform(5, 60))
            names = [n for p in (layout.BATCHES, layout.LEASES, layout.DONE, layout.SWEPT) for n in self.store.names(p)]
            if names:
                self.store.touch(self.rng.choice(names))
                self.stats["lifecycle_touches"] += 1

    def plan(self) -> None:
        c = self.config
        initial = [f"m{k:04d}" for k in range(c.tasks)]
        for t in initial:
            self.outputs[t] = self.rng.randint(0, 4)
        self.store.counting = False
        # The set-up runs before virtual time starts, outside every actor: nothing waits there.
        submit(self.store, JOB, [(t, json.dumps({"id": t}).encode()) for t in initial], clock=SetUpClock(self.scheduler),
               executor=InlineExecutor(), region_tasks=c.region_tasks, batch_keep_s=c.batch_keep_s)  # fmt: skip
        self.setting_up = False
        self.store.counting = True
        for _ in range(c.workers):
            self.machine(self.rng.uniform(0, 10), fault_free=False)
        for b in range(c.late_batches):
            size = self.rng.choice([1, 3, c.region_tasks + 1, 2 * c.region_tasks + 3])
            where = self.rng.choice(["before", "inside", "after"])
            prefix = {"before": "a", "inside": f"m{self.rng.randrange(max(1, c.tasks)):04d}.", "after": "z"}[where]
            batch = [(t, json.dumps({"id": t}).encode()) for t in (f"{prefix}{b}-{k:03d}" for k in range(size))]
            for t, _ in batch:
                self.outputs[t] = self.rng.randint(0, 4)
            if self.rng.random() < 0.2:
                # One task of the batch exists already with another manifest: the submit is refused for it.
                taken = f"m{self.rng.randrange(max(1, c.tasks)):04d}"
                batch.insert(self.rng.randrange(len(batch) + 1), (taken, json.dumps({"id": taken, "changed": b}).encode()))
            self._submit_later(batch, f"submit{b}", self.rng.uniform(0, c.chaos_s + 250))
        for k in range(STATUS_LOOKS):
            name = f"status{k}"
            at = self.rng.uniform(0, c.chaos_s + 400)
            machine = self.machines[name] = Machine(name, None, fault_free=False)
            if at < c.chaos_s:
                self._suspension(at, machine, soon=True)
            self.scheduler.spawn(name, lambda name=name: self._status(name), at, machine=machine)
        if c.lifecycle:
            self.scheduler.spawn("lifecycle", self._lifecycle, 0.0)

    def run(self, max_virtual_s: float = 50_000.0) -> None:
        self.plan()
        self.scheduler.run()
        # Closers: fault-free workers that finish what the fleet left (all of it may have left idle or died).
        for _ in range(2):
            if not self.unfinished() or self.scheduler.now > max_virtual_s:
                break
            self.stats["closers"] += 1
            self.machine(self.scheduler.now + 1, fault_free=True)
            self.scheduler.run()
        if self.config.straddle and not self.unfinished():
            self.straddle("status")
            self.straddle("worker")

    # -- a batch that comes and goes unseen

    def straddle(self, reader: str) -> None:
        """A batch comes and goes between the two listings of batches/ that `reader` (a status
        snapshot, or a fault-free worker's drained check on the finished queue) takes around its
        listings of the regions: submit A creates one task and finishes; a lifecycle rule moves the
        `updated` time of every older batch marker on (a storage class change: generations stay); then
        the submit that wrote one of them, whose machine paused after its `done` write and before its
        prune, prunes A's marker as older than the keep time. The two listings hold the same markers
        at the same generations, and only layout.PRUNED says a batch came and went
        (`layout.batch_unseen_between`): without it status says complete (invariant 8), the worker
        leaves drained (invariant 4), while A's task has no marker. Closers finish it afterwards."""
        c = self.config
        older = [n for n in self.store.names(layout.BATCHES) if n != layout.PRUNED and not self._running(n)]
        if not older:
            return
        pruner = older[0]
        task = f"zz-{reader}"
        self.outputs[task] = 0
        self.straddled.add(task)
        for name in older:
            self.store.touch(name)  # so that A's own prune deletes none of them: the reader would see that
        listed: list[str] = []
        came: list[bool] = []
        name = f"straddle-{reader}"
        machine = self.machines[name] = Machine(name, None, fault_free=True)

        def second_listing(prefix: str) -> None:
            if prefix != layout.BATCHES:
                listed.append(prefix)
                return
            since = listed[len(listed) - listed[::-1].index(layout.BATCHES):] if layout.BATCHES in listed else []
            # Status: its second listing of batches/. A worker: Claimer._drained's, after batches/ and the map
            # (splits/, then swept/, a page or more each).
            second = listed.count(layout.BATCHES) == 1 if reader == "status" else (
                since[-1:] == [layout.SWEPT] and since[:1] == [layout.SPLITS]
                and set(since) == {layout.SPLITS, layout.SWEPT})  # fmt: skip
            listed.append(prefix)
            if second and not came:
                came.append(True)
                self._come_and_go(task, pruner, machine)

        machine.before_listing = second_listing
        if reader == "status":
            self.scheduler.spawn(name, lambda: self._status(name), self.scheduler.now + 1, machine=machine)
        else:
            self.scheduler.spawn(name, lambda: self._worker_main(machine, 1.0, c.seed), self.scheduler.now + 1,
                                 machine=machine)  # fmt: skip
        self.scheduler.run()
        for _ in range(2):  # closers run what the straddled reader left
            if not self.unfinished():
                break
            self.machine(self.scheduler.now + 1, fault_free=True)
            self.scheduler.run()

    def _come_and_go(self, task: str, pruner: str, reader: Machine) -> None:
        """Run by the reader's actor just before its listing is sent: the reader waits meanwhile."""
        c = self.config
        before_listing, reader.before_listing = reader.before_listing, None  # its own requests here are not its reading
        started = self.scheduler.now
        submit(self.store, None, [(task, json.dumps({"id": task}).encode())], clock=WorldClock(self.scheduler),
               executor=InlineExecutor(), region_tasks=c.region_tasks, batch_keep_s=c.batch_keep_s)  # fmt: skip
        came = batch_name([task])
        self.scheduler.sleep(c.batch_keep_s + 2)
        for name in self.store.names(layout.BATCHES):
            if name != came and name != layout.PRUNED:
                self.store.touch(name)  # a rule for objects older than some age: A's marker is younger
        self.scheduler.sleep(2 * 5.0 + 1)  # past submit.PRUNE_EVERY_S of the last prune (at most twice it)
        prune_batches(self.store, pruner, c.batch_keep_s)
        if not self.store.exists(came):
            self.stats[f"straddled_{reader.name.removeprefix('straddle-')}"] += 1
        self.trace.update(f"straddle {reader.name} {started:.3f} {self.scheduler.now:.3f} {self.store.exists(came)}\n".encode())
        reader.before_listing = before_listing

    # -- the invariants at the end

    def check(self) -> None:
        tasks = self.existing_tasks()
        for t in tasks:
            done, failed = self.marker_of(t)
            if done and failed:
                self.violation(1, f"task {t} has both a done marker and a dead letter")
            elif not done and not failed:
                self.violation(1, f"task {t} has neither a done marker nor a dead letter (lease {self.lease_state(t)})")
        truth_counters: dict[str, int] = {}
        for t in tasks:
            found = self.store.peek(layout.done_object(t))
            if found is None:
                continue
            marker = json.loads(found[1])
            outputs = {_key(r) for r in marker["outputs"]}
            missing = self.committed[t] - outputs
            if missing:
                self.violation(3, f"task {t}: committed outputs missing from its done marker: {sorted(missing)[:3]}")
            for k, v in sum_counters(marker["outputs"]).items():
                truth_counters[k] = truth_counters.get(k, 0) + v
        self.store.faults = None
        view = snapshot(self.store, now=EPOCH + dt.timedelta(seconds=self.scheduler.now))
        done = sum(self.marker_of(t)[0] for t in tasks)
        failed = sum(self.marker_of(t)[1] and not self.marker_of(t)[0] for t in tasks)
        truth = {"total": len(tasks), "done": done, "failed": failed, "counters": truth_counters,
                 "complete": bool(tasks) and done + failed == len(tasks)}  # fmt: skip
        # Every submit that died or failed was run again, as status told its operator: none is left running.
        for name in self.store.names(layout.BATCHES):
            if self._running(name):
                self.violation(7, f"batch {name} is still running at the end, after every submit ended")
        seen = {k: view[k] for k in truth}
        if seen != truth:
            self.violation(5, f"status says {seen}, the store holds {truth}")
        self._check_pickup()

    def _check_pickup(self) -> None:
        c = self.config
        bound = c.pickup_bound_s
        for t, created in self.created_at.items():
            if created < c.chaos_s or t in self.applied_late or t in self.straddled:
                continue  # (a create applied late was sent in the chaos window; a straddled reader was held)
            claimed = self.first_claim_at.get(t, math.inf)
            if claimed - created <= bound:
                continue
            # Late only if some worker waited without a task over the whole bound (awake: a suspended VM
            # does not poll).
            waiter = next(
                (w for w, start, end in self.waiting_log if start <= created and end >= created + bound
                 and not any(s < created + bound and e > created for s, e in self.machines[w].stops)),
                None,
            )  # fmt: skip
            if waiter is not None:
                self.violation(6, f"task {t} submitted at {created:.1f}s was claimed at {claimed:.1f}s, "
                                  f"over the bound of {bound:.0f}s, while {waiter} waited without a task")  # fmt: skip


def _key(record: dict) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


class SimWorker:
    """The worker's shell in the simulation: what taskqueue.spawner.Spawner does, on virtual time."""

    def __init__(self, world: World, machine: Machine, rate: float, seed: int) -> None:
        c = world.config
        self.world, self.machine = world, machine
        self.store = world.store
        self.clock = WorldClock(world.scheduler, rate, machine.stops if machine.clock_stops else [])
        self.claimer = Claimer(
            self.store,
            ClaimOptions(machine.name, c.lease_ttl_s, c.idle_timeout_s, 1.0, c.poll_max_s, seed=seed,
                         max_loaded_regions=c.cached_regions),  # fmt: skip
            self.clock,
        )
        machine.claimer = self.claimer
        machine.clock = self.clock
        self.options = RunOptions(
            lease_ttl_s=c.lease_ttl_s, heartbeat_s=c.heartbeat_s, max_attempts=c.max_attempts, worker=machine.name,
            stuck_after_s=c.stuck_after_s,
        )  # fmt: skip
        self.tally = Tally()
        self.resident: SimResident | None = None  # the resident consumer, while the core keeps it
        self.resident_starts = 0

    def _now(self) -> float:
        return self.clock.monotonic()

    def _resident_for(self, task_id: str) -> SimResident:
        """The resident consumer for the next task: the kept one, or a fresh one if there is none or it died idle."""
        world, resident = self.world, self.resident
        if resident is not None and (resident.signalled or not resident.sound):
            world.violation(10, f"{resident.name} serves task {task_id} after it was signalled or said it was not "
                                f"sound (it served {resident.served})")  # fmt: skip
        if resident is not None and resident.dies_idle:
            world.stats["resident_died_idle"] += 1  # not an attempt of any task: a fresh process starts
            resident = None
        if resident is None:
            self.resident_starts += 1
            world.stats["resident_starts"] += 1
            resident = SimResident(world, self.machine.name, self.resident_starts)
        self.resident = resident
        resident.served.append(task_id)
        return resident

    def left_waiting(self) -> None:
        m = self.machine
        if m.waiting_since is not None:
            self.world.waiting_log.append((m.name, m.waiting_since, self.world.scheduler.now))
            m.waiting_since = None

    def run(self) -> str:
        world, m = self.world, self.machine
        m.waiting_since = world.scheduler.now
        for claim in self.claimer:
            self.left_waiting()
            self.handle(claim)
            if m.stop_reason is not None:
                break
            m.waiting_since = world.scheduler.now
        reason = "stopped" if m.stop_reason is not None else self.claimer.exit_reason
        if reason == "drained":
            unfinished = world.unfinished()
            if unfinished:
                world.violation(4, f"{m.name} exited drained while {len(unfinished)} tasks lack a marker: {unfinished[:5]}")
        if reason == "idle":
            self._check_idle_exit()
        return reason

    def _check_idle_exit(self) -> None:
        world = self.world
        now = world.scheduler.now
        if now < world.config.chaos_s + world.config.pickup_bound_s:
            return  # faults may keep a worker from seeing work; liveness is checked on a quiet store
        bound = world.config.pickup_bound_s
        for t in world.unfinished():
            found = world.store.peek(layout.lease_object(t))
            since = world.store.last_mutated(layout.lease_object(t))
            since = since if since is not None else world.created_at.get(t, now)
            lease = json.loads(found[1]) if found else None
            state = lease["state"] if lease else None
            expired = state == "held" and now - since > world.config.lease_ttl_s * 1.1 + bound
            if (state in (None, "released") and now - since > bound) or expired:
                world.violation(6, f"{self.machine.name} exited idle while task {t} was claimable "
                                   f"(lease {state}, unchanged for {now - since:.0f}s)")  # fmt: skip
                return
            holder = world.machines.get(lease["worker"]) if state == "held" else None
            if state == "held" and (holder is None or holder.dead or holder.running != t):
                # Nobody runs the task: only a worker that watches the lease for its TTL can take it over.
                # Leaving is fine only beside a lease seen renewing (its holder may have died since: no
                # rule can tell); one the worker never watched for a TTL may be stranded for good.
                # Judged from what the store answered the worker's listings, not from its own flag
                # (Sighting.renewed), which a broken rule would set as readily as it reads it.
                if world.saw_renew(self.machine.name, t, found[0].generation) is False:
                    sighting = self.claimer.view.leases.get(t)
                    world.violation(6, f"{self.machine.name} exited idle beside task {t}'s lease, held by "
                                       f"{lease['worker']} who runs it no more, never seen renewing "
                                       f"nor watched for its TTL (sighting {sighting})")  # fmt: skip
                    return

    def _settle(self, run: TaskRun, lease, action) -> None:
        self.machine.running = None  # whatever the final write's outcome, this shell runs the task no more
        result = perform_final(lease, action, run.started)
        run.settled(action, result)
        self.world.stats[f"result_{result}"] += 1

    def handle(self, claim) -> None:
        world, lease = self.world, claim.lease
        self.machine.running = claim.task_id
        run = TaskRun(claim.task_id, lease.attempt, self.options, self._now(), self.tally, sent=lease.last_write)
        verdict = verdict_before_start(int(lease.body.get("takeovers", 0)), claim.problem if claim.manifest is None else None)
        if verdict is not None:
            self._settle(run, lease, DeadLetter(verdict, (), None))
            return
        try:
            self.store.read(layout.JOB)
        except NotFound:
            pass
        except Exception as exc:  # noqa: BLE001 - as the spawner: the consumer cannot start, give the task back
            self._settle(run, lease, run.start_failed(exc))
            return
        stale = run.stale(self._now())
        if stale is not None:
            self.world.stats["stale_claims"] += 1
            self._settle(run, lease, stale)
            return
        if world.marker_of(claim.task_id)[0]:
            current = world.store.peek(layout.lease_object(claim.task_id))
            if self.machine.clock_stops and current is not None and current[0].generation != lease.generation:
                # Its clock stood still while it was suspended past the TTL: it cannot tell its claim is stale.
                # The lease is someone else's already: its first heartbeat is refused, and nothing it does counts.
                world.stats["started_on_a_lost_lease"] += 1
            else:
                world.violation(2, f"{self.machine.name} starts a consumer on task {claim.task_id}, which has a done marker")
        consumer = ScriptedConsumer(world, claim.task_id, lease.attempt, lease.token, len(lease.committed), self._now())
        resident = self._resident_for(claim.task_id) if world.config.resident else None
        if resident is not None and len(resident.served) > 1:
            world.stats["resident_warm_tasks"] += 1
        next_beat = self._now() + self.options.heartbeat_s
        stop_told = False
        for turn in itertools.count():
            if consumer.exit_code is not None:
                break
            if turn > 100_000:
                raise Runaway(f"{self.machine.name}'s shell went round {turn} times on task {claim.task_id}")
            now = self._now()
            if self.machine.stop_reason is not None and not stop_told:
                stop_told = True
                self._signal(consumer, run.stop(self.machine.stop_reason, now))
            run.progress(consumer.advance(self.store, now), now)
            if consumer.exit_code is not None:
                break
            if now >= next_beat:
                next_beat = now + self.options.heartbeat_s
                renew = run.heartbeat()
                if renew is not None:
                    try:
                        perform_renew(lease, renew)
                    except Exception as exc:  # noqa: BLE001 - as the spawner's heartbeat thread: the core decides
                        self._signal(consumer, run.renewal_failed(exc, self._now()))
                    else:
                        run.renewed(renew, self._now())
            self._signal(consumer, run.tick(self._now()))
            if consumer.exit_code is not None:
                break
            wake = min(next_beat, consumer.wake_at(), self._now() + TICK_S)
            self.clock.wait(threading.Event(), max(0.0, wake - self._now()))
        run.progress(consumer.advance(self.store, self._now()), self._now())
        exit_code = consumer.exit_code
        if resident is not None:  # as Spawner._run_resident: the reply's code, else the process's; kept if the core says
            reply_code, stays = resident.reply(consumer)
            exit_code = resident_exit_code(reply_code, None if reply_code is not None else consumer.exit_code)
            resident.sound = stays
            if not run.consumer_stays(stays):
                self.resident = None
        error = {"attempt": lease.attempt, "worker": self.machine.name, "exit_code": exit_code, "error": ""}
        action = run.exited(exit_code, error)
        self._settle(run, lease, action)
        if run.phase is not Phase.SETTLED:
            raise AssertionError("the core did not settle")

    def _signal(self, consumer: ScriptedConsumer, actions: list[Signal]) -> None:
        for action in actions:
            consumer.signal(action.signum, self._now())
            if self.resident is not None:
                self.resident.signalled = True


# -- running seeds ---------------------------------------------------------------------------------

#: Seeds below this were run by hand (0 to 300,000, and 7,300,000 to 7,321,999); the moving range CI
#: runs starts above it.
FRESH_FROM = 1_000_000
FRESH_SPAN = 1_000_000_000
SOURCES = ("taskqueue", "objectstore", "reporting", "tests/simworld")  # what the fallback hashes


def moving_start(root: pathlib.Path = REPO) -> tuple[int, str]:
    """A first seed that changes with every commit, so that every CI run explores seeds no earlier
    run has, and the same commit always gets the same ones (a failure replays); and where it came
    from. Made from `git rev-parse HEAD`; outside a git checkout, from a hash of the sources the
    simulation runs; `SIM_SEED_START` sets it instead."""
    if os.environ.get("SIM_SEED_START"):
        return int(os.environ["SIM_SEED_START"]), "SIM_SEED_START"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()  # fmt: skip
        origin = f"commit {head[:12]}"
    except (OSError, subprocess.SubprocessError):
        digest = hashlib.sha256()
        for path in sorted(p for d in SOURCES for p in (root / d).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
        head, origin = digest.hexdigest(), "hash of the sources (no git checkout)"
    return FRESH_FROM + int(hashlib.sha256(head.encode()).hexdigest()[:15], 16) % FRESH_SPAN, origin


def run_seed(seed: int) -> Result:
    config = WorldConfig.draw(seed)
    world = World(config)
    try:
        world.run()
        world.check()
    except RuntimeError as exc:  # an actor raised something the world did not expect: that is a finding too
        cause = exc.__cause__ or exc
        world.violations.append(Violation(0, f"{exc}: {cause!r}"))
    return Result(seed, world.violations, world.trace.hexdigest()[:16], world.scheduler.now, len(world.existing_tasks()),
                  dict(world.stats))  # fmt: skip

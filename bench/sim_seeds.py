"""The deterministic simulation of whole workers: one seed fixes every delay, fault, crash and submission.

    python -m bench.sim_seeds --seeds 100000 [--start 0]     # many seeds; prints seeds per second
    python -m bench.sim_seeds --seed 1234 --verbose          # replay one seed, with the workers' logs

In the spirit of FoundationDB's simulator and TigerBeetle's VOPR, the code under test is the
production code: `Claimer`, `HeldLease`, `submit`, `status.snapshot`, the worker core
(`taskqueue.worker.TaskRun`, the same decisions `taskqueue.spawner` makes) and the store's retry loop
and ambiguous-write rule (`objectstore.retry`, what `objectstore.gcs` runs). Around them it puts a
simulated world on virtual time (bench/fleet_sim.py's `Scheduler` and `SimStore`, which follows GCS's
documented semantics: generations, preconditions, strongly consistent listings with offsets and pages
of 1000, about one write per second per object), and a scripted consumer in place of the subprocess.
Only one actor runs at a time, so a seed replays exactly.

What a seed draws:
- a few workers (each with a clock that runs a few percent fast or slow), tens of tasks, and regions
  of `REGION_TASKS` tasks (instead of 1000, so that tens of tasks make several regions); in half the
  worlds the workers cache 2 or 3 regions instead of 8, so that their view drops regions all the time;
- store faults during a chaos window: transient errors (some outages outlast the retry deadline),
  ambiguous writes (applied, then the response lost, or returned late), non-transient errors (403,
  an expired credential) on any call;
- machines killed at any request (between the done marker and the tombstone included), SIGTERM and
  preemption at any time, replacements booting after them;
- each attempt's consumer: outputs written, then exit 0, 1 or 65, a crash, or a hang (the stuck-task
  backstop stops it), and how it answers SIGTERM;
- late submissions of any size, before the first split, into existing regions and after the last,
  while workers run, wait or leave; a submitter killed halfway, and one refused because a task of its
  batch exists with another manifest. What status tells their operator is done: a submit that died
  or failed is run again (the same command), a refused task is submitted again under a new id;
- `tools/status.py` snapshots at random times, on the same faulty store;
- done batch markers deleted after BATCH_KEEP_S (two minutes here, so that a world sees it).

Invariants, checked for every seed (`Violation.invariant` is the number):
1. every task that exists has exactly one done marker or exactly one dead letter (never both, never
   neither), once the fleet (plus fault-free closers) has finished;
2. no consumer starts on a task whose done marker exists;
3. every output a lease write committed is in the done marker;
4. no worker exits `drained` while a task lacks a marker, counting every task of a submit in progress
   (from its first applied write on: before that no worker can know of it);
5. `reporting.status.snapshot`'s totals, counters and `complete` at the end equal the ground truth;
6. liveness: a task submitted after the chaos window, while some worker has been waiting without a
   task, is claimed within `pickup_bound_s` (two poll caps plus 10 s); no worker exits `idle` while
   a task nobody holds has been claimable for longer than that bound, nor beside a lease that nobody
   runs (its holder died or moved on) which it has neither seen renew nor watched for its TTL;
7. no batch marker outlives its submitter's failure: a submit that began its batch and then failed
   leaves it `running` only if the store refused the finishing writes too, and says so; at the end,
   after the runs again, no batch is `running`;
8. whenever a status snapshot says `complete`, every task in the store has its marker.

The seeds CI runs: 0 to 199, and 200 from a start that moves with the commit (`moving_start`).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import hashlib
import itertools
import json
import logging
import math
import os
import pathlib
import random
import signal as signals
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from unittest import mock

from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exceptions

from bench import fleet_sim
from bench.fleet_sim import EPOCH, Faults, InlineExecutor, Limits, Scheduler, SimStore
from objectstore.base import NotFound, StoreError
from taskqueue import claims, layout
from taskqueue.claims import Claimer, ClaimOptions, default_poll_max
from taskqueue.lease import sum_counters
from reporting.status import snapshot
from taskqueue.submit import SubmitError, batch_name, submit
from taskqueue.worker import (
    DeadLetter,
    Phase,
    RunOptions,
    Signal,
    Tally,
    TaskRun,
    perform_final,
    perform_renew,
    verdict_before_start,
)

REPO = pathlib.Path(__file__).resolve().parent.parent
REGION_TASKS = 8
BATCH_KEEP_S = 120.0  # done batch markers deleted after two minutes, not ten: a world sees it happen
STATUS_LOOKS = 6  # snapshots taken by status at random times of a world (invariant 8)
TICK_S = 2.0  # how often the simulated shell ticks the core while a consumer runs (the real one: 0.2 s)
JOB = json.dumps({"name": "sim"}).encode()


class Killed(BaseException):
    """The machine died: raised at a request and unwinding its actor. A BaseException, so that no
    `except Exception` in the production code can catch it (a dead machine runs no handler)."""


class Runaway(BaseException):
    """Virtual time ran past MAX_VIRTUAL_S: something waits or retries forever (a liveness failure)."""


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
    chaos_s: float  # faults, kills and stops happen before this; replacements after it are fault-free
    p_transient: float
    p_lost: float
    p_late: float
    p_forbidden: float
    outages: tuple[tuple[float, float], ...]  # (start, seconds) windows in which every request fails transiently
    retry_deadline_s: float
    p_kill: float  # chance a worker machine is killed at some request
    p_stop: float  # chance a worker gets SIGTERM or a preemption notice at some time
    late_batches: int
    cached_regions: int  # the claim loop's cache of loaded regions (MAX_LOADED_REGIONS): small ones evict often

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
            p_forbidden=rng.choice([0.0, 0.0, 0.005]),
            outages=outages,
            retry_deadline_s=rng.choice([10.0, 30.0]),
            p_kill=rng.choice([0.0, 0.3]),
            p_stop=rng.choice([0.0, 0.3]),
            late_batches=rng.choice([0, 1, 2, 3]),
            cached_regions=rng.choice([claims.MAX_LOADED_REGIONS, claims.MAX_LOADED_REGIONS, 3, 2]),
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


class SeedFaults(Faults):
    """The store's faults for one seed: per attempt, by the acting machine, inside the chaos window."""

    def __init__(self, world: "World") -> None:
        self.world = world
        self.rng = random.Random(f"faults-{world.config.seed}")
        self.late_s = 0.0

    def before(self, op: str, name: str) -> None:
        world = self.world
        if world.scheduler.now > MAX_VIRTUAL_S:
            raise Runaway(f"{op} {name} at virtual {world.scheduler.now:.0f}s")
        actor = world.scheduler.current
        machine = world.machines.get(actor.name) if actor is not None else None
        if machine is not None:
            machine.requests += 1
            if machine.dead or (machine.kill_at is not None and machine.requests >= machine.kill_at):
                machine.dead = True
                raise Killed(f"{machine.name} killed at request {machine.requests} ({op} {name})")

    def draw(self, op: str, name: str) -> str | None:
        world, c = self.world, self.world.config
        actor = world.scheduler.current
        machine = world.machines.get(actor.name) if actor is not None else None
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
        return None


class SetUpClock(fleet_sim.SimClock):
    """Virtual time that stands still: the world's set-up, before any actor runs."""

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        return stop.is_set()


class SimClock(fleet_sim.SimClock):
    """A worker's clock on virtual time, running at its own rate, that stops a runaway seed."""

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        if self.scheduler.now > MAX_VIRTUAL_S:
            raise Runaway(f"a wait at virtual {self.scheduler.now:.0f}s")
        return super().wait(stop, seconds)


@dataclasses.dataclass
class Machine:
    name: str
    kill_at: int | None  # killed at this request (its own count), if ever
    fault_free: bool
    requests: int = 0
    dead: bool = False
    stop_reason: str | None = None
    claimer: Claimer | None = None
    waiting_since: float | None = None  # alive and without a task since
    running: str | None = None  # the task its shell runs now


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


class World:
    def __init__(self, config: WorldConfig) -> None:
        self.config = config
        self.rng = random.Random(f"world-{config.seed}")
        self.scheduler = Scheduler()
        limits = Limits(latency_s=0.02, retry_initial_s=0.1, retry_cap_s=4.0, retry_deadline_s=config.retry_deadline_s)
        self.faults = SeedFaults(self)
        self.store = SimStore(self.scheduler, limits, config.seed, faults=self.faults)
        self.store.on_stored = self._stored
        self.machines: dict[str, Machine] = {}
        self.violations: list[Violation] = []
        self.stats: collections.Counter[str] = collections.Counter()
        self.outputs: dict[str, int] = {}  # task -> outputs its consumer writes in all
        self.created_at: dict[str, float] = {}
        self.first_claim_at: dict[str, float] = {}
        self.committed: dict[str, set[str]] = collections.defaultdict(set)  # task -> records a lease write carried
        self.submits_starting: dict[str, list[str]] = {}  # submitter -> its ids, before its first write
        self.submits_in_progress: dict[str, list[str]] = {}  # submitter -> its ids, from its first write on
        self.waiting_log: list[tuple[str, float, float]] = []  # (worker, from, to): alive without a task
        self.batch_writers: set[str] = set()  # actors that wrote a batch marker (a submit that began its batch)
        self._spawned = 0
        self.trace = hashlib.sha256()

    # -- ground truth from every applied write

    def _stored(self, name: str, data: bytes, generation: int) -> None:
        now = self.scheduler.now
        self.trace.update(f"{now:.6f} {name} {generation}\n".encode())
        actor = self.scheduler.current
        if actor is not None and actor.name in self.submits_starting:
            # Its first write is where a submit starts to exist for the workers: no protocol can see it sooner.
            self.submits_in_progress[actor.name] = self.submits_starting.pop(actor.name)
        if name.startswith(layout.BATCHES) and actor is not None:
            self.batch_writers.add(actor.name)
        if name.startswith(layout.TASKS):
            task_id = layout.id_from_object(name, layout.TASKS)
            if task_id is not None:
                self.created_at.setdefault(task_id, now)
        elif name.startswith(layout.LEASES):
            task_id = layout.id_from_object(name, layout.LEASES)
            body = json.loads(data)
            self.first_claim_at.setdefault(task_id, now)
            self.committed[task_id].update(_key(r) for r in body.get("progress", []))

    def violation(self, invariant: int, what: str) -> None:
        self.violations.append(Violation(invariant, f"t={self.scheduler.now:.1f}s {what}"))

    def marker_of(self, task_id: str) -> tuple[bool, bool]:
        return layout.done_object(task_id) in self.store.entries, layout.failed_object(task_id) in self.store.entries

    def existing_tasks(self) -> list[str]:
        return [t for t in (layout.id_from_object(n, layout.TASKS) for n in self.store.names[layout.TASKS]) if t]

    def unfinished(self) -> list[str]:
        pending = set(self.existing_tasks())
        for ids in self.submits_in_progress.values():
            pending.update(ids)
        return sorted(t for t in pending if not any(self.marker_of(t)))

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
        rate = self.rng.uniform(0.97, 1.03)
        seed = self.rng.randrange(2**32)
        self.scheduler.spawn(name, lambda: self._worker_main(machine, rate, seed), at)

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

    def _submitter(self, batch: list[tuple[str, bytes]], kill_at: int | None, name: str, tries: int = 1) -> None:
        """One run of `tools/submit.py`. One that dies or fails is run again later, the same command,
        as status tells its operator to (a refused task is submitted again under a new id instead)."""
        machine = self.machines[name] = Machine(name, kill_at, fault_free=False)
        ids = [t for t, _ in batch]
        self.submits_starting[name] = ids
        marker = batch_name(ids)
        again = False
        try:
            submit(self.store, JOB, batch, parallel=1, clock=SimClock(self.scheduler, 1.0))
        except Killed:
            machine.dead = True
            self.stats["submitter_killed"] += 1
            again = True
        except SubmitError as exc:  # a task exists with another manifest: the rest of the batch is submitted
            self.stats["submit_refused"] += 1
            self._check_batch_finished(marker, name, exc)
            if "already exist" in str(exc):
                self._resubmit_refused(batch, name)
            again = self._running(marker)
        except (StoreError, *CRASHES) as exc:  # a submit that failed (403, outage) must finish its batch first
            self.stats["submit_failed"] += 1
            self.trace.update(f"submit failed {exc!r}\n".encode())
            self._check_batch_finished(marker, name, exc)
            again = True
        finally:
            self.submits_starting.pop(name, None)
            self.submits_in_progress.pop(name, None)
        if again and tries < 4:
            # Its operator runs it again once status names the batch: later, after the chaos by the last try.
            at = self.scheduler.now + self.rng.uniform(20, 300)
            at = max(at, self.config.chaos_s) if tries == 3 else at
            rerun = f"{name}r"
            self.scheduler.spawn(rerun, lambda: self._submitter(batch, None, rerun, tries + 1), at)

    def _status(self, name: str) -> None:
        """Invariant 8: whenever `tools/status.py` says complete, every task in the store has a marker.

        The simulation runs one actor at a time and a listing is applied at one instant, so the store
        right after the snapshot returns is the store its last listing saw."""
        self.machines[name] = Machine(name, None, fault_free=False)
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
        entry = self.store.entries.get(marker)
        return entry is not None and entry.metadata.get("state") != layout.BATCH_DONE

    def _check_batch_finished(self, marker: str, name: str, exc: BaseException) -> None:
        """Invariant 7: a submit that failed after it began its batch, and could still write, leaves no
        batch running. One whose store refused the finishing writes too says so in a note (and is run
        again); one that failed before it began its batch has nothing to finish."""
        if name in self.batch_writers and self._running(marker) and not getattr(exc, "__notes__", None):
            self.violation(7, f"{name} failed ({exc!r}) and left its batch {marker} running without a word")

    def _resubmit_refused(self, batch: list[tuple[str, bytes]], name: str) -> None:
        """What the error tells its operator: the changed task again, under a new id."""
        changed = [(t, data) for t, data in batch if json.loads(data).get("changed")]
        renamed = [(f"{t}.v2", json.dumps({**json.loads(data), "id": f"{t}.v2"}).encode()) for t, data in changed]
        for t, _ in renamed:
            self.outputs[t] = self.rng.randint(0, 4)
        rename = f"{name}v2"
        if renamed:
            self.scheduler.spawn(rename, lambda: self._submitter(renamed, None, rename), self.scheduler.now + self.rng.uniform(10, 200))

    def plan(self) -> None:
        c = self.config
        initial = [f"m{k:04d}" for k in range(c.tasks)]
        for t in initial:
            self.outputs[t] = self.rng.randint(0, 4)
        self.store.counting = False
        # The set-up runs before virtual time starts, outside every actor: nothing waits there.
        submit(self.store, JOB, [(t, json.dumps({"id": t}).encode()) for t in initial], parallel=1, clock=SetUpClock(self.scheduler))
        self.store.counting = True
        for k in range(c.workers):
            self.machine(self.rng.uniform(0, 10), fault_free=False)
        for b in range(c.late_batches):
            size = self.rng.choice([1, 3, REGION_TASKS + 1, 2 * REGION_TASKS + 3])
            where = self.rng.choice(["before", "inside", "after"])
            prefix = {"before": "a", "inside": f"m{self.rng.randrange(max(1, c.tasks)):04d}.", "after": "z"}[where]
            batch = [(t, json.dumps({"id": t}).encode()) for t in (f"{prefix}{b}-{k:03d}" for k in range(size))]
            for t, _ in batch:
                self.outputs[t] = self.rng.randint(0, 4)
            if self.rng.random() < 0.2:
                # One task of the batch exists already with another manifest: the submit is refused for it.
                taken = f"m{self.rng.randrange(max(1, c.tasks)):04d}"
                batch.insert(self.rng.randrange(len(batch) + 1), (taken, json.dumps({"id": taken, "changed": b}).encode()))
            at = self.rng.uniform(0, c.chaos_s + 250)
            kill_at = self.rng.randint(1, 2 * size + 4) if at < c.chaos_s and self.rng.random() < 0.3 else None
            name = f"submit{b}"
            self.scheduler.spawn(name, lambda batch=batch, kill_at=kill_at, name=name: self._submitter(batch, kill_at, name), at)
        for k in range(STATUS_LOOKS):
            name = f"status{k}"
            self.scheduler.spawn(name, lambda name=name: self._status(name), self.rng.uniform(0, c.chaos_s + 400))

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
        self.scheduler.current = None

    # -- the invariants at the end

    def check(self) -> None:
        tasks = self.existing_tasks()
        for t in tasks:
            done, failed = self.marker_of(t)
            if done and failed:
                self.violation(1, f"task {t} has both a done marker and a dead letter")
            elif not done and not failed:
                lease = self.store.data.get(layout.lease_object(t))
                state = json.loads(lease).get("state") if lease else None
                self.violation(1, f"task {t} has neither a done marker nor a dead letter (lease {state})")
        truth_counters: dict[str, int] = {}
        for t in tasks:
            data = self.store.data.get(layout.done_object(t))
            if data is None:
                continue
            marker = json.loads(data)
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
        for name in self.store.names.get(layout.BATCHES, []):
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
            if created < c.chaos_s:
                continue
            claimed = self.first_claim_at.get(t, math.inf)
            if claimed - created <= bound:
                continue
            # Late only if some worker waited without a task over the whole bound.
            waiter = next(
                (w for w, start, end in self.waiting_log if start <= created and end >= created + bound), None
            )
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
        self.clock = SimClock(world.scheduler, rate)
        self.claimer = Claimer(
            self.store,
            ClaimOptions(machine.name, c.lease_ttl_s, c.idle_timeout_s, 1.0, c.poll_max_s, seed=seed),
            self.clock,
        )
        machine.claimer = self.claimer
        self.options = RunOptions(
            lease_ttl_s=c.lease_ttl_s, heartbeat_s=c.heartbeat_s, max_attempts=c.max_attempts, worker=machine.name,
            stuck_after_s=c.stuck_after_s,
        )  # fmt: skip
        self.tally = Tally()

    def _now(self) -> float:
        return self.clock.monotonic()

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
            lease = world.store.data.get(layout.lease_object(t))
            since = world.store.last_mutation.get(layout.lease_object(t), world.created_at.get(t, now))
            state = json.loads(lease)["state"] if lease else None
            expired = state == "held" and now - since > world.config.lease_ttl_s * 1.1 + bound
            if (state in (None, "released") and now - since > bound) or expired:
                world.violation(6, f"{self.machine.name} exited idle while task {t} was claimable "
                                   f"(lease {state}, unchanged for {now - since:.0f}s)")  # fmt: skip
                return
            holder = world.machines.get(json.loads(lease)["worker"]) if state == "held" else None
            if state == "held" and (holder is None or holder.dead or holder.running != t):
                # Nobody runs the task: only a worker that watches the lease for its TTL can take it over.
                # Leaving is fine only beside a lease seen renewing (its holder may have died since: no
                # rule can tell); one the worker never watched for a TTL may be stranded for good.
                sighting = self.claimer.view.leases.get(t)
                if sighting is None or not sighting.renewed:
                    world.violation(6, f"{self.machine.name} exited idle beside task {t}'s lease, held by "
                                       f"{json.loads(lease)['worker']} who runs it no more, never seen renewing "
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
        run = TaskRun(claim.task_id, lease.attempt, self.options, self._now(), self.tally)
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
        if world.marker_of(claim.task_id)[0]:
            world.violation(2, f"{self.machine.name} starts a consumer on task {claim.task_id}, which has a done marker")
        consumer = ScriptedConsumer(world, claim.task_id, lease.attempt, lease.token, len(lease.committed), self._now())
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
        error = {"attempt": lease.attempt, "worker": self.machine.name, "exit_code": consumer.exit_code, "error": ""}
        action = run.exited(consumer.exit_code, error)
        self._settle(run, lease, action)
        if run.phase is not Phase.SETTLED:
            raise AssertionError("the core did not settle")

    def _signal(self, consumer: ScriptedConsumer, actions: list[Signal]) -> None:
        for action in actions:
            consumer.signal(action.signum, self._now())


# -- running seeds ---------------------------------------------------------------------------------


@contextlib.contextmanager
def small_regions() -> Iterator[None]:
    """Regions of REGION_TASKS tasks instead of 1000, so that a world of tens of tasks has several, and
    done batch markers kept BATCH_KEEP_S, so that a world of minutes sees them deleted."""
    saved = layout.REGION_TASKS, layout.BATCH_KEEP_S
    layout.REGION_TASKS, layout.BATCH_KEEP_S = REGION_TASKS, BATCH_KEEP_S
    try:
        yield
    finally:
        layout.REGION_TASKS, layout.BATCH_KEEP_S = saved


#: Seeds below this were run by hand (0 to 300,000); the moving range CI runs starts above it.
FRESH_FROM = 1_000_000
FRESH_SPAN = 1_000_000_000
SOURCES = ("taskqueue", "objectstore", "bench")  # what the fallback hashes: the code a seed exercises


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
    with small_regions(), mock.patch.object(concurrent.futures, "ThreadPoolExecutor", InlineExecutor), \
            mock.patch.object(claims, "MAX_LOADED_REGIONS", config.cached_regions):
        try:
            world.run()
            world.check()
        except RuntimeError as exc:  # an actor raised something the world did not expect: that is a finding too
            cause = exc.__cause__ or exc
            world.violations.append(Violation(0, f"{exc}: {cause!r}"))
    return Result(seed, world.violations, world.trace.hexdigest()[:16], world.scheduler.now, len(world.existing_tasks()),
                  dict(world.stats))  # fmt: skip


def _quiet_seed(seed: int) -> Result:
    quiet()
    return run_seed(seed)


def _results(seeds, jobs: int) -> Iterator[Result]:
    """Results in seed order; with `jobs` > 1 from that many processes (each seed is independent)."""
    if jobs <= 1:
        yield from map(run_seed, seeds)
        return
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        yield from pool.map(_quiet_seed, seeds, chunksize=16)


def quiet() -> None:
    for noisy in ("taskqueue", "objectstore", "consumer"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=1000, help="how many seeds to run")
    p.add_argument("--start", type=int, default=0, help="the first seed")
    p.add_argument("--seed", type=int, default=None, help="replay this one seed")
    p.add_argument("--verbose", action="store_true", help="the workers' logs (for a replay)")
    p.add_argument("--max-failures", type=int, default=20, help="stop after this many failing seeds")
    p.add_argument("--jobs", type=int, default=1, help="processes running seeds side by side")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(threadName)s %(message)s")
    if not args.verbose:
        quiet()
    seeds = [args.seed] if args.seed is not None else range(args.start, args.start + args.seeds)
    started = time.monotonic()
    failures: collections.Counter[int] = collections.Counter()
    ran = 0
    failing = 0
    for result in _results(seeds, args.jobs):
        seed = result.seed
        ran += 1
        if args.seed is not None:
            print(json.dumps({"seed": seed, "config": dataclasses.asdict(WorldConfig.draw(seed)), "tasks": result.tasks,
                              "virtual_s": round(result.virtual_s, 1), "digest": result.digest, "stats": result.stats}))  # fmt: skip
        if not result.ok:
            failing += 1
            for v in result.violations:
                failures[v.invariant] += 1
            print(f"FAIL seed={seed} replay: {result.replay_command()}")
            for v in result.violations[:5]:
                print(f"  {v}")
            if failing >= args.max_failures and args.seed is None:
                break
    elapsed = time.monotonic() - started
    print(f"seeds={ran} failing={failing} by_invariant={dict(sorted(failures.items()))} seconds={elapsed:.1f} "
          f"seeds_per_s={ran / elapsed:.1f}")  # fmt: skip
    sys.exit(1 if failing else 0)


if __name__ == "__main__":
    main()

"""The seeded world: a simulated store and the machines, submitters and status looks that act on it, on
virtual time, and the ground truth the invariants are judged by (tests.simworld.invariants)."""

from __future__ import annotations

import collections
import datetime as dt
import hashlib
import json
import random
from typing import TYPE_CHECKING

from objectstore.base import StoreError
from reporting.status import snapshot
from taskqueue import layout
from taskqueue.submit import submit
from tests.simworld.faults import CRASHES, Killed, Machine, Runaway, SeedFaults, SetUpClock
from tests.simworld.invariants import (
    Violation,
    invariant_1,
    invariant_3,
    invariant_5,
    invariant_6_pickup,
    invariant_7_end,
    invariant_8,
    invariant_9,
    record_key,
)
from tests.simworld.scheduler import EPOCH, Actor, InlineExecutor, Scheduler
from tests.simworld.store import Limits, SimStore
from tests.simworld.straddle import straddle
from tests.simworld.submitters import JOB, submit_later
from tests.simworld.worker import SimWorker

if TYPE_CHECKING:
    from tests.simworld.seeds import WorldConfig

STATUS_LOOKS = 6  # snapshots taken by status at random times of a world (invariant 8)


class World:
    """A seeded world: its store, machines and actors on one scheduler, and the ground truth the invariants
    read (every write the store applied, every listing it answered a worker, every wait)."""

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
                self.judge(9, invariant_9(self, task_id, sender))
        elif name.startswith(layout.LEASES):
            task_id = layout.id_from_object(name, layout.LEASES)
            body = json.loads(data)
            self.first_claim_at.setdefault(task_id, now)
            self.committed[task_id].update(record_key(r) for r in body.get("progress", []))

    def _listed(self, prefix: str, entries: list, origin: object) -> None:
        if prefix != layout.LEASES or not isinstance(origin, Machine) or origin.clock is None:
            return
        now = origin.clock.monotonic()
        for entry in entries:
            task_id = layout.id_from_object(entry.name, layout.LEASES)
            if task_id is not None and entry.metadata.get("state", "held") not in ("done", "dead"):
                self.lease_views[(origin.name, task_id)].append((now, entry.generation))

    def violation(self, invariant: int, what: str) -> None:
        self.violations.append(Violation(invariant, f"t={self.scheduler.now:.1f}s {what}"))

    def judge(self, invariant: int, breaches: list[str]) -> None:
        """Records what an invariant's function (tests.simworld.invariants) found broken, now."""
        for what in breaches:
            self.violation(invariant, what)

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
        self.scheduler.spawn(name, lambda: self.worker_main(machine, rate, seed), at, machine=machine)

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

    def worker_main(self, machine: Machine, rate: float, seed: int) -> None:
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

    def status_look(self, name: str) -> None:
        """`gcs-spawner status` run at some moment, judged by invariant 8."""
        try:
            view = snapshot(self.store, now=EPOCH + dt.timedelta(seconds=self.scheduler.now))
        except (StoreError, *CRASHES):
            return  # an outage or a 403: status fails loudly, and says nothing about completion
        self.stats["status_looks"] += 1
        self.judge(8, invariant_8(self, name, view))

    def batch_running(self, marker: str) -> bool:
        found = self.store.peek(marker)
        return found is not None and found[0].metadata.get("state") == layout.BATCH_RUNNING

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
            submit_later(self, batch, f"submit{b}", self.rng.uniform(0, c.chaos_s + 250))
        for k in range(STATUS_LOOKS):
            name = f"status{k}"
            at = self.rng.uniform(0, c.chaos_s + 400)
            machine = self.machines[name] = Machine(name, None, fault_free=False)
            if at < c.chaos_s:
                self._suspension(at, machine, soon=True)
            self.scheduler.spawn(name, lambda name=name: self.status_look(name), at, machine=machine)
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
            straddle(self, "status")
            straddle(self, "worker")

    # -- the invariants at the end

    def check(self) -> None:
        """The invariants judged once the world has run (the others were judged as their moments came)."""
        self.judge(1, invariant_1(self))
        self.judge(3, invariant_3(self))
        self.store.faults = None  # status's last look, on a quiet store
        self.judge(7, invariant_7_end(self))
        self.judge(5, invariant_5(self))
        self.judge(6, invariant_6_pickup(self))

"""A fleet on a virtual clock: the real `Claimer`, `HeldLease` and `MachineRecorder` against `SimStore`.

Each worker is an actor running the real claim loop (`taskqueue.claims.Claimer`) and the real lease
(`taskqueue.lease.HeldLease`), with the spawner's task handling reduced to what a no-op consumer
needs: heartbeats every `heartbeat_s` committing the consumer's checkpoints, `complete` at the end,
`release` on a preemption, dead-lettering after `MAX_TAKEOVERS` steals (the spawner's constant). Each
machine also writes what a real one writes on GCP: startup.sh's two boot records, and the real
`fleet.machines.MachineRecorder` (its beat an actor of its own, on virtual time) told of every state
change as `taskqueue.spawner` and `taskqueue.cli` tell it. Late batches are submitted by the real
`submit`, its creates 16 at a time on a `SimExecutor`; a status refresh (`reporting.status.snapshot`)
runs as an actor when the first late batch is submitted, its requests and virtual seconds counted.

`FleetOptions.faults` makes that share of the workers' request attempts fail (`FleetFaults`). A
non-transient error, or a store error past the retry deadline, that escapes the worker ends its
process, as it would: its lease is left to expire, and the process restarts `restart_s` later
(systemd) on the same machine. `report` gives requests per task by kind, the first claim, the late
tasks' pickup, the makespan against the ideal, and `extrapolate` a bigger fleet. Driven by
`python -m bench.fleet_sim`; a benchmark's world, it asserts nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import json
import math
import random
import sys
import time

from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exceptions

from fleet.machines import MachineRecorder, make_record, write_record
from objectstore.base import StoreError
from reporting.status import snapshot
from taskqueue import layout
from taskqueue.claims import Claimer, ClaimOptions, default_poll_max
from taskqueue.lease import LeaseLost
from taskqueue.submit import submit
from taskqueue.worker import MAX_TAKEOVERS
from tests.simworld.scheduler import EPOCH, InlineExecutor, Scheduler, SimClock, SimExecutor, SimLock
from tests.simworld.store import MACHINES, Faults, Limits, SimStore

#: What ends a worker's process when it escapes (a 403, an expired credential, a store error past the
#: retry deadline); systemd starts it again.
CRASHES = (StoreError, gexc.GoogleAPICallError, auth_exceptions.GoogleAuthError)
SUBMITTER = "submitter"
STATUS = "status"  # its requests are reported apart, not in the fleet's requests per task


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
    status_refresh: dict | None = None  # a status snapshot taken while the fleet works (Fleet._status_refresh)


class Fleet:
    def __init__(self, options: FleetOptions, limits: Limits) -> None:
        self.o = options
        self.rng = random.Random(options.seed)
        self.scheduler = Scheduler()
        self.clock = SimClock(self.scheduler)
        faults = FleetFaults(self.scheduler, options.faults, options.lease_ttl_s, options.seed) if options.faults > 0 else None
        self.store = SimStore(self.scheduler, limits, options.seed, faults)
        self.store.uncounted.add(STATUS)
        self.stats = Stats()
        mu = math.log(options.mean_task_s) - options.task_sigma**2 / 2
        self.ids = [f"t{k:07d}" for k in range(options.tasks)]
        # Late tasks sort after the first ones: the first late batch fills a new region at the end.
        self.late = [[f"t{options.tasks + b * options.late_batch + k:07d}" for k in range(options.late_batch)]
                     for b in range(2 if options.late_batch > 0 else 0)]  # fmt: skip
        self.duration = {t: self.rng.lognormvariate(mu, options.task_sigma) for t in self.ids + sum(self.late, [])}
        self.first_late = f"t{options.tasks:07d}"
        self._spawned = 0
        #: worker -> (requests before its first claim, of which machines/, when); `first_claim_counted`: those reported
        self.first_claim: dict[str, tuple[int, int, float]] = {}
        self.first_claim_counted: set[str] = set()
        self.store.on_stored = self._stored
        self.store.on_first_lease = self._first_lease

    @property
    def total_tasks(self) -> int:
        return len(self.duration)

    def _stored(self, name: str, data: bytes, metadata: dict, generation: int, origin: object) -> None:
        if name.startswith(layout.TASKS) and self.stats.created_at is not None:
            task_id = name[len(layout.TASKS) :].rsplit(".", 1)[0]
            if task_id in self.duration:
                self.stats.created_at.setdefault(task_id, self.scheduler.now)

    def _first_lease(self, actor: str) -> None:
        """A worker's first successful lease write is its first claim (heartbeats come later)."""
        if actor not in self.first_claim:
            store = self.store
            self.first_claim[actor] = (store.by_actor[actor] - 1, store.records_by_actor[actor], self.scheduler.now)

    def setup(self) -> None:
        self.store.counting = False
        submit(self.store, b"{}", [(t, json.dumps({"id": t}).encode()) for t in self.ids], executor=InlineExecutor())
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
                if name not in self.first_claim_counted:
                    self.first_claim_counted.add(name)
                    requests, records, at = self.first_claim[name]
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
            submit(self.store, None, [(t, json.dumps({"id": t}).encode()) for t in batch], clock=self.clock,
                   executor=SimExecutor(self.scheduler, 16))  # fmt: skip
            if k == 0:
                self.scheduler.spawn(STATUS, self._status_refresh, self.scheduler.now)

    def _status_refresh(self) -> None:
        """`tools/status.py` while the fleet works: its requests and how long they take, one after another."""
        started = self.scheduler.now
        view = snapshot(self.store, now=EPOCH + dt.timedelta(seconds=started))
        self.stats.status_refresh = {"requests": view["requests"], "virtual_s": round(self.scheduler.now - started, 1),
                                     "total": view["total"], "done": view["done"], "by_kind": view["requests_by_kind"]}  # fmt: skip

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
        "status_refresh": s.status_refresh,
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



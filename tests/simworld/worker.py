"""The worker's shell in a seeded world: what taskqueue.spawner.Spawner does around the production worker
core (`taskqueue.worker.TaskRun`) and claim loop, on virtual time, with a scripted consumer in place of the
subprocess."""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING

from objectstore.base import NotFound
from taskqueue import layout
from taskqueue.claims import Claimer, ClaimOptions
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
from tests.simworld.consumers import ScriptedConsumer, SimResident
from tests.simworld.faults import Machine, Runaway, WorldClock
from tests.simworld.invariants import invariant_2, invariant_4, invariant_6_idle_exit, invariant_10

if TYPE_CHECKING:
    from tests.simworld.world import World

TICK_S = 2.0  # how often the simulated shell ticks the core while a consumer runs (the real one: 0.2 s)


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
        world.judge(10, invariant_10(resident, task_id))
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
            world.judge(4, invariant_4(world, m))
        if reason == "idle":
            world.judge(6, invariant_6_idle_exit(world, self))
        return reason

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
        world.judge(2, invariant_2(world, self.machine, claim.task_id, lease))
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

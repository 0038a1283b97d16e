"""The submitters of a seeded world: runs of `tools/submit.py` (the production `submit`), killed or
interrupted at any point in the chaos window, and their operator, who runs a submit again as status tells
him to, and submits a refused task again under a new id."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from objectstore.base import StoreError
from taskqueue.submit import SubmitError, batch_name, submit
from tests.simworld.faults import CRASHES, Killed, Machine, WorldClock
from tests.simworld.invariants import invariant_7_failed_submit
from tests.simworld.scheduler import Actor, SimExecutor

if TYPE_CHECKING:
    from tests.simworld.world import World

JOB = json.dumps({"name": "sim"}).encode()


def submit_later(world: World, batch: list[tuple[str, bytes]], name: str, at: float, tries: int = 1, chaos: bool = True) -> None:
    """`tools/submit.py` run at `at`: in the chaos window it may be killed (at a request, or at a
    moment) or interrupted once or twice (Ctrl-C, SIGTERM), at any point of its run."""
    c = world.config
    in_chaos = chaos and at < c.chaos_s
    kill_at = world.rng.randint(1, 2 * len(batch) + 4) if in_chaos and world.rng.random() < 0.2 else None
    machine = Machine(name, kill_at, fault_free=False)
    actor = world.scheduler.spawn(name, lambda: _submitter(world, batch, machine, tries), at, machine=machine)
    # How long a submit of this size takes, roughly (its creates `submit_parallel` at a time, about 20 ms
    # each): kills and signals land anywhere in it, while its creates are in flight most often.
    span = 0.1 + 0.04 * len(batch) / c.submit_parallel
    if in_chaos and world.rng.random() < 0.15:
        when = at + world.rng.uniform(0, span)
        world.scheduler.spawn(f"kill-{name}", lambda: world.kill(machine, "at a moment"), when)
    if in_chaos and world.rng.random() < c.p_interrupt:
        first = at + world.rng.uniform(0.04, span)  # (its first 40 ms: the job's create and read, the batch's begin)
        signum = world.rng.choice(["SIGINT", "SIGTERM"])
        times = world.rng.choice([1, 2])
        gap = world.rng.choice([0.005, 0.05, 0.5])
        for k in range(times):
            when = first + k * gap
            world.scheduler.spawn(f"signal-{name}", lambda signum=signum: _signal(world, machine, actor, signum), when)
        world.stats[f"interrupted_{times}x"] += 1


def _signal(world: World, machine: Machine, actor: Actor, signum: str) -> None:
    """A signal to the submit's process: Python raises KeyboardInterrupt in its main thread
    (tools/submit.py turns SIGTERM into the same)."""
    if machine.submitting and not machine.dead:
        world.scheduler.interrupt(actor, KeyboardInterrupt(signum))


def _submitter(world: World, batch: list[tuple[str, bytes]], machine: Machine, tries: int) -> None:
    """One run of `tools/submit.py`. One that dies, fails or is left running is run again later, the
    same command, as status tells its operator to (a refused task is submitted again under a new id)."""
    c = world.config
    name = machine.name
    world.machines[name] = machine
    ids = [t for t, _ in batch]
    world.submits_starting[name] = ids
    marker = batch_name(ids)
    machine.submitting = True
    pool = SimExecutor(world.scheduler, c.submit_parallel, name="create")
    ended = True  # it ended: rerun only if status names its batch as running
    try:
        submit(world.store, JOB, batch, c.submit_parallel, WorldClock(world.scheduler), executor=pool,
               region_tasks=c.region_tasks, batch_keep_s=c.batch_keep_s)  # fmt: skip
    except Killed:
        machine.dead = True
        world.stats["submitter_killed"] += 1
        ended = False
    except KeyboardInterrupt as exc:
        world.stats["submit_interrupted"] += 1
        world.judge(7, invariant_7_failed_submit(world, name, marker, exc))
    except SubmitError as exc:  # a task exists with another manifest: the rest of the batch is submitted
        world.stats["submit_refused"] += 1
        world.judge(7, invariant_7_failed_submit(world, name, marker, exc))
        if "already exist" in str(exc):
            _resubmit_refused(world, batch, name)
    except (StoreError, *CRASHES) as exc:  # a submit that failed (403, outage) must finish its batch first
        world.stats["submit_failed"] += 1
        world.trace.update(f"submit failed {exc!r}\n".encode())
        world.judge(7, invariant_7_failed_submit(world, name, marker, exc))
        ended = False
    finally:
        machine.submitting = False
        world.submits_starting.pop(name, None)
        world.submits_in_progress.pop(name, None)
    if tries < 4:
        # Its operator runs it again if it did not complete, or once status names the batch as running
        # (a write the store applied late may begin it after the submit ended): a while later, after
        # the chaos by the last try.
        at = world.scheduler.now + world.rng.uniform(70, 300)
        at = max(at, c.chaos_s) if tries == 3 else at
        world.scheduler.spawn(f"operator-{name}", lambda: _operator(world, batch, marker, name, ended, tries), at)


def _operator(world: World, batch: list[tuple[str, bytes]], marker: str, name: str, ended: bool, tries: int) -> None:
    if not ended or world.batch_running(marker):
        submit_later(world, batch, f"{name}r", world.scheduler.now, tries + 1, chaos=tries < 3)


def _resubmit_refused(world: World, batch: list[tuple[str, bytes]], name: str) -> None:
    """What the error tells its operator: the changed task again, under a new id."""
    changed = [(t, data) for t, data in batch if json.loads(data).get("changed")]
    renamed = [(f"{t}.v2", json.dumps({**json.loads(data), "id": f"{t}.v2"}).encode()) for t, data in changed]
    for t, _ in renamed:
        world.outputs[t] = world.rng.randint(0, 4)
    if renamed:
        submit_later(world, renamed, f"{name}v2", world.scheduler.now + world.rng.uniform(10, 200))

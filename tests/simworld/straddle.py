"""A batch that comes and goes unseen, at the end of a quarter of the seeded worlds: between the two listings
of batches/ of a status snapshot, then of a worker's drained check, so that only layout.PRUNED tells
(`layout.batch_unseen_between`; invariants 8 and 4 see it)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from taskqueue import layout
from taskqueue.submit import batch_name, prune_batches, submit
from tests.simworld.faults import Machine, WorldClock
from tests.simworld.scheduler import InlineExecutor

if TYPE_CHECKING:
    from tests.simworld.world import World


def straddle(world: World, reader: str) -> None:
    """A batch comes and goes between the two listings of batches/ that `reader` (a status
    snapshot, or a fault-free worker's drained check on the finished queue) takes around its
    listings of the regions: submit A creates one task and finishes; a lifecycle rule moves the
    `updated` time of every older batch marker on (a storage class change: generations stay); then
    the submit that wrote one of them, whose machine paused after its `done` write and before its
    prune, prunes A's marker as older than the keep time. The two listings hold the same markers
    at the same generations, and only layout.PRUNED says a batch came and went
    (`layout.batch_unseen_between`): without it status says complete (invariant 8), the worker
    leaves drained (invariant 4), while A's task has no marker. Closers finish it afterwards."""
    c = world.config
    older = [n for n in world.store.names(layout.BATCHES) if n != layout.PRUNED and not world.batch_running(n)]
    if not older:
        return
    pruner = older[0]
    task = f"zz-{reader}"
    world.outputs[task] = 0
    world.straddled.add(task)
    for name in older:
        world.store.touch(name)  # so that A's own prune deletes none of them: the reader would see that
    listed: list[str] = []
    came: list[bool] = []
    name = f"straddle-{reader}"
    machine = world.machines[name] = Machine(name, None, fault_free=True)

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
            _come_and_go(world, task, pruner, machine)

    machine.before_listing = second_listing
    if reader == "status":
        world.scheduler.spawn(name, lambda: world.status_look(name), world.scheduler.now + 1, machine=machine)
    else:
        world.scheduler.spawn(name, lambda: world.worker_main(machine, 1.0, c.seed), world.scheduler.now + 1,
                              machine=machine)  # fmt: skip
    world.scheduler.run()
    for _ in range(2):  # closers run what the straddled reader left
        if not world.unfinished():
            break
        world.machine(world.scheduler.now + 1, fault_free=True)
        world.scheduler.run()


def _come_and_go(world: World, task: str, pruner: str, reader: Machine) -> None:
    """Run by the reader's actor just before its listing is sent: the reader waits meanwhile."""
    c = world.config
    before_listing, reader.before_listing = reader.before_listing, None  # its own requests here are not its reading
    started = world.scheduler.now
    submit(world.store, None, [(task, json.dumps({"id": task}).encode())], clock=WorldClock(world.scheduler),
           executor=InlineExecutor(), region_tasks=c.region_tasks, batch_keep_s=c.batch_keep_s)  # fmt: skip
    came = batch_name([task])
    world.scheduler.sleep(c.batch_keep_s + 2)
    for name in world.store.names(layout.BATCHES):
        if name != came and name != layout.PRUNED:
            world.store.touch(name)  # a rule for objects older than some age: A's marker is younger
    world.scheduler.sleep(2 * 5.0 + 1)  # past submit.PRUNE_EVERY_S of the last prune (at most twice it)
    prune_batches(world.store, pruner, c.batch_keep_s)
    if not world.store.exists(came):
        world.stats[f"straddled_{reader.name.removeprefix('straddle-')}"] += 1
    world.trace.update(f"straddle {reader.name} {started:.3f} {world.scheduler.now:.3f} {world.store.exists(came)}\n".encode())
    reader.before_listing = before_listing

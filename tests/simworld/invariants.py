"""The invariants every seeded world is checked against, one function each, named as docs/PROTOCOL.md names
them ("invariant N" is `invariant_N`).

Each function reads the world's ground truth (every write the store applied, every listing it answered,
every wait) and what its moment shows, and returns its breaches, one line each; `World.judge` records
them under the invariant's number. Invariants 1, 3 and 5 are judged at the end of a world; 2, 4, 8, 9
and 10 when their moment comes (a consumer starts, a worker leaves drained, status answers, the store
applies a create, a resident consumer takes a task). Invariants 6 and 7 have two clauses judged at two
moments, a function each (`invariant_6_pickup` at the end, `invariant_6_idle_exit` when a worker leaves
idle; `invariant_7_failed_submit` when a submit fails, `invariant_7_end` at the end).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
from typing import TYPE_CHECKING

from reporting.status import snapshot
from taskqueue import layout
from taskqueue.lease import sum_counters
from tests.simworld.scheduler import EPOCH

if TYPE_CHECKING:
    from taskqueue.lease import HeldLease
    from tests.simworld.consumers import SimResident
    from tests.simworld.faults import Machine
    from tests.simworld.world import World
    from tests.simworld.worker import SimWorker

#: How far apart in time a listing may be as the store answered it and as its worker sent it (a slow
#: request, a page more): a renewal seen across a gap this close to a TTL is not judged (invariant 6).
RENEW_MARGIN_S = 5.0


@dataclasses.dataclass
class Violation:
    invariant: int  # its number; 0 for an exception the world did not expect
    what: str

    def __str__(self) -> str:
        return f"invariant {self.invariant}: {self.what}"


def record_key(record: dict) -> str:
    """A progress record as invariant 3 compares it: what a lease write carried against a done marker's outputs."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


def invariant_1(world: World) -> list[str]:
    """Once the fleet (plus fault-free closers) has finished, every task that exists has exactly one done
    marker or exactly one dead letter: never both, never neither."""
    breaches = []
    for t in world.existing_tasks():
        done, failed = world.marker_of(t)
        if done and failed:
            breaches.append(f"task {t} has both a done marker and a dead letter")
        elif not done and not failed:
            breaches.append(f"task {t} has neither a done marker nor a dead letter (lease {world.lease_state(t)})")
    return breaches


def invariant_2(world: World, machine: Machine, task_id: str, lease: HeldLease) -> list[str]:
    """No consumer starts on a task whose done marker exists. But where a machine's clock stood still while
    it was suspended, it cannot tell that its claim went stale: its lease must be someone else's by then, so
    that its first heartbeat is refused and nothing it does counts (counted as `started_on_a_lost_lease`)."""
    if not world.marker_of(task_id)[0]:
        return []
    current = world.store.peek(layout.lease_object(task_id))
    if machine.clock_stops and current is not None and current[0].generation != lease.generation:
        world.stats["started_on_a_lost_lease"] += 1
        return []
    return [f"{machine.name} starts a consumer on task {task_id}, which has a done marker"]


def invariant_3(world: World) -> list[str]:
    """Every output a lease write committed is in the done marker."""
    breaches = []
    for t in world.existing_tasks():
        found = world.store.peek(layout.done_object(t))
        if found is None:
            continue
        outputs = {record_key(r) for r in json.loads(found[1])["outputs"]}
        missing = world.committed[t] - outputs
        if missing:
            breaches.append(f"task {t}: committed outputs missing from its done marker: {sorted(missing)[:3]}")
    return breaches


def invariant_4(world: World, machine: Machine) -> list[str]:
    """No worker exits `drained` while a task lacks a marker, counting every task of a submit in progress
    (from its first applied write on: before that no worker can know of it)."""
    unfinished = world.unfinished()
    if unfinished:
        return [f"{machine.name} exited drained while {len(unfinished)} tasks lack a marker: {unfinished[:5]}"]
    return []


def invariant_5(world: World) -> list[str]:
    """`reporting.status.snapshot`'s totals, counters and `complete` at the end, on a quiet store, equal the
    ground truth."""
    tasks = world.existing_tasks()
    counters: dict[str, int] = {}
    for t in tasks:
        found = world.store.peek(layout.done_object(t))
        if found is not None:
            for k, v in sum_counters(json.loads(found[1])["outputs"]).items():
                counters[k] = counters.get(k, 0) + v
    view = snapshot(world.store, now=EPOCH + dt.timedelta(seconds=world.scheduler.now))
    done = sum(world.marker_of(t)[0] for t in tasks)
    failed = sum(world.marker_of(t)[1] and not world.marker_of(t)[0] for t in tasks)
    truth = {"total": len(tasks), "done": done, "failed": failed, "counters": counters,
             "complete": bool(tasks) and done + failed == len(tasks)}  # fmt: skip
    seen = {k: view[k] for k in truth}
    return [f"status says {seen}, the store holds {truth}"] if seen != truth else []


def invariant_6_pickup(world: World) -> list[str]:
    """Liveness, its first clause: a task submitted after the chaos window, while some worker has been waiting
    without a task (awake: a suspended VM does not poll), is claimed within `pickup_bound_s` (two poll caps
    plus 10 s)."""
    c = world.config
    bound = c.pickup_bound_s
    breaches = []
    for t, created in world.created_at.items():
        if created < c.chaos_s or t in world.applied_late or t in world.straddled:
            continue  # (a create applied late was sent in the chaos window; a straddled reader was held)
        claimed = world.first_claim_at.get(t, math.inf)
        if claimed - created <= bound:
            continue
        waiter = next(
            (w for w, start, end in world.waiting_log if start <= created and end >= created + bound
             and not any(s < created + bound and e > created for s, e in world.machines[w].stops)),
            None,
        )  # fmt: skip
        if waiter is not None:
            breaches.append(f"task {t} submitted at {created:.1f}s was claimed at {claimed:.1f}s, "
                            f"over the bound of {bound:.0f}s, while {waiter} waited without a task")  # fmt: skip
    return breaches


def invariant_6_idle_exit(world: World, worker: SimWorker) -> list[str]:
    """Liveness, its second clause, once the store is quiet: no worker exits `idle` while a task nobody holds
    has been claimable for longer than `pickup_bound_s`, nor beside a lease that nobody runs (its holder died
    or moved on) which it has neither seen renew nor watched for its TTL (a renewal judged from what the
    store answered the worker's listings, `saw_renew`, never from the worker's own flag)."""
    now = world.scheduler.now
    if now < world.config.chaos_s + world.config.pickup_bound_s:
        return []  # faults may keep a worker from seeing work; liveness is checked on a quiet store
    bound = world.config.pickup_bound_s
    name = worker.machine.name
    for t in world.unfinished():
        found = world.store.peek(layout.lease_object(t))
        since = world.store.last_mutated(layout.lease_object(t))
        since = since if since is not None else world.created_at.get(t, now)
        lease = json.loads(found[1]) if found else None
        state = lease["state"] if lease else None
        expired = state == "held" and now - since > world.config.lease_ttl_s * 1.1 + bound
        if (state in (None, "released") and now - since > bound) or expired:
            return [f"{name} exited idle while task {t} was claimable (lease {state}, unchanged for {now - since:.0f}s)"]
        holder = world.machines.get(lease["worker"]) if state == "held" else None
        if state == "held" and (holder is None or holder.dead or holder.running != t):
            # Nobody runs the task: only a worker that watches the lease for its TTL can take it over.
            # Leaving is fine only beside a lease seen renewing (its holder may have died since: no
            # rule can tell); one the worker never watched for a TTL may be stranded for good.
            # Judged from what the store answered the worker's listings, not from its own flag
            # (Sighting.renewed), which a broken rule would set as readily as it reads it.
            if saw_renew(world, name, t, found[0].generation) is False:
                sighting = worker.claimer.view.leases.get(t)
                return [f"{name} exited idle beside task {t}'s lease, held by {lease['worker']} who runs it no "
                        f"more, never seen renewing nor watched for its TTL (sighting {sighting})"]  # fmt: skip
    return []


def saw_renew(world: World, machine: str, task_id: str, generation: int) -> bool | None:
    """Whether `machine`'s listings showed the lease change to `generation` between two listings less than
    a TTL apart on its own clock (a renewal seen: its holder wrote within a TTL); None when the gap is too
    close to a TTL to tell (a listing's time here is when the store answered it, the worker's when it sent
    it: a slow request or a page more apart)."""
    views = world.lease_views.get((machine, task_id), [])
    first = next((i for i, (_, g) in enumerate(views) if g == generation), None)
    if first is None or first == 0:
        return False  # never listed at that generation, or first seen at it: nothing seen to change
    gap = views[first][0] - views[first - 1][0]
    ttl = world.config.lease_ttl_s
    if abs(gap - ttl) <= RENEW_MARGIN_S:
        return None
    return gap < ttl


def invariant_7_failed_submit(world: World, name: str, marker: str, exc: BaseException) -> list[str]:
    """No batch marker outlives its submitter's failure: a submit that failed after it began its batch, and
    could still write, leaves no batch running. One whose store refused the finishing writes too, or whose
    wait a second interrupt cut short, says so in a note (and is run again); one that failed before it
    began its batch has nothing to finish."""
    if name in world.batch_writers and world.batch_running(marker) and not getattr(exc, "__notes__", None):
        return [f"{name} failed ({exc!r}) and left its batch {marker} running without a word"]
    return []


def invariant_7_end(world: World) -> list[str]:
    """At the end, after every submit that died or failed was run again (as status told its operator), no
    batch is `running`."""
    return [f"batch {name} is still running at the end, after every submit ended"
            for name in world.store.names(layout.BATCHES) if world.batch_running(name)]  # fmt: skip


def invariant_8(world: World, name: str, view: dict) -> list[str]:
    """Whenever a status snapshot says `complete`, every task in the store has its marker.

    The simulation runs one actor at a time and a listing is applied at one instant, so the store right
    after the snapshot returns is the store its last listing saw."""
    if not view["complete"]:
        return []
    pending = [t for t in world.existing_tasks() if not any(world.marker_of(t))]
    return [f"{name} says complete while {len(pending)} tasks lack a marker: {pending[:5]}"] if pending else []


def invariant_9(world: World, task_id: str, sender: str | None) -> list[str]:
    """Every task create the store applies lands while a `running` batch marker covers the task: no submit
    finishes its batch while one of its creates can still be applied (the set-up's submit excepted)."""
    if world.setting_up:
        return []
    key = layout.key(task_id)
    for name in world.store.names(layout.BATCHES):
        entry, _ = world.store.peek(name)
        first, last = entry.metadata.get("first"), entry.metadata.get("last")
        if first and last and entry.metadata.get("state") == layout.BATCH_RUNNING and layout.key(first) <= key <= layout.key(last):
            return []
    return [f"task {task_id} was created while no running batch covers it (sent by {sender}): its submit had finished the batch"]


def invariant_10(resident: SimResident | None, task_id: str) -> list[str]:
    """A resident consumer that was signalled (a stop, the backstop, a lost lease) or that did not say its
    state is sound never serves another task."""
    if resident is not None and (resident.signalled or not resident.sound):
        return [f"{resident.name} serves task {task_id} after it was signalled or said it was not sound "
                f"(it served {resident.served})"]  # fmt: skip
    return []

"""What goes wrong in a seeded world, and what it acts on: machines (killed, stopped, suspended), the
store's faults inside the chaos window, and virtual time that runs away."""

from __future__ import annotations

import dataclasses
import random
import threading
from typing import TYPE_CHECKING

from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exceptions

from taskqueue import layout
from taskqueue.claims import Claimer
from tests.simworld.scheduler import SimClock
from tests.simworld.store import Faults

if TYPE_CHECKING:
    from tests.simworld.world import World


class Killed(BaseException):
    """The machine died: raised at a request, or at the next turn of each of its actors. A
    BaseException, so that no `except Exception` in the production code can catch it (a dead machine
    runs no handler)."""


class Runaway(BaseException):
    """Virtual time ran past MAX_VIRTUAL_S: something waits or retries forever (a liveness failure)."""


MAX_VIRTUAL_S = 5_000.0  # a world ends within about 3,000 s (chaos, late submits, idle timeouts, closers)
#: A non-transient error that escapes the worker ends its process; systemd starts it again.
CRASHES = (gexc.GoogleAPICallError, auth_exceptions.GoogleAuthError)


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
    before_listing: object = None  # called with the prefix before each listing it sends (tests.simworld.straddle)


class SeedFaults(Faults):
    """The store's faults for one seed: per attempt, by the acting machine, inside the chaos window."""

    def __init__(self, world: World) -> None:
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

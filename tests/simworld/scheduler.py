"""Virtual time: actors that take turns, clocks that read it, and the primitives that wait on it.

One actor runs at a time, until it waits (a request's latency, a sleep, a lock, a future); the
`Scheduler` then runs whichever actor's virtual wake-up time comes first. Actors are greenlets on
one thread, so a turn costs a switch, not an operating-system context switch, and a world's outcome
depends only on its seed.

What production code runs inside an actor it runs unchanged; what it must be given instead of the
real thing is passed in: a `SimClock` for `taskqueue.clock.Clock`, a `SimExecutor` for a thread
pool, a `SimLock` for a lock held across requests.

Machines. An actor may belong to a machine (any object): a machine can be killed (every actor of it
gets the exception at its next turn, after any request it has in flight is applied) or suspended
(`gate`: its actors do not run until it resumes, and its `SimClock` stands still meanwhile, as a
VM's CLOCK_MONOTONIC does under the ACPI S3 suspend Compute Engine sends,
https://cloud.google.com/compute/docs/instances/suspend-resume-instance).
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime as dt
import heapq
import itertools
import threading
from collections.abc import Callable

import greenlet

from taskqueue.clock import Clock

EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
#: How often a waiter on a future or an executor looks again (virtual seconds).
POLL_S = 0.01
MIN_WAIT_S = 1e-6


class Actor:
    """One thread of control in the simulation: a callable run as a greenlet, on virtual time."""

    __slots__ = ("scheduler", "name", "target", "machine", "glet", "error", "pending", "done", "wake", "interruptible")

    def __init__(self, scheduler: "Scheduler", name: str, target: Callable[[], object], machine: object = None):
        self.scheduler, self.name, self.target, self.machine = scheduler, name, target, machine
        self.glet: greenlet.greenlet | None = None
        self.error: BaseException | None = None
        self.pending: BaseException | None = None  # raised at its next turn: a signal, or its machine's death
        self.done = False
        self.wake = 0  # which of its wake-ups in the queue is the live one (an interrupt brings it forward)
        self.interruptible = False  # it waits (rather than has a request in flight): a signal wakes it at once

    def _main(self) -> None:
        try:
            self.target()
        except greenlet.GreenletExit:
            raise
        except self.scheduler.ends:
            pass  # its machine died: not a failure of the run
        except BaseException as exc:  # handed to the scheduler, which stops the run with it
            self.error = exc
        finally:
            self.done = True
            self.scheduler.actors.pop(self, None)


class Scheduler:
    """Runs one actor at a time, in order of virtual wake-up time.

    `gate(actor, at)`, if given, returns the earliest virtual time the actor may run when it is due
    at `at` (a suspended machine's actors wait for it to resume). An actor that ends with one of
    `ends` (a dead machine's exception) just ends; any other exception stops the run."""

    def __init__(
        self, gate: Callable[[Actor, float], float] | None = None, ends: tuple[type[BaseException], ...] = ()
    ) -> None:
        self.now = 0.0
        self.gate = gate
        self.ends = ends
        self._heap: list[tuple[float, int, int, Actor]] = []
        self._seq = itertools.count()
        self._hub: greenlet.greenlet | None = None
        self.current: Actor | None = None
        self.actors: dict[Actor, None] = {}  # not yet finished, in the order spawned (a set's order is the addresses')

    def spawn(self, name: str, target: Callable[[], object], at: float, machine: object = None) -> Actor:
        actor = Actor(self, name, target, machine)
        self.actors[actor] = None
        self._push(at, actor)
        return actor

    def _push(self, at: float, actor: Actor) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), actor.wake, actor))

    def sleep(self, seconds: float, deliver: bool = True) -> None:
        """Called by the running actor: give the turn away until `seconds` of virtual time have passed.
        With `deliver` the actor is waiting, not in a request: a signal or its machine's death wakes it
        at once and is raised here; without, it comes at the actor's next `deliver`."""
        actor = self.current
        assert actor is not None, "sleep outside an actor"
        actor.wake += 1
        actor.interruptible = deliver
        self._push(self.now + max(0.0, seconds), actor)
        self._hub.switch()
        actor.interruptible = False
        if deliver:
            self.deliver()

    def deliver(self) -> None:
        """Raise in the running actor what was sent to it meanwhile (`interrupt`)."""
        actor = self.current
        if actor is not None and actor.pending is not None:
            pending, actor.pending = actor.pending, None
            raise pending

    def interrupt(self, actor: Actor, exc: BaseException) -> bool:
        """Have `actor` raise `exc` at its next turn (after a request it has in flight is applied);
        False when it has finished."""
        if actor.done:
            return False
        actor.pending = actor.pending or exc
        if actor.interruptible and actor is not self.current:
            actor.wake += 1
            self._push(self.now, actor)
        return True

    def actors_of(self, machine: object) -> list[Actor]:
        return [a for a in self.actors if a.machine is machine]

    def run(self, progress: Callable[[float], None] | None = None, every_s: float = 600.0) -> None:
        """Until every actor has finished; `progress(now)` is called every `every_s` of virtual time."""
        self._hub = greenlet.getcurrent()
        next_report = every_s
        while self._heap:
            at, _, wake, actor = heapq.heappop(self._heap)
            if actor.done or wake != actor.wake:
                continue
            if self.gate is not None:
                allowed = self.gate(actor, at)
                if allowed > at:
                    self._push(allowed, actor)
                    continue
            self.now = max(self.now, at)
            if progress is not None and self.now >= next_report:
                progress(self.now)
                next_report += every_s
            self.current = actor
            if actor.glet is None:
                actor.glet = greenlet.greenlet(actor._main, parent=self._hub)
            actor.glet.switch()
            self.current = None
            if actor.error is not None:
                raise RuntimeError(f"actor {actor.name} failed") from actor.error


class SimClock(Clock):
    """The queue's clock on virtual time: monotonic is scheduler time at `rate` (a clock a few percent
    off), standing still over `stops` (the (start, end) spans its machine was suspended); waits give
    the turn away. The wall clock is the scheduler's, from EPOCH (NTP keeps it right across a suspend)."""

    def __init__(self, scheduler: Scheduler, rate: float = 1.0, stops: list[tuple[float, float]] | None = None) -> None:
        super().__init__(rate=rate)
        self.scheduler = scheduler
        self.stops = stops if stops is not None else []

    def monotonic(self) -> float:
        now = self.scheduler.now
        stopped = sum(min(now, end) - start for start, end in self.stops if start < now)
        return (now - stopped) * self.rate

    def wall(self) -> dt.datetime:
        return EPOCH + dt.timedelta(seconds=self.scheduler.now)

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        if not stop.is_set():
            # A wait takes some time, however short: a waiter that re-reads the clock must see it move.
            self.scheduler.sleep(max(seconds / self.rate, MIN_WAIT_S))
        return stop.is_set()


class SimLock:
    """A lock for actors: a waiter gives the turn away until it is free (a real lock held across a
    request would stop the whole simulation, since only one actor runs at a time)."""

    def __init__(self, scheduler: Scheduler, poll_s: float = POLL_S) -> None:
        self.scheduler, self.poll_s, self.held = scheduler, poll_s, False

    def __enter__(self) -> "SimLock":
        while self.held:
            self.scheduler.sleep(self.poll_s)
        self.held = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.held = False


class SimFuture(concurrent.futures.Future):
    """A future whose waiters give the turn away instead of blocking the one thread."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__()
        self._scheduler = scheduler

    def _wait(self) -> None:
        while not self.done():
            self._scheduler.sleep(POLL_S)

    def result(self, timeout: float | None = None):
        self._wait()
        return super().result(0)

    def exception(self, timeout: float | None = None):
        self._wait()
        return super().exception(0)


class SimExecutor(concurrent.futures.Executor):
    """A thread pool of `max_workers` actors, each of the submitting actor's machine: what
    `taskqueue.submit` is given as its executor, so that its creates are in flight together, as
    on a real machine, and die with it."""

    def __init__(self, scheduler: Scheduler, max_workers: int = 16, name: str = "pool") -> None:
        self.scheduler, self.max_workers, self.name = scheduler, max(1, max_workers), name
        self._queue: collections.deque = collections.deque()
        self._workers = 0
        self._spawned = itertools.count()
        self._shutdown = False

    def submit(self, fn, /, *args, **kwargs) -> SimFuture:
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        future = SimFuture(self.scheduler)
        self._queue.append((future, fn, args, kwargs))
        if self._workers < self.max_workers:
            self._workers += 1
            current = self.scheduler.current
            self.scheduler.spawn(f"{current.name if current else self.name}.{self.name}{next(self._spawned)}",
                                 self._work, self.scheduler.now, machine=current.machine if current else None)  # fmt: skip
        return future

    def _work(self) -> None:
        try:
            while self._queue:
                future, fn, args, kwargs = self._queue.popleft()
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    future.set_exception(exc)
                    if not isinstance(exc, Exception):
                        raise  # its machine died (or it was told to exit): this actor ends with it
                else:
                    future.set_result(result)
        finally:
            self._workers -= 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._shutdown = True
        if cancel_futures:
            while self._queue:
                self._queue.popleft()[0].cancel()
        if wait and self.scheduler.current is not None:
            while self._workers:
                self.scheduler.sleep(POLL_S)


class InlineExecutor(concurrent.futures.Executor):
    """Runs each call at once, in the caller: for a world's set-up, before any actor runs."""

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - handed to the caller through the future, as a pool does
            future.set_exception(exc)
        return future

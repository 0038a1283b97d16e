"""The worker's decisions, without I/O: what to do with a claim, its consumer, its heartbeats and its end.

`TaskRun` is one claimed task from claim to settlement. It takes events (a progress record read,
a renewal that succeeded or failed, a stop request, a clock tick, the consumer's exit, the result
of the final write) and returns actions (renew with these records, signal the consumer, complete,
release, dead-letter, abandon). It never touches the store, a thread, a signal or a process:
`taskqueue.spawner` (threads, signals, a subprocess) and the deterministic simulation
(`tests/simworld/seeds.py`: virtual time, a scripted consumer) wrap the same object, and the same
`perform_*` functions carry its actions out on the real `HeldLease`. The shape is python-hyper/h11's
`Connection`: the phases and the transitions are the tables below.

The rules it implements (docs/PROTOCOL.md, "Heartbeat", "Completion", "Failure", "Release"):

- **Progress counts once committed.** Records read from the consumer's progress file stay
  `pending` until a lease write that carried them succeeded; a failed renewal keeps them for the
  next one, and the final write (completion, release, dead letter) carries whatever is pending.
- **Renewals.** LeaseLost ends the run at once (SIGKILL: commit nothing more). Any other failure,
  a `StoreError` or anything else (objectstore.gcs re-raises 403s and expired credentials as they
  are), is logged and tried again at the next beat; after a whole TTL without a successful write the
  lease may be stolen, so it is treated as lost.
- **An outcome nobody confirmed is not an outcome.** When the final write fails (a StoreError past
  its retries, or any other exception) the run ends `unconfirmed`: the worker tells nobody the task
  is finished, writes nothing more, and the lease stays its own until it expires; whoever takes it
  over then finds the done or failed marker if one was written (the takeover's check) or runs the
  task again. A failure before the consumer starts (reading `job.json`) releases the task instead.
- **Resident consumers** (issue 44). One process may serve task after task (`spawn.py --resident`): a
  task's exit code is its reply's, else its process's (`resident_exit_code`), and the process serves
  the next task only after a task that ended undisturbed and whose reply said its state is sound
  (`CONSUMER_STAYS`, `TaskRun.consumer_stays`).
- **Stuck consumers** (issue 17, item 7). With `stuck_after_s`, a consumer that wrote no progress
  record and no output line for that long gets SIGTERM, then SIGKILL after the grace, and the
  attempt counts as failed; `max_task_s` does the same after that much time in all.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import signal
from collections.abc import Sequence

from exitcodes import EX_DATAERR
from objectstore import StoreError
from taskqueue.lease import HeldLease, LeaseLost
from taskqueue.process import STOP_GRACE_S

log = logging.getLogger(__name__)

#: Expiries are not attempts (a dead machine is not the task's fault), but a task whose holders
#: keep dying without a word is poison: after this many steals it is dead-lettered.
MAX_TAKEOVERS = 10
#: A slice consumer's exit code when one of its hosts was stopped by SIGTERM (docs/PROTOCOL.md, "Slices").
SLICE_HOST_STOPPED = 128 + signal.SIGTERM


class Phase(enum.Enum):
    RUNNING = "running"  # the consumer runs, heartbeats renew the lease
    STOPPING = "stopping"  # a stop (SIGTERM, preemption) was asked for: release, not an attempt
    STUCK = "stuck"  # the backstop stopped the consumer: a failed attempt
    BROKEN = "broken"  # the consumer broke the progress contract: dead letter
    LOST = "lost"  # the lease is someone else's (or may be): commit nothing
    EXITED = "exited"  # the consumer exited; the final write is under way
    SETTLED = "settled"  # the final write's result is known (or known to be unknown)


# -- actions --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Renew:
    """Rewrite the lease, committing `records`."""

    records: tuple[dict, ...]


@dataclasses.dataclass(frozen=True)
class Signal:
    """Send `signum` to the consumer's process group."""

    signum: int


@dataclasses.dataclass(frozen=True)
class Complete:
    records: tuple[dict, ...]


@dataclasses.dataclass(frozen=True)
class Release:
    """Give the task back; `error` (a failed attempt's record) is None when it was not an attempt."""

    records: tuple[dict, ...]
    error: dict | None
    why: str


@dataclasses.dataclass(frozen=True)
class DeadLetter:
    reason: str
    records: tuple[dict, ...]
    error: dict | None


@dataclasses.dataclass(frozen=True)
class Abandon:
    """Write nothing: the lease is lost, or its state unknown; it expires on its own."""

    why: str


FinalAction = Complete | Release | DeadLetter | Abandon


@dataclasses.dataclass
class Tally:
    done: int = 0
    failed_attempts: int = 0
    dead_letters: int = 0
    released: int = 0
    lost: int = 0
    duplicates: int = 0
    unconfirmed: int = 0
    stuck: int = 0

    def fields(self) -> str:
        return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


@dataclasses.dataclass(frozen=True)
class RunOptions:
    lease_ttl_s: float
    heartbeat_s: float
    max_attempts: int
    worker: str
    is_slice_leader: bool = False
    stuck_after_s: float | None = None
    max_task_s: float | None = None


# -- the decisions as tables ----------------------------------------------------------------------

OK, BAD_INPUT, FAILED, HOST_STOPPED = "ok", "bad_input", "failed", "host_stopped"

#: (phase when the consumer exited, how it exited) -> what to write. BROKEN and LOST do not depend on
#: the exit code; a failed attempt becomes a dead letter once it is the last allowed one.
ON_EXIT: dict[tuple[Phase, str], str] = {
    (Phase.RUNNING, OK): "complete",
    (Phase.RUNNING, BAD_INPUT): "dead_letter",
    (Phase.RUNNING, FAILED): "attempt_failed",
    (Phase.RUNNING, HOST_STOPPED): "release",  # another host of the slice was stopped: not the task's fault
    (Phase.STUCK, OK): "complete",  # it finished just as the backstop fired: the work is done
    (Phase.STUCK, BAD_INPUT): "dead_letter",
    (Phase.STUCK, FAILED): "attempt_failed",
    (Phase.STUCK, HOST_STOPPED): "attempt_failed",
    (Phase.STOPPING, OK): "release",  # even a clean exit after SIGTERM: its last records may be missing
    (Phase.STOPPING, BAD_INPUT): "release",
    (Phase.STOPPING, FAILED): "release",
    (Phase.STOPPING, HOST_STOPPED): "release",
}

#: A resident consumer (docs/PROTOCOL.md, "Resident consumers"): may it serve the next task, by the phase the task
#: ended in? Only a task that ran to its reply undisturbed keeps it, and only when the consumer said its loaded
#: state is sound (`stays`: a 0, a 65 for the task's own input, a 75 for the store). Every other phase signalled
#: it (SIGTERM for a stop or the backstop, SIGKILL for a lost lease or a broken contract): it is on its way out.
CONSUMER_STAYS: dict[Phase, bool] = {
    Phase.RUNNING: True,
    Phase.STOPPING: False,
    Phase.STUCK: False,
    Phase.LOST: False,
    Phase.BROKEN: False,
}
#: A resident consumer's process exit codes that say nothing about a task when it exited without a reply to it:
#: a clean exit, or 65 (the consumer's own set-up, not the task's input: a task's bad input gets a reply).
NOT_THE_TASKS = (0, EX_DATAERR)
EX_SOFTWARE = 70

#: Phases in which a stop signal, the backstop or a renewal failure still changes something.
_ACTIVE = (Phase.RUNNING, Phase.STOPPING, Phase.STUCK)


def exit_class(exit_code: int, is_slice_leader: bool) -> str:
    if exit_code == 0:
        return OK
    if exit_code == EX_DATAERR:
        return BAD_INPUT
    if is_slice_leader and exit_code == SLICE_HOST_STOPPED:
        return HOST_STOPPED
    return FAILED


def resident_exit_code(reply_code: int | None, process_code: int | None) -> int:
    """A resident consumer's exit code for a task, for `TaskRun.exited`: its reply's when it replied; else the
    process's (it died on the task, as a per-task consumer would), except that an exit without a reply is never a
    success nor the task's bad input (NOT_THE_TASKS): it counts as a failed attempt (70)."""
    if reply_code is not None:
        return reply_code
    if process_code is None or process_code in NOT_THE_TASKS:
        return EX_SOFTWARE
    return process_code


def verdict_before_start(takeovers: int, problem: str | None) -> str | None:
    """A dead-letter reason for a claim that must not run at all, or None."""
    if takeovers >= MAX_TAKEOVERS:
        return f"its lease expired {takeovers} times: every holder died running it"
    if problem is not None:
        return f"bad manifest: {problem}"
    return None


class TaskRun:
    """The decisions for one claimed task, from the consumer's start to the final write's result.

    Not thread-safe by itself: the spawner calls it under one lock from its threads; the simulation
    from one actor.
    """

    def __init__(
        self, task_id: str, attempt: int, options: RunOptions, now: float, tally: Tally, sent: float | None = None
    ):
        self.task_id = task_id
        self.attempt = attempt
        self.options = options
        self.tally = tally
        self.phase = Phase.RUNNING
        self.pending: list[dict] = []  # read from the progress file, not yet committed by a lease write
        self.started = now
        self.last_activity = now  # a progress record or an output line
        # The last successful lease write (the claim, or a renewal); for the claim, when it was sent
        # (`HeldLease.last_write`): an observer's watch may have begun as soon as it was applied.
        self.last_write = now if sent is None else sent
        self.grace_until: float | None = None
        self.why: str | None = None  # why it was stopped, stuck, broken or lost
        self.outcome: str | None = None

    # -- while the consumer runs ----------------------------------------------------------------

    def progress(self, records: Sequence[dict], now: float) -> None:
        if records:
            self.pending.extend(records)
            self.last_activity = now

    def output_line(self, now: float) -> None:
        self.last_activity = now

    def broken(self, problem: str) -> list[Signal]:
        """The consumer wrote a progress line that is not a JSON object: stop it, dead-letter the task."""
        if self.phase not in _ACTIVE:
            return []
        self.phase, self.why = Phase.BROKEN, f"consumer broke the progress contract: {problem}"
        return [Signal(signal.SIGKILL)]

    def heartbeat(self) -> Renew | None:
        """What the heartbeat writes now: every pending record (they stay pending until it succeeded)."""
        if self.phase not in _ACTIVE:
            return None
        return Renew(tuple(self.pending))

    def renewed(self, renew: Renew, now: float) -> None:
        """The renewal succeeded: the records it carried are committed."""
        committed = len(renew.records)
        assert self.pending[:committed] == list(renew.records), "records are committed in the order they were read"
        del self.pending[:committed]
        self.last_write = now

    def renewal_failed(self, error: BaseException, now: float) -> list[Signal]:
        """A renewal raised. LeaseLost: stop at once. Anything else: try again, unless a TTL has passed."""
        if self.phase not in _ACTIVE:
            return []
        if isinstance(error, LeaseLost):
            self.phase, self.why = Phase.LOST, f"lease lost: {error}"
            return [Signal(signal.SIGKILL)]
        silent = now - self.last_write
        if silent >= self.options.lease_ttl_s:
            self.phase, self.why = Phase.LOST, f"no renewal for {silent:.0f}s, a whole TTL: the lease may be stolen ({error!r})"
            return [Signal(signal.SIGKILL)]
        return []

    def stop(self, reason: str, now: float) -> list[Signal]:
        """SIGTERM or a preemption notice: the consumer gets SIGTERM, the task is released (not an attempt)."""
        if self.phase not in (Phase.RUNNING, Phase.STUCK):
            return []
        if self.phase is Phase.RUNNING:
            self.grace_until = now + STOP_GRACE_S
        self.phase, self.why = Phase.STOPPING, reason
        return [Signal(signal.SIGTERM)]

    def tick(self, now: float) -> list[Signal]:
        """Time passed: escalate a stop after its grace; fire the backstop on a stuck or overlong consumer."""
        if self.phase in (Phase.STOPPING, Phase.STUCK):
            if self.grace_until is not None and now >= self.grace_until:
                self.grace_until = None
                return [Signal(signal.SIGKILL)]
            return []
        if self.phase is not Phase.RUNNING:
            return []
        o = self.options
        why = None
        if o.stuck_after_s is not None and now - self.last_activity >= o.stuck_after_s:
            why = f"no progress record and no output line for {now - self.last_activity:.0f}s (--stuck-after {o.stuck_after_s:g})"
        elif o.max_task_s is not None and now - self.started >= o.max_task_s:
            why = f"ran {now - self.started:.0f}s, over --max-task-time {o.max_task_s:g}"
        if why is None:
            return []
        self.phase, self.why, self.grace_until = Phase.STUCK, why, now + STOP_GRACE_S
        self.tally.stuck += 1
        return [Signal(signal.SIGTERM)]

    # -- the end --------------------------------------------------------------------------------

    def consumer_stays(self, stays: bool) -> bool:
        """A resident consumer just ended this task (before `exited`): whether it may serve the next one, by the
        phase the task is in (CONSUMER_STAYS) and what it said of its own state (`stays`)."""
        return stays and CONSUMER_STAYS.get(self.phase, False)

    def exited(self, exit_code: int, error: dict) -> FinalAction:
        """The consumer exited with `exit_code`; `error` is this attempt's error record should it count."""
        phase, self.phase = self.phase, Phase.EXITED
        records = tuple(self.pending)
        if phase is Phase.LOST:
            return Abandon(self.why or "lease lost")
        if phase is Phase.BROKEN:
            return DeadLetter(self.why or "consumer broke the progress contract", (), error)
        if phase is Phase.STUCK:
            error = {**error, "error": f"{self.why}\n{error.get('error', '')}".strip()}
        decision = ON_EXIT[(phase, exit_class(exit_code, self.options.is_slice_leader))]
        if decision == "complete":
            return Complete(records)
        if decision == "release":
            why = self.why if phase is Phase.STOPPING else "a slice host was stopped"
            return Release(records, None, why)
        if decision == "dead_letter":
            return DeadLetter(f"consumer exit {exit_code}: bad input", records, error)
        self.tally.failed_attempts += 1
        if self.attempt >= self.options.max_attempts:
            return DeadLetter(f"failed {self.attempt} attempts (last exit code {exit_code})", records, error)
        return Release(records, error, f"attempt {self.attempt} failed with exit code {exit_code}")

    def stale(self, now: float) -> Release | None:
        """Just before the consumer starts: the claim is ours only until a TTL after its write was sent.
        One older than that (its answer came late, or the machine was suspended in between: the clock
        counts suspension, taskqueue.clock) may have been taken over already: start nothing, and give
        the task back (a conditional write, refused if the lease is someone else's now). Not an attempt."""
        if self.phase is not Phase.RUNNING or now - self.last_write < self.options.lease_ttl_s:
            return None
        self.phase = Phase.EXITED
        return Release((), None, f"claimed {now - self.last_write:.0f}s after its write was sent, a whole TTL: "
                                 f"the lease may be someone else's")  # fmt: skip

    def start_failed(self, error: BaseException) -> Release:
        """Preparing the consumer failed (job.json unreadable, the slice's assignment refused): give the
        task back, not as an attempt: the task did nothing wrong."""
        self.phase = Phase.EXITED
        return Release((), None, f"could not start the consumer: {error!r}")

    def settled(self, action: FinalAction, result: str) -> None:
        """`result` of the final write: done, duplicate, released, dead, lost, unconfirmed or abandoned."""
        self.phase, self.outcome = Phase.SETTLED, result
        counts = {"done": "done", "duplicate": "duplicates", "released": "released", "dead": "dead_letters",
                  "lost": "lost", "unconfirmed": "unconfirmed", "abandoned": "lost"}  # fmt: skip
        name = counts[result]
        setattr(self.tally, name, getattr(self.tally, name) + 1)


# -- carrying the final action out on the real lease (both shells) ------------------------------


def perform_renew(lease: HeldLease, renew: Renew) -> None:
    lease.heartbeat(renew.records)


def perform_final(lease: HeldLease, action: FinalAction, started_mono: float) -> str:
    """Write what `action` says and return the result for `TaskRun.settled`.

    Never raises for a store failure: a write that did not return success is `unconfirmed`, and the
    worker must not take the task for finished (the lease stays its own until it expires).
    """
    try:
        if isinstance(action, Abandon):
            return "abandoned"
        if isinstance(action, Complete):
            return "done" if lease.complete(action.records, started_mono) else "duplicate"
        if isinstance(action, Release):
            lease.release(action.records, error=action.error)
            return "released"
        lease.dead_letter(action.reason, action.records, action.error)
        return "dead"
    except LeaseLost as exc:
        log.warning("event=lease_lost task=%s error=%s", lease.task_id, exc)
        return "lost"
    except StoreError as exc:
        log.error("event=outcome_unconfirmed task=%s action=%s error=%s", lease.task_id, type(action).__name__, exc)
        return "unconfirmed"
    except Exception as exc:  # noqa: BLE001 - a 403 or an expired credential: the outcome is unknown all the same
        log.exception("event=outcome_unconfirmed task=%s action=%s error=%r", lease.task_id, type(action).__name__, exc)
        return "unconfirmed"


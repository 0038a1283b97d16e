"""The worker's shell: threads, signals and the consumer subprocess around the worker core.

What the worker decides (on each consumer exit, heartbeat result, store error, stop request,
preemption notice, stuck consumer) lives in `taskqueue.worker.TaskRun`, which takes events and
returns actions and does no I/O; the deterministic simulation (`tests/simworld/seeds.py`) drives the same
core. This module only feeds it events and carries out its actions:

- the main thread claims (`Claimer`), starts the consumer in its own process group, and waits for
  it, ticking the core every 0.2 s (stop grace, the stuck-task backstop);
- a heartbeat thread reads the progress file and performs the core's renewals; it survives every
  exception and tells the core, which decides when the lease must be given up;
- a pump thread logs the consumer's output (each line is activity for the backstop);
- `request_stop` (a signal handler or the preemption watch) tells the core, which signals the consumer.

With `--resident` the consumer is started once and each task is a request on its standard input and a
reply on its standard output (`ResidentConsumer`, `_run_resident`); its log is pumped as above.

The consumer contract (environment variables, exit codes, resident requests and replies) is in docs/PROTOCOL.md.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

from jsonline import parse_object
from objectstore import ObjectStore, StoreError
from taskqueue import completion
from taskqueue.claims import Claim, Claimer, ClaimOptions
from taskqueue.clock import Clock
from taskqueue.process import TASK_VARIABLES, ConsumerSlot, ReplyError, ResidentConsumer, pump_output
from taskqueue.slice import AssignmentBoard, SliceOptions
from taskqueue.worker import (
    MAX_TAKEOVERS,
    SLICE_HOST_STOPPED,
    Abandon,
    DeadLetter,
    Release,
    RunOptions,
    Signal,
    Tally,
    TaskRun,
    perform_final,
    perform_renew,
    resident_exit_code,
    verdict_before_start,
)

log = logging.getLogger(__name__)

__all__ = ["MAX_TAKEOVERS", "SLICE_HOST_STOPPED", "ProgressError", "ProgressFile", "SpawnOptions", "Spawner", "Tally"]

ERROR_TAIL_LINES = 40
TASK_VARIABLES_SET = frozenset(TASK_VARIABLES)
MAX_PROGRESS_LINE = 64 * 1024
TICK_S = 0.2


class ProgressError(ValueError):
    """The consumer wrote a progress line that is not a JSON object."""


class ProgressFile:
    """Reads the complete lines a consumer has appended since the last call."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self._offset = 0

    def new_records(self) -> list[dict]:
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        end = chunk.rfind(b"\n") + 1  # a line still being written is left for next time
        records = []
        for line in chunk[:end].splitlines():
            if not line.strip():
                continue
            records.append(parse_object(line, MAX_PROGRESS_LINE, f"{self.path}: progress line", ProgressError))
        self._offset += end
        return records


@dataclasses.dataclass(frozen=True)
class SpawnOptions:
    consumer: list[str]
    worker: str
    lease_ttl_s: float = 120.0
    heartbeat_s: float = 30.0
    max_attempts: int = 3
    max_tasks: int | None = None
    idle_timeout_s: float = 300.0
    poll_min_s: float = 1.0
    poll_max_s: float = 30.0
    #: Set on a multi-host slice's leader (host 0): every claim is published to the followers.
    slice: SliceOptions | None = None
    #: The stuck-task backstop (taskqueue.worker): stop a consumer silent this long (no progress record,
    #: no output line), or running this long in all, and count the attempt as failed. None: never.
    stuck_after_s: float | None = None
    max_task_s: float | None = None
    #: How long a worker waits for the queue's job.json (and a first task) before it calls the queue
    #: URL wrong (taskqueue.completion.wait_for_job): covers a fleet started before its submit.
    job_wait_s: float = 60.0
    #: One consumer process for every task this worker runs (docs/PROTOCOL.md, "Resident consumers"), instead of
    #: one per task: its imports, devices, weights and programs stay loaded between tasks.
    resident: bool = False

    def __post_init__(self) -> None:
        if not self.consumer:
            raise ValueError("--consumer: give the command to run for each task, e.g. 'python consume.py'")
        if self.lease_ttl_s <= 0:
            raise ValueError(f"--lease-ttl must be positive, got {self.lease_ttl_s}")
        if not 0 < self.heartbeat_s <= self.lease_ttl_s / 3:
            raise ValueError(
                f"--heartbeat must be positive and at most a third of --lease-ttl ({self.lease_ttl_s / 3:g}s), "
                f"got {self.heartbeat_s}"
            )
        if self.max_attempts < 1:
            raise ValueError(f"--max-attempts must be at least 1, got {self.max_attempts}")
        if self.job_wait_s < 0:
            raise ValueError(f"--job-wait must be 0 or more seconds, got {self.job_wait_s}")
        for flag, value in (("--stuck-after", self.stuck_after_s), ("--max-task-time", self.max_task_s)):
            if value is not None and value <= 0:
                raise ValueError(f"{flag} must be a positive number of seconds (leave it out to disable), got {value}")


#: `on_state(state, **fields)`: told when the worker starts a task ("working", task=...) and when it
#: waits for work ("idle"). The cloud glue records it (spawn.py wires fleet.machines); the queue
#: never depends on what it does, and an exception from it is logged, not raised.
StateHook = Callable[..., None]


class Spawner:
    def __init__(
        self, store: ObjectStore, options: SpawnOptions, clock: Clock | None = None, on_state: StateHook | None = None
    ):
        self.on_state = on_state
        self.store = store
        self.options = options
        self.clock = clock or Clock()
        self.claimer = Claimer(
            store,
            ClaimOptions(
                worker=options.worker,
                lease_ttl_s=options.lease_ttl_s,
                idle_timeout_s=options.idle_timeout_s,
                poll_min_s=options.poll_min_s,
                poll_max_s=options.poll_max_s,
            ),
            self.clock,
        )
        self.tally = Tally()
        self.stop_reason: str | None = None
        self._stop = threading.Event()
        self._consumer = ConsumerSlot()
        self._resident = ResidentConsumer(options.consumer, self._resident_line) if options.resident else None
        self._tail: collections.deque[str] = collections.deque(maxlen=ERROR_TAIL_LINES)  # the resident task's
        self._job: bytes | None = None
        # The core of the task in hand, and the lock every thread takes to feed it an event.
        self._run: TaskRun | None = None
        self._core_lock = threading.RLock()  # re-entrant: a signal handler may run while the main thread holds it
        self.board = (
            AssignmentBoard(store, options.slice, options.worker, self.clock)
            if options.slice is not None and options.slice.is_leader
            else None
        )

    # -- control ----------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Stop soon: the running consumer gets SIGTERM, then its lease is released. Signal-safe."""
        if self._stop.is_set():
            return
        self.stop_reason = reason
        self._stop.set()
        self.claimer.stop()
        with self._core_lock:
            if self._run is not None:
                self._perform(self._run.stop(reason, self.clock.monotonic()))

    def tell_state(self, state: str, **fields: object) -> None:
        if self.on_state is None:
            return
        try:
            self.on_state(state, worker=self.options.worker, **fields)
        except Exception:  # noqa: BLE001 - the hook is the cloud glue's; it must never stop the worker
            log.exception("event=state_hook_failed state=%s", state)

    def _perform(self, signals: list[Signal]) -> None:
        for action in signals:
            self._consumer.signal(action.signum)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> str:
        """Drain the queue. Returns why it stopped: drained, idle, max_tasks or stopped. Raises
        completion.QueueMissing, having claimed and written nothing, when the queue URL names no
        queue (no job.json within `job_wait_s`, or no bucket): never `drained` on a typo."""
        log.info("event=worker_start worker=%s queue=%s", self.options.worker, self.store.root_url)
        self._job = completion.wait_for_job(self.store, self.options.job_wait_s, self.clock, self._stop)
        if self._job is None:
            log.info("event=worker_exit worker=%s reason=stopped waiting_for=job", self.options.worker)
            return "stopped"
        try:
            return self._drain()
        finally:
            if self._resident is not None and self._resident.proc is not None:
                code = self._resident.close()
                log.info("event=resident_exit exit_code=%s processes=%d", code, self._resident.starts)

    def _drain(self) -> str:
        handled = 0
        self.tell_state("idle")
        for claim in self.claimer:
            self.tell_state("working", task=claim.task_id, attempt=claim.lease.attempt)
            self._handle(claim)
            handled += 1
            if not self._stop.is_set():
                self.tell_state("idle", last_task=claim.task_id)
            if self._stop.is_set():
                break
            if self.options.max_tasks is not None and handled >= self.options.max_tasks:
                self.claimer.exit_reason = "max_tasks"
                break
        reason = "stopped" if self._stop.is_set() else self.claimer.exit_reason
        if reason == "drained":
            reason = self._confirm_drained()
        if self.board is not None:
            try:
                self.board.close(reason)  # the followers exit too
            except StoreError as exc:
                log.error("event=slice_close_failed error=%s", exc)
        log.info("event=worker_exit worker=%s reason=%s %s", self.options.worker, reason, self.tally.fields())
        return reason

    def _confirm_drained(self) -> str:
        """`drained` only when the completion rule (taskqueue.completion) holds on this worker's view:
        every region swept (nothing unfinished), no batch running, `batches/` unchanged across the
        claimer's last look, and a task submitted (wait_for_job saw one, and tasks are never deleted).
        The claimer's drain check is that rule on its listings; a view that fails it says why, and
        the worker leaves `idle` instead, which never claims the queue is finished."""
        progress = completion.QueueCount(total=1, unfinished=0, submitting=len(self.claimer.view.running))
        if progress.complete:
            return "drained"
        log.error("event=drain_refused worker=%s why=%r", self.options.worker, progress.why_not())
        return "idle"

    def run_options(self) -> RunOptions:
        o = self.options
        return RunOptions(
            lease_ttl_s=o.lease_ttl_s, heartbeat_s=o.heartbeat_s, max_attempts=o.max_attempts, worker=o.worker,
            is_slice_leader=self.board is not None, stuck_after_s=o.stuck_after_s, max_task_s=o.max_task_s,
        )  # fmt: skip

    def _handle(self, claim: Claim) -> None:
        lease = claim.lease
        run = TaskRun(claim.task_id, lease.attempt, self.run_options(), self.clock.monotonic(), self.tally,
                      sent=lease.last_write)  # fmt: skip
        verdict = verdict_before_start(int(lease.body.get("takeovers", 0)), claim.problem if claim.manifest is None else None)
        if verdict is not None:
            log.error("event=dead_letter_unrun task=%s reason=%r", claim.task_id, verdict)
            self._settle(run, lease, DeadLetter(verdict, (), None))
            return
        workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"spawn-{claim.task_id}-"))
        try:
            self._settle(run, lease, self._run_consumer(claim, run, workdir))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _settle(self, run: TaskRun, lease, action) -> None:
        result = perform_final(lease, action, run.started)
        run.settled(action, result)
        fields = f"task={lease.task_id} token={lease.token} action={type(action).__name__} result={result}"
        if result == "done":
            log.info("event=done %s outputs=%d", fields, len(lease.committed))
        elif result == "dead":
            log.error("event=dead_letter %s reason=%r", fields, action.reason)
        elif isinstance(action, Release) and result == "released":
            log.info("event=released %s why=%r committed=%d", fields, action.why, len(lease.committed))
        else:
            log.warning("event=task_settled %s why=%r", fields, getattr(action, "why", ""))

    def _job_bytes(self) -> bytes:
        if self._job is None:
            self._job = completion.read_job(self.store)
        return self._job

    def _prepare(self, claim: Claim, workdir: pathlib.Path) -> tuple[dict[str, str], pathlib.Path]:
        """The consumer's files and environment (docs/PROTOCOL.md, "The consumer contract")."""
        lease = claim.lease
        files = {
            "SPAWN_TASK_FILE": workdir / "task.json",
            "SPAWN_JOB_FILE": workdir / "job.json",
            "SPAWN_RESUME_FILE": workdir / "resume.json",
            "SPAWN_PROGRESS_FILE": workdir / "progress.jsonl",
        }
        files["SPAWN_TASK_FILE"].write_text(json.dumps(claim.manifest))
        files["SPAWN_JOB_FILE"].write_bytes(self._job_bytes())
        files["SPAWN_RESUME_FILE"].write_text(
            json.dumps({"task": claim.task_id, "attempt": lease.attempt, "progress": lease.committed})
        )
        files["SPAWN_PROGRESS_FILE"].touch()
        env = dict(os.environ)
        env.update({key: str(path) for key, path in files.items()})
        env.update(
            SPAWN_TASK_ID=claim.task_id,
            SPAWN_ATTEMPT=str(lease.attempt),
            SPAWN_OUTPUT=self.store.url(lease.output_prefix),
        )
        if self.board is not None:
            env.update(self.options.slice.consumer_env())
            if self._resident is None:  # a resident one's program is named once it runs (`_run_resident`)
                self.board.assign(lease, claim.manifest, env["SPAWN_OUTPUT"])
        return env, files["SPAWN_PROGRESS_FILE"]

    def _run_consumer(self, claim: Claim, run: TaskRun, workdir: pathlib.Path):
        """Run the consumer under the core; returns the core's final action."""
        lease = claim.lease
        try:
            env, progress_path = self._prepare(claim, workdir)
        except Exception as exc:  # noqa: BLE001 - job.json unreadable, a 403, the slice refused: give the task back
            log.error("event=consumer_not_started task=%s error=%r", claim.task_id, exc)
            return run.start_failed(exc)
        stale = run.stale(self.clock.monotonic())
        if stale is not None:
            log.warning("event=consumer_not_started task=%s why=%r", claim.task_id, stale.why)
            return stale
        progress = ProgressFile(progress_path)
        if self._resident is not None:
            return self._run_resident(claim, run, env, progress)
        tail: collections.deque[str] = collections.deque(maxlen=ERROR_TAIL_LINES)
        with self._core_lock:
            proc = self._consumer.start(self.options.consumer, env)
            self._run = run
            if self._stop.is_set():  # a stop that arrived while we were starting it
                self._perform(run.stop(self.stop_reason or "stopped", self.clock.monotonic()))
        log.info("event=consumer_start task=%s pid=%d attempt=%d", claim.task_id, proc.pid, lease.attempt)
        pump = threading.Thread(target=self._pump, args=(proc, claim.task_id, tail, run), daemon=True)
        pump.start()
        beat_stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat_loop, args=(lease, run, progress, beat_stop), daemon=True)
        beat.start()
        try:
            exit_code = self._wait(proc, run)
        finally:
            beat_stop.set()
            beat.join()
            pump.join(timeout=5)
            with self._core_lock:
                self._consumer.clear()
                self._run = None
            self._withdraw(claim.task_id, proc.returncode)
        with self._core_lock:
            self._read_progress(run, progress)
        log.info(
            "event=consumer_exit task=%s exit_code=%d seconds=%.1f",
            claim.task_id, exit_code, self.clock.monotonic() - run.started,
        )  # fmt: skip
        return self._exited(claim, run, exit_code, "\n".join(tail))

    def _run_resident(self, claim: Claim, run: TaskRun, env: dict[str, str], progress: ProgressFile):
        """The task on the resident consumer (started first if none runs): one request, then its reply or the
        process's exit, under the same core, heartbeats and backstop as a per-task consumer. Returns the core's
        final action; the consumer serves the next task only if the core says so (`TaskRun.consumer_stays`)."""
        resident, lease = self._resident, claim.lease
        with self._core_lock:
            if not resident.running():
                if resident.proc is not None:  # it died between tasks: not this task's fault, nor an attempt
                    log.warning("event=resident_lost exit_code=%s: starting another", resident.close(grace_s=0))
                resident.start({k: v for k, v in env.items() if k not in TASK_VARIABLES_SET})
                log.info("event=resident_start pid=%d processes=%d", resident.proc.pid, resident.starts)
        if self.board is not None:
            # The followers' resident consumers serve this task with this process's program (taskqueue/slice.py):
            # a new process is a new JAX program, which they join with new processes of their own.
            try:
                self.board.assign(lease, claim.manifest, env["SPAWN_OUTPUT"], program=self._program())
            except Exception as exc:  # noqa: BLE001 - as in _prepare: the slice refused, give the task back
                log.error("event=consumer_not_started task=%s error=%r", claim.task_id, exc)
                return run.start_failed(exc)
        with self._core_lock:
            self._consumer.hold(resident.proc)
            self._tail.clear()
            self._run = run
            if self._stop.is_set():  # a stop that arrived while we were starting it
                self._perform(run.stop(self.stop_reason or "stopped", self.clock.monotonic()))
        proc = resident.proc
        sent = resident.send(claim.task_id, env, self.clock.monotonic() - run.started)
        log.info("event=consumer_start task=%s pid=%d attempt=%d resident=true task_on_process=%d",
                 claim.task_id, proc.pid, lease.attempt, resident.started_tasks)  # fmt: skip
        beat_stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat_loop, args=(lease, run, progress, beat_stop), daemon=True)
        beat.start()
        try:
            reply = self._wait_reply(proc, run, claim.task_id) if sent else None
        finally:
            beat_stop.set()
            beat.join()
            with self._core_lock:
                self._run = None
        process_code = proc.poll()
        exit_code = resident_exit_code(None if reply is None else reply["exit_code"], process_code)
        self._withdraw(claim.task_id, exit_code)
        with self._core_lock:
            self._read_progress(run, progress)
            stays = run.consumer_stays(reply is not None and reply["stays"])
            tail = "\n".join(self._tail)
        if not stays:
            code = resident.close()
            log.info("event=resident_exit task=%s exit_code=%s why=%s", claim.task_id, code,
                     "its state is not sound" if reply is not None and not reply["stays"] else run.phase.value)  # fmt: skip
        with self._core_lock:
            self._consumer.clear()
        log.info(
            "event=consumer_exit task=%s exit_code=%d seconds=%.1f resident=true replied=%s stays=%s",
            claim.task_id, exit_code, self.clock.monotonic() - run.started, reply is not None, stays,
        )  # fmt: skip
        return self._exited(claim, run, exit_code, tail)

    def _exited(self, claim: Claim, run: TaskRun, exit_code: int, tail: str):
        """The core's action for a consumer's exit (or a resident one's reply), its output's tail as the error."""
        error = {
            "attempt": claim.lease.attempt,
            "worker": self.options.worker,
            "exit_code": exit_code,
            "error": tail[-4000:],
            "at": self.clock.wall_iso(),
        }
        with self._core_lock:
            action = run.exited(exit_code, error)
        if isinstance(action, Abandon):
            log.warning("event=lease_lost task=%s why=%s", claim.task_id, action.why)
        return action

    def _wait_reply(self, proc: subprocess.Popen, run: TaskRun, task_id: str) -> dict | None:
        """The resident consumer's reply to `task_id`, or None when the process ended without one; ticks the core
        meanwhile as `_wait` does. A line that is not this task's reply ends the process (it broke the protocol:
        its state is unknown) and counts as its exit without a reply."""
        while True:
            reply = self._resident.reply(TICK_S)
            if isinstance(reply, ReplyError) or (isinstance(reply, dict) and reply["task"] != task_id):
                log.error("event=resident_reply_broken task=%s error=%s", task_id,
                          reply if isinstance(reply, ReplyError) else f"a reply for task {reply['task']!r}")  # fmt: skip
                self._consumer.signal(signal.SIGKILL)
                proc.wait()
                return None
            if reply is not None:
                return reply
            if proc.poll() is not None:
                return self._resident.reply(0.5)  # a reply written just before it exited (a stop's)
            with self._core_lock:
                signals = run.tick(self.clock.monotonic())
                for action in signals:
                    event = "consumer_kill" if action.signum == signal.SIGKILL else "consumer_stuck"
                    log.warning("event=%s task=%s pid=%d phase=%s why=%r", event, run.task_id, proc.pid,
                                run.phase.value, run.why)  # fmt: skip
                self._perform(signals)

    def _program(self) -> str:
        """The name of the resident consumer's JAX program on a slice: this worker's, and its process count."""
        return f"{self.options.worker}.{self._resident.starts}"

    def _resident_line(self, line: str) -> None:
        """A line of the resident consumer's log: logged under the task it runs, kept for its error record, and
        activity for the stuck-task backstop."""
        with self._core_lock:
            run = self._run
            self._tail.append(line)
            if run is not None:
                run.output_line(self.clock.monotonic())
        logging.getLogger("consumer").info("task=%s | %s", run.task_id if run is not None else "-", line)

    def _pump(self, proc: subprocess.Popen, task_id: str, tail: collections.deque, run: TaskRun) -> None:
        def activity() -> None:
            with self._core_lock:
                run.output_line(self.clock.monotonic())

        pump_output(proc, task_id, tail, on_line=activity)

    def _read_progress(self, run: TaskRun, progress: ProgressFile) -> list[Signal]:
        """Caller holds the core lock. New progress records go to the core, which keeps them pending."""
        try:
            run.progress(progress.new_records(), self.clock.monotonic())
        except ProgressError as exc:
            log.error("event=progress_broken task=%s error=%s", run.task_id, exc)
            return run.broken(str(exc))
        return []

    def _withdraw(self, task_id: str, exit_code: int | None) -> None:
        """Followers stop once their consumer's task is no longer assigned (their consumers have failed or
        finished with ours: they are one JAX program)."""
        if self.board is None:
            return
        try:
            self.board.withdraw(task_id, exit_code)
        except StoreError as exc:  # the followers also stop when the lease goes away
            log.error("event=slice_withdraw_failed task=%s error=%s", task_id, exc)

    def _wait(self, proc: subprocess.Popen, run: TaskRun) -> int:
        """Wait for the consumer, ticking the core: it escalates a stop after the grace and fires the backstop."""
        while True:
            try:
                return proc.wait(timeout=TICK_S)
            except subprocess.TimeoutExpired:
                pass
            with self._core_lock:
                signals = run.tick(self.clock.monotonic())
                for action in signals:
                    # SIGKILL: a stop's grace ran out; SIGTERM: the stuck-task backstop fired.
                    event = "consumer_kill" if action.signum == signal.SIGKILL else "consumer_stuck"
                    log.warning("event=%s task=%s pid=%d phase=%s why=%r", event, run.task_id, proc.pid, run.phase.value, run.why)
                self._perform(signals)

    def _heartbeat_loop(self, lease, run: TaskRun, progress: ProgressFile, stop: threading.Event) -> None:
        """Renew every heartbeat_s until the consumer exits. Survives every exception: the core decides
        (LeaseLost or a whole TTL of failures ends the task; anything else is tried again next beat)."""
        while not stop.wait(self.options.heartbeat_s):
            with self._core_lock:
                self._perform(self._read_progress(run, progress))
                renew = run.heartbeat()
            if renew is None:
                return
            try:
                perform_renew(lease, renew)
            except Exception as exc:  # noqa: BLE001 - every failure goes to the core, none ends this thread unheard
                with self._core_lock:
                    signals = run.renewal_failed(exc, self.clock.monotonic())
                    self._perform(signals)
                    phase = run.phase
                log.log(
                    logging.ERROR if signals else logging.WARNING,
                    "event=heartbeat_failed task=%s phase=%s silent_s=%.1f error=%r",
                    lease.task_id, phase.value, self.clock.monotonic() - run.last_write, exc,
                )  # fmt: skip
                continue
            with self._core_lock:
                run.renewed(renew, self.clock.monotonic())


def resolve_consumer(command: list[str]) -> list[str]:
    """`python ...` means this interpreter, so a worker started from a venv runs consumers in it."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return command

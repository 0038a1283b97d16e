"""The worker: claim a task, run the consumer on it, heartbeat, and record how it ended.

One consumer subprocess at a time, in its own process group so that a stop reaches everything it
started. The consumer contract (environment variables, exit codes) is in docs/PROTOCOL.md.
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

from objectstore import NotFound, ObjectStore, StoreError
from taskqueue import layout
from taskqueue.claims import Claim, Claimer, ClaimOptions
from taskqueue.clock import Clock
from taskqueue.lease import HeldLease, LeaseLost
from taskqueue.process import STOP_GRACE_S, ConsumerSlot, pump_output
from taskqueue.slice import AssignmentBoard, SliceOptions

log = logging.getLogger(__name__)

EX_DATAERR = 65
ERROR_TAIL_LINES = 40
#: Expiries are not attempts (a dead machine is not the task's fault), but a task whose holders
#: keep dying without a word is poison: after this many steals it is dead-lettered.
MAX_TAKEOVERS = 10
MAX_PROGRESS_LINE = 64 * 1024
#: A slice consumer's exit code when one of its hosts was stopped by SIGTERM (docs/PROTOCOL.md, "Slices").
SLICE_HOST_STOPPED = 128 + signal.SIGTERM


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
            if len(line) > MAX_PROGRESS_LINE:
                raise ProgressError(f"{self.path}: a progress line is {len(line)} bytes, over {MAX_PROGRESS_LINE}")
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ProgressError(f"{self.path}: progress line is not JSON ({exc}): {line[:200]!r}") from None
            if not isinstance(record, dict):
                raise ProgressError(f"{self.path}: progress line is not a JSON object: {line[:200]!r}")
            records.append(record)
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


@dataclasses.dataclass
class Tally:
    done: int = 0
    failed_attempts: int = 0
    dead_letters: int = 0
    released: int = 0
    lost: int = 0
    duplicates: int = 0


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
        self._job: bytes | None = None
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
        self._consumer.signal(signal.SIGTERM)

    def tell_state(self, state: str, **fields: object) -> None:
        if self.on_state is None:
            return
        try:
            self.on_state(state, worker=self.options.worker, **fields)
        except Exception:  # noqa: BLE001 - the hook is the cloud glue's; it must never stop the worker
            log.exception("event=state_hook_failed state=%s", state)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> str:
        """Drain the queue. Returns why it stopped: drained, idle, max_tasks or stopped."""
        log.info("event=worker_start worker=%s queue=%s", self.options.worker, self.store.root_url)
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
        if self.board is not None:
            try:
                self.board.close(reason)  # the followers exit too
            except StoreError as exc:
                log.error("event=slice_close_failed error=%s", exc)
        log.info("event=worker_exit worker=%s reason=%s %s", self.options.worker, reason, _fields(self.tally))
        return reason

    def _handle(self, claim: Claim) -> None:
        takeovers = int(claim.lease.body.get("takeovers", 0))
        if takeovers >= MAX_TAKEOVERS:
            self._dead_letter(claim.lease, f"its lease expired {takeovers} times: every holder died running it", (), None)
            return
        if claim.manifest is None:
            log.error("event=bad_manifest task=%s reason=%r", claim.task_id, claim.problem)
            self._dead_letter(claim.lease, f"bad manifest: {claim.problem}", (), None)
            return
        workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"spawn-{claim.task_id}-"))
        try:
            self._run_consumer(claim, workdir)
        except LeaseLost as exc:
            self.tally.lost += 1
            log.warning("event=lease_lost task=%s error=%s", claim.task_id, exc)
        except StoreError as exc:
            # The lease stays ours until it expires; the next holder resumes from what was committed.
            log.error("event=store_error task=%s error=%s", claim.task_id, exc)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _job_bytes(self) -> bytes:
        if self._job is None:
            try:
                self._job = self.store.read(layout.JOB).data
            except NotFound:
                self._job = b"{}"
        return self._job

    def _run_consumer(self, claim: Claim, workdir: pathlib.Path) -> None:
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
            try:
                self.board.assign(lease, claim.manifest, env["SPAWN_OUTPUT"])
            except StoreError as exc:
                # The followers cannot join, so neither can we: give the task back (not an attempt).
                log.error("event=slice_assign_failed task=%s error=%s", claim.task_id, exc)
                lease.release()
                self.tally.released += 1
                return
        progress = ProgressFile(files["SPAWN_PROGRESS_FILE"])
        started = self.clock.monotonic()
        tail: collections.deque[str] = collections.deque(maxlen=ERROR_TAIL_LINES)
        proc = self._consumer.start(self.options.consumer, env)
        if self._stop.is_set():  # a stop that arrived while we were starting it
            self._consumer.signal(signal.SIGTERM)
        log.info("event=consumer_start task=%s pid=%d attempt=%d", claim.task_id, proc.pid, lease.attempt)
        pump = threading.Thread(target=pump_output, args=(proc, claim.task_id, tail), daemon=True)
        pump.start()
        beat_stop = threading.Event()
        trouble: list[BaseException] = []
        beat = threading.Thread(
            target=self._heartbeat_loop, args=(lease, progress, beat_stop, trouble), daemon=True
        )
        beat.start()
        try:
            exit_code = self._wait(proc)
        finally:
            beat_stop.set()
            beat.join()
            pump.join(timeout=5)
            self._consumer.clear()
            self._withdraw(claim.task_id, proc.returncode)
        error = {
            "attempt": lease.attempt,
            "worker": self.options.worker,
            "exit_code": exit_code,
            "error": "\n".join(tail)[-4000:],
            "at": self.clock.wall_iso(),
        }
        if trouble and isinstance(trouble[0], LeaseLost):
            raise trouble[0]
        try:
            records = progress.new_records()
        except ProgressError as exc:
            trouble.append(exc)
        if trouble:
            self._dead_letter(lease, f"consumer broke the progress contract: {trouble[0]}", (), error)
            return
        log.info("event=consumer_exit task=%s exit_code=%d seconds=%.1f", claim.task_id, exit_code, self.clock.monotonic() - started)
        if self._stop.is_set() or (self.board is not None and exit_code == SLICE_HOST_STOPPED):
            # On a slice, 128+SIGTERM from our consumer while we were not stopped means another host
            # was (preempted, maintenance): like our own stop, that is not the task's fault.
            lease.release(records)
            self.tally.released += 1
            reason = self.stop_reason if self._stop.is_set() else "a slice host was stopped"
            log.info("event=released task=%s reason=%r committed=%d", claim.task_id, reason, len(lease.committed))
        elif exit_code == 0:
            if lease.complete(records, started):
                self.tally.done += 1
                log.info("event=done task=%s token=%d outputs=%d", claim.task_id, lease.token, len(lease.committed))
            else:
                self.tally.duplicates += 1
        elif exit_code == EX_DATAERR:
            self._dead_letter(lease, "consumer exit 65: bad input", records, error)
        else:
            self.tally.failed_attempts += 1
            if lease.attempt >= self.options.max_attempts:
                self._dead_letter(lease, f"failed {lease.attempt} attempts (last exit code {exit_code})", records, error)
            else:
                lease.release(records, error=error)
                log.warning("event=attempt_failed task=%s attempt=%d exit_code=%d", claim.task_id, lease.attempt, exit_code)

    def _withdraw(self, task_id: str, exit_code: int | None) -> None:
        """Followers stop once their consumer's task is no longer assigned (their consumers have failed or
        finished with ours: they are one JAX program)."""
        if self.board is None:
            return
        try:
            self.board.withdraw(task_id, f"consumer exit {exit_code}")
        except StoreError as exc:  # the followers also stop when the lease goes away
            log.error("event=slice_withdraw_failed task=%s error=%s", task_id, exc)

    def _dead_letter(self, lease: HeldLease, reason: str, records, error: dict | None) -> None:
        lease.dead_letter(reason, records, error)
        self.tally.dead_letters += 1
        log.error("event=dead_letter task=%s reason=%r", lease.task_id, reason)

    def _wait(self, proc: subprocess.Popen) -> int:
        """Wait for the consumer; after a stop, give it STOP_GRACE_S and then kill its process group."""
        deadline: float | None = None
        while True:
            try:
                return proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if self._stop.is_set():
                now = self.clock.monotonic()
                deadline = deadline if deadline is not None else now + STOP_GRACE_S
                if now >= deadline:
                    log.warning("event=consumer_kill pid=%d reason=stop_grace_exceeded", proc.pid)
                    self._consumer.signal(signal.SIGKILL)

    def _heartbeat_loop(
        self, lease: HeldLease, progress: ProgressFile, stop: threading.Event, trouble: list[BaseException]
    ) -> None:
        ttl = self.options.lease_ttl_s
        while not stop.wait(self.options.heartbeat_s):
            try:
                lease.heartbeat(progress.new_records())
            except (LeaseLost, ProgressError) as exc:
                trouble.append(exc)
                log.error("event=heartbeat_stop task=%s error=%s", lease.task_id, exc)
                self._consumer.signal(signal.SIGKILL)  # commit nothing more, at once
                return
            except StoreError as exc:
                silent = self.clock.monotonic() - lease.last_write
                log.warning("event=heartbeat_failed task=%s silent_s=%.1f error=%s", lease.task_id, silent, exc)
                if silent >= ttl:
                    lease.lost = True
                    trouble.append(LeaseLost(f"no heartbeat for {silent:.0f}s, a whole TTL: the lease may be stolen"))
                    self._consumer.signal(signal.SIGKILL)
                    return


def _fields(tally: Tally) -> str:
    return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(tally).items())


def resolve_consumer(command: list[str]) -> list[str]:
    """`python ...` means this interpreter, so a worker started from a venv runs consumers in it."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return command

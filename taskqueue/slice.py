"""A multi-host slice as one claimant: the leader publishes its task, the followers run their share of it.

The contract (docs/PROTOCOL.md, "Slices"):

- **Who writes the assignment.** Only the slice's leader (host 0) writes `slices/<slice-id>/assignment.json`,
  each write conditional on the generation of its own previous write (create-if-absent the first time),
  so a second process that believes it leads the same slice gets a 412 instead of silently taking turns.
- **When.** `assigned` only after the leader holds the task's lease (created from nothing, or taken
  over after the takeover's done check), before its own consumer starts; `idle` as soon as its
  consumer has exited, whatever the outcome; `closed` when the leader's worker exits.
- **When a follower may start.** A follower runs a consumer only for an `assigned` assignment that it
  has not run before (task and fencing token) and whose lease the leader still holds: the lease object
  is `held`, by the worker named in the assignment, with the claim's nonce. A lease carries its nonce
  through every heartbeat and changes it on every new claim, so a stolen or re-claimed lease never
  matches.
- **When it must stop.** The follower re-reads the assignment and the lease every `watch_s` seconds
  while its consumer runs, and stops it (SIGTERM, then SIGKILL after the grace) as soon as the
  assignment is no longer this one or the lease is no longer the leader's. A follower writes nothing
  to the queue: the leader's lease and progress file are the single truth.

This module never imports JAX or the cloud glue; the roles come in as options.
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
import tempfile
import threading

from objectstore import NotFound, ObjectStore, PreconditionFailed, StoreError
from taskqueue import completion, layout
from taskqueue.clock import Clock
from taskqueue.lease import DONE, HELD, HeldLease
from taskqueue.process import STOP_GRACE_S, TASK_VARIABLES, ConsumerSlot, ResidentConsumer, pump_output

log = logging.getLogger(__name__)

SLICES = "slices/"
ASSIGNED, IDLE, CLOSED = "assigned", "idle", "closed"
#: How long a follower's consumer may take to exit (or reply) once the leader's consumer finished the task well: all
#: hosts passed its last step together, so only the exit is left (jax.distributed's shutdown barrier is 30 s).
FINISH_WAIT_S = 40.0


class SliceConflict(StoreError):
    """Someone else wrote this slice's assignment: two processes believe they lead the same slice."""


def assignment_object(slice_id: str) -> str:
    return f"{SLICES}{slice_id}/assignment.json"


@dataclasses.dataclass(frozen=True)
class SliceOptions:
    """This host's place in its slice (from the TPU metadata, via spawn.py's options)."""

    slice_id: str
    hosts: int
    host_index: int
    coordinator: str  # host:port of the leader's JAX coordination service
    heartbeat_timeout_s: int | None = None  # jax.distributed heartbeat timeout handed to consumers

    def __post_init__(self) -> None:
        if not layout.TASK_ID.fullmatch(self.slice_id):
            raise ValueError(f"--slice-id {self.slice_id!r}: use letters, digits, '.', '_' or '-'")
        if self.hosts < 2:
            raise ValueError(f"--slice-hosts must be at least 2 for a slice, got {self.hosts}")
        if not 0 <= self.host_index < self.hosts:
            raise ValueError(f"--host-index must be in 0..{self.hosts - 1}, got {self.host_index}")
        host, sep, port = self.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--coordinator {self.coordinator!r}: give ADDRESS:PORT of host 0")

    @property
    def is_leader(self) -> bool:
        return self.host_index == 0

    def consumer_env(self) -> dict[str, str]:
        """What a consumer needs to join the slice's JAX program (extract/multihost.py reads it)."""
        env = {
            "SPAWN_SLICE_ID": self.slice_id,
            "SPAWN_SLICE_HOSTS": str(self.hosts),
            "SPAWN_HOST_INDEX": str(self.host_index),
            "SPAWN_COORDINATOR": self.coordinator,
        }
        if self.heartbeat_timeout_s is not None:
            env["SPAWN_SLICE_HEARTBEAT_TIMEOUT"] = str(self.heartbeat_timeout_s)
        return env


class AssignmentBoard:
    """The leader's side: publishes what the slice works on. Every write is fenced by the previous one."""

    def __init__(self, store: ObjectStore, options: SliceOptions, worker: str, clock: Clock):
        self.store = store
        self.options = options
        self.worker = worker
        self.clock = clock
        self.name = assignment_object(options.slice_id)
        self._generation: int | None = None
        self._lock = threading.Lock()

    def _publish(self, body: dict) -> None:
        body = {**body, "slice": self.options.slice_id, "hosts": self.options.hosts, "leader": self.worker,
                "at": self.clock.wall_iso()}  # fmt: skip
        data = json.dumps(body, separators=(",", ":")).encode()
        # Listed by tools/status.py without a GET: a slice shows as one worker with its host count.
        metadata = {"state": body["state"], "leader": self.worker, "hosts": str(self.options.hosts)}
        with self._lock:
            if self._generation is None:
                try:
                    self._generation = self.store.read(self.name).generation  # a previous run of this leader
                except NotFound:
                    self._generation = 0
            try:
                if self._generation == 0:
                    self._generation = self.store.create(self.name, data, metadata=metadata)
                else:
                    self._generation = self.store.write(self.name, data, if_generation=self._generation, metadata=metadata)
            except (PreconditionFailed, NotFound) as exc:
                raise SliceConflict(
                    f"{self.name}: changed by someone else ({exc}); is another process leading slice "
                    f"{self.options.slice_id}? Only host 0 of a slice may run spawn.py with --host-index 0"
                ) from exc
        log.info("event=slice_assignment slice=%s state=%s task=%s", self.options.slice_id, body["state"], body.get("task"))

    def assign(self, lease: HeldLease, manifest: dict, output_url: str, program: str | None = None) -> None:
        """Publish the task the leader now holds; call before sending it to the leader's own consumer. `program`
        names the leader's resident consumer (its JAX program), which the followers' resident consumers serve
        with it; None: per-task consumers."""
        body = {
            "state": ASSIGNED,
            "task": lease.task_id,
            "fencing_token": lease.token,
            "nonce": lease.body["nonce"],
            "attempt": lease.attempt,
            "manifest": manifest,
            "resume": {"task": lease.task_id, "attempt": lease.attempt, "progress": lease.committed},
            "output": output_url,
        }
        if program is not None:
            body["program"] = program
        self._publish(body)

    def withdraw(self, task_id: str, exit_code: int | None) -> None:
        """The leader's consumer is done with `task_id` (exit 0: it finished it, with every host's share)."""
        self._publish({"state": IDLE, "task": task_id, "outcome": f"consumer exit {exit_code}", "exit_code": exit_code})

    def close(self, reason: str) -> None:
        self._publish({"state": CLOSED, "reason": reason})


class Follower:
    """A follower host's worker loop: run the consumer on whatever the leader assigns, for as long as it holds it.

    Per-task or resident as the leader is: an assignment that names a `program` is served by this host's resident
    consumer of that program (started for it if none runs; one of another program is closed first, since a JAX
    program cannot take a new process in place of one it lost); one without runs a fresh consumer.
    """

    def __init__(
        self,
        store: ObjectStore,
        options: SliceOptions,
        consumer: list[str],
        worker: str,
        *,
        idle_timeout_s: float,
        poll_s: float,
        watch_s: float,
        clock: Clock | None = None,
    ):
        self.store = store
        self.options = options
        self.consumer = consumer
        self.worker = worker
        self.idle_timeout_s = idle_timeout_s
        self.poll_s = poll_s
        self.watch_s = watch_s
        self.clock = clock or Clock()
        self.name = assignment_object(options.slice_id)
        self.runs = 0
        self._stop = threading.Event()
        self._consumer = ConsumerSlot()
        self._job: bytes | None = None
        self._task_id = "-"
        self._resident = ResidentConsumer(consumer, self._resident_line)
        self._program: str | None = None  # the program this host's resident consumer joined
        self._signalled = False

    def request_stop(self, reason: str) -> None:
        """Signal-safe: stop the consumer and leave the loop."""
        log.info("event=follower_stop_requested reason=%s", reason)
        self._stop.set()
        self._signal(signal.SIGTERM)

    def _signal(self, signum: int) -> None:
        self._signalled = True  # a resident consumer signalled during a task never serves another
        self._consumer.signal(signum)

    # -- reading the leader's state --------------------------------------------------------------

    def _assignment(self) -> dict | None:
        try:
            return json.loads(self.store.read(self.name).data)
        except NotFound:
            return None

    def _lease(self, assignment: dict) -> dict | None:
        try:
            return json.loads(self.store.read(layout.lease_object(assignment["task"])).data)
        except NotFound:
            return None

    def _leader_holds(self, assignment: dict) -> bool:
        """The lease is still the leader's claim that the assignment names."""
        lease = self._lease(assignment)
        return (
            lease is not None
            and lease.get("state") == HELD
            and lease.get("worker") == assignment.get("leader")
            and lease.get("nonce") == assignment.get("nonce")
        )

    def _finished_well(self, current: dict | None, assignment: dict) -> bool:
        """The leader's consumer finished the assignment's task with exit 0 (withdrawn so, or its lease completed):
        every host's consumer has passed the task's last step, and this one's reply is on its way."""
        if current is not None and current.get("state") == IDLE and current.get("task") == assignment["task"]:
            return current.get("exit_code") == 0
        lease = self._lease(assignment)
        return lease is not None and lease.get("state") == DONE and lease.get("nonce") == assignment.get("nonce")

    @staticmethod
    def _key(assignment: dict) -> tuple[str, int, str]:
        return assignment.get("task", ""), int(assignment.get("fencing_token", 0)), str(assignment.get("program", ""))

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> str:
        """Follow until the leader closes the slice (`leader_exit`), nothing is assigned for the idle
        timeout (`idle`), or a stop (`stopped`)."""
        log.info("event=follower_start worker=%s slice=%s host=%d/%d", self.worker, self.options.slice_id,
                 self.options.host_index, self.options.hosts)  # fmt: skip
        done: set[tuple[str, int, str]] = set()
        idle_since = self.clock.monotonic()
        reason = "stopped"
        try:
            while not self._stop.is_set():
                try:
                    assignment = self._assignment()
                    if assignment is not None and assignment.get("state") == CLOSED:
                        reason = "leader_exit"
                        break
                    if (
                        assignment is not None
                        and assignment.get("state") == ASSIGNED
                        and self._key(assignment) not in done
                        and self._leader_holds(assignment)
                    ):
                        done.add(self._key(assignment))
                        self._run_one(assignment)
                        idle_since = self.clock.monotonic()
                        continue
                except StoreError as exc:
                    log.warning("event=follower_store_error error=%s", exc)
                if self.clock.monotonic() - idle_since >= self.idle_timeout_s:
                    reason = "idle"
                    break
                self._stop.wait(self.poll_s)
        finally:
            if self._resident.proc is not None:
                code = self._close_resident(grace_s=STOP_GRACE_S)
                log.info("event=follower_resident_exit exit_code=%s processes=%d", code, self._resident.starts)
        log.info("event=follower_exit worker=%s reason=%s runs=%d", self.worker, reason, self.runs)
        return reason

    def _job_bytes(self) -> bytes:
        if self._job is None:
            self._job = completion.read_job(self.store)
        return self._job

    def _run_one(self, assignment: dict) -> None:
        task_id = assignment["task"]
        workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"follow-{task_id}-"))
        try:
            files = {
                "SPAWN_TASK_FILE": workdir / "task.json",
                "SPAWN_JOB_FILE": workdir / "job.json",
                "SPAWN_RESUME_FILE": workdir / "resume.json",
                "SPAWN_PROGRESS_FILE": workdir / "progress.jsonl",  # process 0 sends our records to the leader
            }
            files["SPAWN_TASK_FILE"].write_text(json.dumps(assignment["manifest"]))
            files["SPAWN_JOB_FILE"].write_bytes(self._job_bytes())
            files["SPAWN_RESUME_FILE"].write_text(json.dumps(assignment["resume"]))
            files["SPAWN_PROGRESS_FILE"].touch()
            env = dict(os.environ)
            env.update(self.options.consumer_env())
            task_env = {key: str(path) for key, path in files.items()}
            task_env.update(SPAWN_TASK_ID=task_id, SPAWN_ATTEMPT=str(assignment["attempt"]), SPAWN_OUTPUT=assignment["output"])
            if assignment.get("program") is not None:
                self._run_resident(assignment, env, task_env)
                return
            env.update(task_env)
            tail: collections.deque[str] = collections.deque(maxlen=40)
            proc = self._consumer.start(self.consumer, env)
            if self._stop.is_set():  # a stop that arrived while we were starting it
                self._consumer.signal(signal.SIGTERM)
            self.runs += 1
            log.info("event=follower_consumer_start task=%s token=%s pid=%d", task_id, assignment["fencing_token"], proc.pid)
            pump = threading.Thread(target=pump_output, args=(proc, task_id, tail), daemon=True)
            pump.start()
            code = self._watch(proc, assignment)
            pump.join(timeout=5)
            log.info("event=follower_consumer_exit task=%s exit_code=%d", task_id, code)
        finally:
            self._consumer.clear()
            shutil.rmtree(workdir, ignore_errors=True)

    def _run_resident(self, assignment: dict, env: dict[str, str], task_env: dict[str, str]) -> None:
        """The assignment on this host's resident consumer of the assignment's program (docs/PROTOCOL.md, "Slices":
        resident slices). Its reply (or its exit) ends this host's part; it serves the next task only if it said
        `stays` and was not signalled."""
        task_id, program = assignment["task"], str(assignment["program"])
        resident = self._resident
        if resident.proc is not None and (self._program != program or not resident.running()):
            why = "another program" if self._program != program else "it exited"
            log.info("event=follower_resident_exit exit_code=%s why=%r program=%s",
                     self._close_resident(grace_s=0), why, self._program)  # fmt: skip
        if resident.proc is None:
            if self._program == program:
                # Its process of this program is gone, and a JAX program takes no process in place of one it lost:
                # the leader's consumer fails with it, and the leader's next task names a new program.
                log.warning("event=follower_skip task=%s program=%s why=%r", task_id, program,
                            "this host's consumer of that program has exited")  # fmt: skip
                return
            resident.start({k: v for k, v in env.items() if k not in TASK_VARIABLES})
            self._program = program
            log.info("event=follower_resident_start pid=%d program=%s processes=%d", resident.proc.pid, program,
                     resident.starts)  # fmt: skip
        proc = resident.proc
        self._consumer.hold(proc)
        self._task_id = task_id
        self._signalled = False
        if self._stop.is_set():  # a stop that arrived while we were starting it
            self._signal(signal.SIGTERM)
        self.runs += 1
        sent = resident.send(task_id, task_env, 0.0)
        log.info("event=follower_consumer_start task=%s token=%s pid=%d resident=true program=%s", task_id,
                 assignment["fencing_token"], proc.pid, program)  # fmt: skip
        reply = self._watch(proc, assignment, resident) if sent else None
        self._task_id = "-"
        replied = isinstance(reply, dict) and reply.get("task") == task_id
        signalled = self._signalled
        stays = replied and reply["stays"] and not signalled
        code = reply["exit_code"] if replied else proc.poll()
        if not stays:
            log.info("event=follower_resident_exit task=%s exit_code=%s why=%r", task_id,
                     self._close_resident(grace_s=STOP_GRACE_S),
                     "it was stopped" if signalled else "no reply" if not replied else "its state is not sound")  # fmt: skip
        self._consumer.clear()
        log.info("event=follower_consumer_exit task=%s exit_code=%s resident=true stays=%s", task_id, code, stays)

    def _close_resident(self, grace_s: float) -> int | None:
        code = self._resident.close(grace_s=grace_s)
        self._consumer.clear()
        return code

    def _resident_line(self, line: str) -> None:
        logging.getLogger("consumer").info("task=%s | %s", self._task_id, line)

    def _watch(self, proc: subprocess.Popen, assignment: dict, resident: ResidentConsumer | None = None):
        """Wait for the consumer (per task: its exit code; resident: its reply, else None once it exited); stop it
        once the assignment or the leader's lease is gone. A task the leader's consumer finished well is not a
        reason to stop: this host's consumer has passed the last step too, and gets `FINISH_WAIT_S` to say so."""
        next_check = self.clock.monotonic() + self.watch_s
        kill_at: float | None = None
        finish_by: float | None = None
        while True:
            if resident is None:
                try:
                    return proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
            else:
                reply = resident.reply(0.2)
                if reply is not None:
                    return reply
                if proc.poll() is not None:
                    return resident.reply(0.5)  # a reply written just before it exited (a stop's)
            now = self.clock.monotonic()
            if kill_at is not None:
                if now >= kill_at:
                    log.warning("event=follower_consumer_kill pid=%d reason=stop_grace_exceeded", proc.pid)
                    self._signal(signal.SIGKILL)
                continue
            if self._stop.is_set():
                kill_at = now + STOP_GRACE_S
                continue
            if finish_by is not None and now >= finish_by:
                log.warning("event=follower_stop task=%s reason=no_exit_after_the_leaders_finish", assignment["task"])
                self._signal(signal.SIGTERM)
                kill_at = now + STOP_GRACE_S
                continue
            if now < next_check or finish_by is not None:
                continue
            next_check = now + self.watch_s
            try:
                current = self._assignment()
                still = (
                    current is not None
                    and current.get("state") == ASSIGNED
                    and self._key(current) == self._key(assignment)
                    and self._leader_holds(assignment)
                )
                finished = not still and self._finished_well(current, assignment)
            except StoreError as exc:
                log.warning("event=follower_watch_failed task=%s error=%s", assignment["task"], exc)
                continue
            if finished:
                finish_by = now + FINISH_WAIT_S
            elif not still:
                log.warning(
                    "event=follower_stop task=%s token=%s reason=assignment_or_lease_gone",
                    assignment["task"], assignment["fencing_token"],
                )  # fmt: skip
                self._signal(signal.SIGTERM)
                kill_at = now + STOP_GRACE_S

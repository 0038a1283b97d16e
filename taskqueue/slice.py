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
from taskqueue.lease import HELD, HeldLease
from taskqueue.process import STOP_GRACE_S, ConsumerSlot, pump_output

log = logging.getLogger(__name__)

SLICES = "slices/"
ASSIGNED, IDLE, CLOSED = "assigned", "idle", "closed"


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

    def assign(self, lease: HeldLease, manifest: dict, output_url: str) -> None:
        """Publish the task the leader now holds; call before starting the leader's own consumer."""
        self._publish(
            {
                "state": ASSIGNED,
                "task": lease.task_id,
                "fencing_token": lease.token,
                "nonce": lease.body["nonce"],
                "attempt": lease.attempt,
                "manifest": manifest,
                "resume": {"task": lease.task_id, "attempt": lease.attempt, "progress": lease.committed},
                "output": output_url,
            }
        )

    def withdraw(self, task_id: str, outcome: str) -> None:
        self._publish({"state": IDLE, "task": task_id, "outcome": outcome})

    def close(self, reason: str) -> None:
        self._publish({"state": CLOSED, "reason": reason})


class Follower:
    """A follower host's worker loop: run the consumer on whatever the leader assigns, for as long as it holds it."""

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

    def request_stop(self, reason: str) -> None:
        """Signal-safe: stop the consumer and leave the loop."""
        log.info("event=follower_stop_requested reason=%s", reason)
        self._stop.set()
        self._consumer.signal(signal.SIGTERM)

    # -- reading the leader's state --------------------------------------------------------------

    def _assignment(self) -> dict | None:
        try:
            return json.loads(self.store.read(self.name).data)
        except NotFound:
            return None

    def _leader_holds(self, assignment: dict) -> bool:
        """The lease is still the leader's claim that the assignment names."""
        try:
            lease = json.loads(self.store.read(layout.lease_object(assignment["task"])).data)
        except NotFound:
            return False
        return (
            lease.get("state") == HELD
            and lease.get("worker") == assignment.get("leader")
            and lease.get("nonce") == assignment.get("nonce")
        )

    @staticmethod
    def _key(assignment: dict) -> tuple[str, int]:
        return assignment.get("task", ""), int(assignment.get("fencing_token", 0))

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> str:
        """Follow until the leader closes the slice (`leader_exit`), nothing is assigned for the idle
        timeout (`idle`), or a stop (`stopped`)."""
        log.info("event=follower_start worker=%s slice=%s host=%d/%d", self.worker, self.options.slice_id,
                 self.options.host_index, self.options.hosts)  # fmt: skip
        done: set[tuple[str, int]] = set()
        idle_since = self.clock.monotonic()
        reason = "stopped"
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
            env.update({key: str(path) for key, path in files.items()})
            env.update(self.options.consumer_env())
            env.update(SPAWN_TASK_ID=task_id, SPAWN_ATTEMPT=str(assignment["attempt"]), SPAWN_OUTPUT=assignment["output"])
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

    def _watch(self, proc: subprocess.Popen, assignment: dict) -> int:
        """Wait for the consumer; stop it once the assignment or the leader's lease is gone."""
        next_check = self.clock.monotonic() + self.watch_s
        kill_at: float | None = None
        while True:
            try:
                return proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            now = self.clock.monotonic()
            if kill_at is not None:
                if now >= kill_at:
                    log.warning("event=follower_consumer_kill pid=%d reason=stop_grace_exceeded", proc.pid)
                    self._consumer.signal(signal.SIGKILL)
                continue
            if self._stop.is_set():
                kill_at = now + STOP_GRACE_S
                continue
            if now < next_check:
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
            except StoreError as exc:
                log.warning("event=follower_watch_failed task=%s error=%s", assignment["task"], exc)
                continue
            if not still:
                log.warning(
                    "event=follower_stop task=%s token=%s reason=assignment_or_lease_gone",
                    assignment["task"], assignment["fencing_token"],
                )  # fmt: skip
                self._consumer.signal(signal.SIGTERM)
                kill_at = now + STOP_GRACE_S

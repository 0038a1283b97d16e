"""The consumer subprocess as the worker and a slice's follower both run it: its own process group,
its output logged one line per line, and how long it gets to stop; and the resident consumer, one
process serving a worker's tasks one after another over a pipe pair (`ResidentConsumer`)."""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence

from jsonline import parse_object

#: The consumer's time to exit after SIGTERM before its group is killed; a release must fit in 10 s.
STOP_GRACE_S = 5.0


def signal_group(proc: subprocess.Popen | None, signum: int) -> None:
    """Send `signum` to the consumer's process group (it runs in its own session), if it still runs."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass


class ConsumerSlot:
    """The one consumer a worker, or a slice's follower, runs at a time, for whoever must signal it.

    A stop comes from another thread (the preemption watch) or from a signal handler, which Python
    runs in the main thread between two bytecodes, possibly while that thread holds the lock to
    start or reap the consumer. The lock is re-entrant so that the handler then goes through
    instead of waiting forever on its own thread: it sees no consumer yet, and whoever starts one
    checks for a stop right after (see `Spawner._run_consumer`).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._proc: subprocess.Popen | None = None

    def start(self, command: str | Sequence[str], env: Mapping[str, str]) -> subprocess.Popen:
        """Start the consumer in its own session, so that a signal reaches its whole process group."""
        with self._lock:
            self._proc = subprocess.Popen(
                command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            return self._proc

    def hold(self, proc: subprocess.Popen) -> None:
        """Signal `proc` from now on: a resident consumer, started once and held for each of its tasks."""
        with self._lock:
            self._proc = proc

    def clear(self) -> None:
        with self._lock:
            self._proc = None

    def signal(self, signum: int) -> None:
        with self._lock:
            proc = self._proc
        signal_group(proc, signum)


def pump_output(
    proc: subprocess.Popen, task_id: str, tail: collections.deque, on_line: Callable[[], None] | None = None
) -> None:
    """Log the consumer's output one line per line, keeping the last lines in `tail` for its error record;
    `on_line` is told of each line (the stuck-task backstop counts output as activity)."""
    assert proc.stdout is not None
    consumer_log = logging.getLogger("consumer")
    for raw in proc.stdout:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        tail.append(line)
        consumer_log.info("task=%s | %s", task_id, line)
        if on_line is not None:
            on_line()


#: The per-task variables a resident consumer gets in each request (docs/PROTOCOL.md, "Resident consumers").
TASK_VARIABLES = ("SPAWN_TASK_FILE", "SPAWN_JOB_FILE", "SPAWN_RESUME_FILE", "SPAWN_PROGRESS_FILE", "SPAWN_TASK_ID",
                  "SPAWN_ATTEMPT", "SPAWN_OUTPUT")  # fmt: skip
MAX_REPLY_LINE = 64 * 1024


class ReplyError(ValueError):
    """A resident consumer wrote a line on its replies' channel that is not a reply."""


def parse_reply(line: bytes) -> dict:
    """{"task": str, "exit_code": int, "stays": bool}, or ReplyError naming what is wrong."""
    reply = parse_object(line, MAX_REPLY_LINE, "reply", ReplyError)
    checks = (("task", str), ("exit_code", int), ("stays", bool))
    for field, kind in checks:
        value = reply.get(field)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ReplyError(f"reply.{field}: a {kind.__name__} is needed, got {value!r}")
    return reply


class ResidentConsumer:
    """One consumer process that serves a worker's tasks one after another (docs/PROTOCOL.md, "Resident consumers").

    Requests go to its standard input, one JSON line per task; replies come from its standard output, one JSON line
    per task; its standard error is its log, pumped one line per line to `on_line`. It runs in its own session, like
    a per-task consumer, so that `signal_group` reaches all of it. It never decides anything: the worker core says
    when a task's consumer may serve the next task (`taskqueue.worker.TaskRun.consumer_stays`).
    """

    def __init__(self, command: Sequence[str], on_line: Callable[[str], None]):
        self.command = list(command)
        self.on_line = on_line
        self.proc: subprocess.Popen | None = None
        self.started_tasks = 0  # tasks sent to the current process
        self.starts = 0  # processes started in all
        self._replies: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, env: Mapping[str, str]) -> subprocess.Popen:
        """A fresh process (the previous one, if any, must have been closed)."""
        self.proc = subprocess.Popen(
            self.command, env={**env, "SPAWN_RESIDENT": "1"}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        self.starts += 1
        self.started_tasks = 0
        self._replies = queue.Queue()
        self._threads = [
            threading.Thread(target=self._read_replies, args=(self.proc, self._replies), daemon=True),
            threading.Thread(target=self._pump_log, args=(self.proc,), daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self.proc

    def send(self, task_id: str, env: Mapping[str, str], waited_s: float) -> bool:
        """Write one task's request; False when the process is gone (its exit code then tells the task's end)."""
        assert self.proc is not None and self.proc.stdin is not None
        variables = {k: env[k] for k in TASK_VARIABLES if k in env}
        request = {"task": task_id, "env": variables, "waited_s": round(waited_s, 3)}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # it exited (or its pipe was closed): wait() reports its exit code
            return False
        self.started_tasks += 1
        return True

    def reply(self, timeout: float) -> dict | ReplyError | None:
        """The next reply within `timeout` seconds: a dict, a ReplyError, or None (none yet, or the process ended)."""
        try:
            return self._replies.get(timeout=timeout)
        except queue.Empty:
            return None

    def _read_replies(self, proc: subprocess.Popen, replies: queue.Queue) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                replies.put(parse_reply(line))
            except ReplyError as exc:
                replies.put(exc)

    def _pump_log(self, proc: subprocess.Popen) -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            self.on_line(raw.decode("utf-8", "replace").rstrip("\n"))

    def close(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """End the process: end of input (it leaves on its own), then SIGKILL to its group after `grace_s`. Returns
        its exit code (None if there was none)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            proc.wait()
        for thread in self._threads:
            thread.join(timeout=5)
        return proc.returncode

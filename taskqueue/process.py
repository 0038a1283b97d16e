"""The consumer subprocess as the worker and a slice's follower both run it: its own process group,
its output logged one line per line, and how long it gets to stop."""

from __future__ import annotations

import collections
import logging
import os
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence

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

"""The consumer subprocess as the worker and a slice's follower both run it: its own process group,
its output logged one line per line, and how long it gets to stop."""

from __future__ import annotations

import collections
import logging
import os
import subprocess

#: The consumer's time to exit after SIGTERM before its group is killed; a release must fit in 10 s.
STOP_GRACE_S = 5.0


def signal_group(proc: subprocess.Popen | None, signum: int) -> None:
    """Send `signum` to the consumer's process group (it runs in its own session), if it still runs."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass


def pump_output(proc: subprocess.Popen, task_id: str, tail: collections.deque) -> None:
    """Log the consumer's output one line per line, keeping the last lines in `tail` for its error record."""
    assert proc.stdout is not None
    consumer_log = logging.getLogger("consumer")
    for raw in proc.stdout:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        tail.append(line)
        consumer_log.info("task=%s | %s", task_id, line)

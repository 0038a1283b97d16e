"""Worker processes and queue inspection shared by the test areas that run real `spawn.py` workers."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from objectstore import NotFound, open_store
from taskqueue import layout
from taskqueue.clock import Clock

REPO = pathlib.Path(__file__).resolve().parents[1]
QUEUE_TEST_CONSUMER = "python tests/queue/consumer.py"


@contextlib.contextmanager
def renewing(lease, every_s: float = 0.2) -> Iterator[None]:
    """Heartbeat a lease held in the test's own process, as a live holder's worker would."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            lease.heartbeat()

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class Workers:
    """Starts `spawn.py` workers and keeps their logs."""

    def __init__(self, url: str, logs: pathlib.Path):
        self.url = url
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, worker: str, *flags: str, consumer: str = QUEUE_TEST_CONSUMER, env: dict | None = None) -> subprocess.Popen:
        args = [
            sys.executable, "spawn.py", self.url, "--consumer", consumer, "--worker-id", worker,
            "--preemption-watch", "off", "--poll", "0.05",
        ]
        args += list(flags)
        defaults = {"--lease-ttl": "30", "--idle-timeout": "3"}
        args += [item for flag, value in defaults.items() if flag not in flags for item in (flag, value)]
        log = open(self.logs / f"{worker}.log", "ab")
        proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.procs[worker] = proc
        return proc

    def wait(self, timeout: float = 120) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for worker, proc in self.procs.items():
            codes[worker] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        return codes

    def log(self, worker: str) -> str:
        return (self.logs / f"{worker}.log").read_text()

    def all_logs(self) -> str:
        return "".join(self.log(w) for w in self.procs)

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()


def markers(url: str, prefix: str) -> dict[str, dict]:
    store = open_store(url)
    return {
        layout.id_from_object(e.name, prefix): json.loads(store.read(e.name).data) for e in store.list(prefix)
    }


def lease_body(url: str, task_id: str) -> dict | None:
    try:
        return json.loads(open_store(url).read(layout.lease_object(task_id)).data)
    except NotFound:
        return None


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll `predicate` until it holds (its value), or fail naming `what` once `timeout` has run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)  # the poll's interval: the deadline, not this, bounds the wait
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class WaitingClock(Clock):
    """The real clock, which also says when the claim loop run by `thread` waits: in a `Claimer` the loop waits
    only once it found nothing to claim (`waiting`, an event a test orders its next step by, instead of a sleep
    that hopes the worker got there). The test sets `thread` before it starts the thread."""

    def __init__(self) -> None:
        super().__init__()
        self.thread: threading.Thread | None = None
        self.waiting = threading.Event()

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        if threading.current_thread() is self.thread:
            self.waiting.set()
        return super().wait(stop, seconds)


def lease_holders(url: str) -> set[str]:
    """Workers holding a lease right now (a kill of one of them is a kill mid-task)."""
    return {e.metadata["worker"] for e in open_store(url).list(layout.LEASES) if e.metadata.get("state") == "held"}

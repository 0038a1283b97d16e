"""Workers as real `spawn.py` processes on a local-directory queue or a gs:// queue on the fake server."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from objectstore import open_store
from taskqueue import layout
from taskqueue.submit import submit

REPO = pathlib.Path(__file__).resolve().parents[2]
CONSUMER = "python tests/queue/consumer.py"


@pytest.fixture(params=["local", "gcs"])
def queue_url(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "queue")
    request.getfixturevalue("gcs_client")  # exports STORAGE_EMULATOR_HOST to the workers
    return f"gs://{request.getfixturevalue('gcs_bucket')}/jobs/test"


@pytest.fixture
def local_queue_url(tmp_path) -> str:
    return str(tmp_path / "queue")


def submit_tasks(url: str, manifests: list[dict], job: dict | None = None) -> None:
    tasks = [(m["id"], json.dumps(m).encode()) for m in manifests]
    submit(open_store(url), json.dumps(job or {"name": "test"}).encode(), tasks)


class Workers:
    """Starts `spawn.py` workers and keeps their logs."""

    def __init__(self, url: str, logs: pathlib.Path):
        self.url = url
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, worker: str, *flags: str, consumer: str = CONSUMER, env: dict | None = None) -> subprocess.Popen:
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


@pytest.fixture
def workers(queue_url, tmp_path):
    fleet = Workers(queue_url, tmp_path)
    yield fleet
    fleet.kill_all()


@pytest.fixture
def local_workers(local_queue_url, tmp_path):
    fleet = Workers(local_queue_url, tmp_path)
    yield fleet
    fleet.kill_all()


def markers(url: str, prefix: str) -> dict[str, dict]:
    store = open_store(url)
    return {
        layout.id_from_object(e.name, prefix): json.loads(store.read(e.name).data) for e in store.list(prefix)
    }


def lease_body(url: str, task_id: str) -> dict | None:
    from objectstore import NotFound

    try:
        return json.loads(open_store(url).read(layout.lease_object(task_id)).data)
    except NotFound:
        return None


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def assert_outputs_exact(url: str, done: dict, outputs_per_task: int) -> None:
    """Each task's done marker lists outputs 0..n-1 once each, and each names a stored object with its content."""
    store = open_store(url)
    for task_id, marker in done.items():
        assert [r["index"] for r in marker["outputs"]] == list(range(outputs_per_task)), task_id
        for record in marker["outputs"]:
            relative = record["output"][len(store.root_url) + 1 :]
            assert relative.startswith(f"out/{task_id}/"), record
            assert store.read(relative).data == f"{task_id}:{record['index']}".encode()

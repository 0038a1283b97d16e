"""Queues on a local directory or on the fake GCS server, and workers as real `spawn.py` processes."""

from __future__ import annotations

import json

import pytest

from objectstore import open_store
from taskqueue.submit import submit
from tests.workers import Workers


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


def assert_outputs_exact(url: str, done: dict, outputs_per_task: int) -> None:
    """Each task's done marker lists outputs 0..n-1 once each, and each names a stored object with its content."""
    store = open_store(url)
    for task_id, marker in done.items():
        assert [r["index"] for r in marker["outputs"]] == list(range(outputs_per_task)), task_id
        for record in marker["outputs"]:
            relative = record["output"][len(store.root_url) + 1 :]
            assert relative.startswith(f"out/{task_id}/"), record
            assert store.read(relative).data == f"{task_id}:{record['index']}".encode()

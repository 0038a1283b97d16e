"""A tiny model, a FineWeb-shaped dataset, and helpers that drive the real tools as a user would."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from objectstore import open_store
from taskqueue import layout
from tests.workers import REPO

CONSUMER = "python consume.py"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> pathlib.Path:
    from extract.tiny import write_tiny_qwen

    return write_tiny_qwen(tmp_path_factory.mktemp("model"), "qwen2", hidden=32, layers=2, heads=4, kv_heads=2, vocab=320)


def make_job(tmp_path: pathlib.Path, model: pathlib.Path, data_files: list[str], **overrides) -> pathlib.Path:
    job = {
        "model": str(model),
        "data_files": data_files,
        "layers": [1, -1],
        "max_seq_len": 48,
        "batch_size": 4,
        "shard_size": 2,
        "buckets": [16, 48],
        **overrides,
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    return path


def tool(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, f"{args[0]} failed:\n{result.stdout}\n{result.stderr}"
    return result


def plan_and_submit(queue: str, job_file: pathlib.Path, rows_per_task: int) -> list[dict]:
    tasks_file = job_file.parent / "tasks.jsonl"
    tool("tools/make_tasks.py", str(job_file), "--rows-per-task", str(rows_per_task), "-o", str(tasks_file))
    if not queue.startswith("gs://"):
        pathlib.Path(queue).mkdir(parents=True, exist_ok=True)  # a local queue is a directory that exists
    tool("tools/submit.py", queue, "--job", str(job_file), "--tasks", str(tasks_file))
    return [json.loads(line) for line in tasks_file.read_text().splitlines()]


def committed_samples(queue: str) -> tuple[dict[int, dict[str, np.ndarray]], int]:
    """Every sample the done markers commit, by sample id, and how many sample ids appeared more than once."""
    from activations.reader import open_activations

    store = open_store(queue)
    samples: dict[int, dict[str, np.ndarray]] = {}
    repeats = 0
    for entry in store.list(layout.DONE):
        for sample in open_activations(store.url(entry.name)).samples():
            key = int(sample.sample_id)
            repeats += key in samples
            samples[key] = {"token_ids": sample.token_ids, **{f"layer_{k}": v for k, v in sample.layers.items()}}
    return samples, repeats

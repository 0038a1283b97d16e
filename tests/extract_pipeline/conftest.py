"""Fixtures for the extraction pipeline: tiny Qwen checkpoints, FineWeb-like parquet files, consume.py as a subprocess.

Everything is generated once per session. Subprocesses share a JAX compilation cache, so the
same tiny model at the same bucket length is compiled once for the whole directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from extract.tiny import write_fineweb_like_parquet, write_tiny_qwen

REPO = pathlib.Path(__file__).resolve().parents[2]
CONSUME = REPO / "consume.py"
#: Rows of the three session parquet files; the files differ so that tasks span uneven boundaries.
FILE_ROWS = [90, 50, 80]
TIMEOUT_S = 240


@dataclasses.dataclass(frozen=True)
class Corpus:
    files: list[pathlib.Path]
    bases: list[int]

    def slice_files(self, ranges: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
        """[(file index, start, end)] -> task "files" entries with the right bases."""
        return [
            {"path": str(self.files[i]), "base": self.bases[i], "start": start, "end": end} for i, start, end in ranges
        ]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2": write_tiny_qwen(root / "qwen2", model_type="qwen2", seed=1),
        "qwen3": write_tiny_qwen(root / "qwen3", model_type="qwen3", seed=2, tie=True),
    }


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    files = write_fineweb_like_parquet(tmp_path_factory.mktemp("fineweb"), len(FILE_ROWS), FILE_ROWS, seed=7)
    bases = [sum(FILE_ROWS[:i]) for i in range(len(FILE_ROWS))]
    return Corpus(files=files, bases=bases)


@pytest.fixture(scope="session")
def jax_cache(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("jax-cache")


def write_json(path: pathlib.Path, value: Any) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))
    return path


def base_job(model: pathlib.Path, corpus: Corpus, **overrides: Any) -> dict[str, Any]:
    job = {
        "data_files": [str(corpus.files[0].parent)],
        "model": str(model),
        "layers": [1, -1],
        "max_seq_len": 128,
        "batch_size": 4,
        "shard_size": 16,
    }
    job.update(overrides)
    return job


@dataclasses.dataclass
class ConsumeRun:
    """Inputs of one consume.py invocation and where its outputs go."""

    workdir: pathlib.Path
    job: dict[str, Any]
    task: dict[str, Any]
    output: str
    resume: dict[str, Any] | None = None

    @property
    def progress_file(self) -> pathlib.Path:
        return self.workdir / "progress.jsonl"

    @property
    def stderr_file(self) -> pathlib.Path:
        return self.workdir / "stderr.log"

    def argv(self) -> list[str]:
        job_file = write_json(self.workdir / "job.json", self.job)
        task_file = write_json(self.workdir / "task.json", self.task)
        argv = [sys.executable, str(CONSUME), "--job-file", str(job_file), "--task-file", str(task_file),
                "--output", self.output, "--progress-file", str(self.progress_file), "--log-every", "1"]  # fmt: skip
        if self.resume is not None:
            argv += ["--resume-file", str(write_json(self.workdir / "resume.json", self.resume))]
        return argv

    def records(self) -> list[dict[str, Any]]:
        """Complete lines only: a line without its newline was cut off by a kill."""
        if not self.progress_file.exists():
            return []
        text = self.progress_file.read_text()
        return [json.loads(line) for line in text.split("\n")[:-1] if line]


@pytest.fixture(scope="session")
def consume_env(jax_cache: pathlib.Path) -> Callable[[], dict[str, str]]:
    def env() -> dict[str, str]:
        environment = {k: v for k, v in os.environ.items() if not k.startswith("SPAWN_")}
        environment.update(
            JAX_PLATFORMS="cpu",
            JAX_COMPILATION_CACHE_DIR=str(jax_cache),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
        )
        return environment

    return env


@pytest.fixture(scope="session")
def run_consume(consume_env: Callable[[], dict[str, str]]) -> Callable[..., subprocess.CompletedProcess]:
    """Run consume.py to completion; stderr is returned as text and also kept in the run's workdir."""

    def run(spec: ConsumeRun, timeout: float = TIMEOUT_S, env: dict | None = None) -> subprocess.CompletedProcess:
        spec.workdir.mkdir(parents=True, exist_ok=True)
        with open(spec.stderr_file, "w") as stderr:
            proc = subprocess.run(spec.argv(), cwd=REPO, env={**consume_env(), **(env or {})}, stderr=stderr,
                                  stdout=subprocess.PIPE, text=True, timeout=timeout)  # fmt: skip
        proc.stderr = spec.stderr_file.read_text()
        return proc

    return run


@pytest.fixture
def start_consume(consume_env: Callable[[], dict[str, str]]) -> Callable[[ConsumeRun], subprocess.Popen]:
    """Start consume.py and return at once; the test signals or waits for it. Killed at teardown if still alive."""
    started: list[subprocess.Popen] = []

    def start(spec: ConsumeRun) -> subprocess.Popen:
        spec.workdir.mkdir(parents=True, exist_ok=True)
        stderr = open(spec.stderr_file, "w")
        proc = subprocess.Popen(spec.argv(), cwd=REPO, env=consume_env(), stderr=stderr, stdout=subprocess.DEVNULL)
        stderr.close()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()


def wait_for_records(spec: ConsumeRun, proc: subprocess.Popen, count: int, timeout: float = TIMEOUT_S) -> list[dict]:
    """Poll the progress file until it holds `count` complete records; fail if the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = spec.records()
        if len(records) >= count:
            return records
        if proc.poll() is not None:
            raise AssertionError(
                f"consume.py exited with {proc.returncode} after {len(records)} records:\n"
                + spec.stderr_file.read_text()
            )
        time.sleep(0.02)
    raise AssertionError(f"no {count} progress records within {timeout}s:\n{spec.stderr_file.read_text()}")


def killed_after_two_shards(tmp_path: pathlib.Path, job: dict[str, Any], task: dict[str, Any], gcs, bucket: str,
                            start_consume: Callable[[ConsumeRun], subprocess.Popen]) -> tuple[list[dict], ConsumeRun]:
    """A consume run to gs://`bucket` killed -9 once it has committed two shards (its uploads slowed, so that the kill
    lands between two), and the second attempt that resumes from them: (the committed records, the second run, not
    yet started)."""
    gcs.faults.add_latency(0.5, kind="write")  # leaves time to kill between two shard uploads
    first = ConsumeRun(workdir=tmp_path / "a1", job=job, task=task, output=f"gs://{bucket}/out/{task['id']}/1")
    proc = start_consume(first)
    wait_for_records(first, proc, 2)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    committed = first.records()
    assert len(committed) >= 2 and not any(r.get("final") for r in committed)
    gcs.faults.reset()
    second = ConsumeRun(workdir=tmp_path / "a2", job=job, task=task, output=f"gs://{bucket}/out/{task['id']}/2",
                        resume={"task": task["id"], "attempt": 2, "progress": committed})  # fmt: skip
    return committed, second

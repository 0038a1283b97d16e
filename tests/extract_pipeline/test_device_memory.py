"""A batch that does not fit the device is a dead letter naming the knobs, never an XLA trace (consumer contract:
exit 65 means bad input, docs/PROTOCOL.md)."""

from __future__ import annotations

import subprocess
import sys

from extract.config import ModelConfig
from extract.memory import HEADROOM, weight_bytes
from tests.extract_pipeline.conftest import REPO, TIMEOUT_S, ConsumeRun, base_job


def test_step_too_large_for_the_device_exits_65_naming_batch_size_and_max_seq_len(
    tmp_path, tiny_models, corpus, run_consume
):
    job = base_job(tiny_models["qwen2"], corpus)
    task = {"id": "t000003", "files": corpus.slice_files([(0, 0, 8)])}
    spec = ConsumeRun(workdir=tmp_path, job=job, task=task, output=str(tmp_path / "out"))
    # An artificially small device: the tiny model's bf16 weights fit with 10% to spare, a step of 128-token rows
    # does not (its attention scores alone are more).
    config = ModelConfig.from_file(tiny_models["qwen2"] / "config.json")
    limit = int(weight_bytes(config, config.num_hidden_layers, 2) * 1.1 / HEADROOM)
    proc = run_consume(spec, env={"EXTRACT_DEVICE_MEMORY": str(limit)})
    assert proc.returncode == 65, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if "event=bad_input" in line]
    assert "batch_size=4" in line and "max_seq_len=128" in line and "or less" in line, line  # and what fits
    assert "Traceback" not in proc.stderr
    assert not spec.records() and not list((tmp_path / "out").glob("*.safetensors"))


#: The address space the run below may map: room for Python, JAX, torch's libraries (the tokenizer imports
#: transformers) and the tiny model, far less than the step's attention scores. XLA's CPU client then fails the
#: step's allocation itself, as a GPU's or TPU's allocator does when HBM runs out.
ADDRESS_SPACE = 8 * 2**30
LIMIT_THEN_EXEC = (
    "import os, resource, sys; limit = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_AS, (limit, limit)); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def test_out_of_memory_raised_by_xla_at_run_time_exits_65_naming_the_knobs(
    tmp_path, tiny_models, corpus, consume_env
):
    """No device memory is known on a CPU, so nothing refuses the batch before it runs: the failure is XLA's own
    RESOURCE_EXHAUSTED, raised where the step's outputs are awaited, and it must still become the named error."""
    # 64 rows of 4,096 tokens: tens of GiB of float32 attention scores, one allocation that cannot be mapped.
    job = base_job(tiny_models["qwen2"], corpus, max_seq_len=4096, buckets=[4096], batch_size=64)
    task = {"id": "t000004", "files": corpus.slice_files([(0, 0, 8)])}
    spec = ConsumeRun(workdir=tmp_path, job=job, task=task, output=str(tmp_path / "out"))
    spec.workdir.mkdir(parents=True, exist_ok=True)

    # The limit is set in a Python that then becomes consume.py (exec), so this test process keeps its own.
    limited = [sys.executable, "-c", LIMIT_THEN_EXEC, str(ADDRESS_SPACE), *spec.argv()]
    proc = subprocess.run(limited, cwd=REPO, env=consume_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 65, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if "event=bad_input" in line]
    assert "RESOURCE_EXHAUSTED" in line, line  # XLA's own failure, not the memory model's refusal
    assert "batch_size=64" in line and "max_seq_len=4096" in line and "lower batch_size or max_seq_len" in line
    assert "Traceback" not in proc.stderr
    assert not spec.records() and not list((tmp_path / "out").glob("*.safetensors"))

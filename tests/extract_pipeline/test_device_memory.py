"""A batch that does not fit the device is a dead letter naming the knobs, never an XLA trace (consumer contract:
exit 65 means bad input, docs/PROTOCOL.md)."""

from __future__ import annotations

from extract.config import QwenConfig
from extract.memory import HEADROOM, weight_bytes
from tests.extract_pipeline.conftest import ConsumeRun, base_job


def test_step_too_large_for_the_device_exits_65_naming_batch_size_and_max_seq_len(
    tmp_path, tiny_models, corpus, run_consume
):
    job = base_job(tiny_models["qwen2"], corpus)
    task = {"id": "t000003", "files": corpus.slice_files([(0, 0, 8)])}
    spec = ConsumeRun(workdir=tmp_path, job=job, task=task, output=str(tmp_path / "out"))
    # An artificially small device: the tiny model's bf16 weights fit with 10% to spare, a step of 128-token rows
    # does not (its attention scores alone are more).
    config = QwenConfig.from_file(tiny_models["qwen2"] / "config.json")
    limit = int(weight_bytes(config, config.num_hidden_layers, 2) * 1.1 / HEADROOM)
    proc = run_consume(spec, env={"EXTRACT_DEVICE_MEMORY": str(limit)})
    assert proc.returncode == 65, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if "event=bad_input" in line]
    assert "batch_size=4" in line and "max_seq_len=128" in line and "or less" in line, line  # and what fits
    assert "Traceback" not in proc.stderr
    assert not spec.records() and not list((tmp_path / "out").glob("*.safetensors"))

"""The memory part of the plan: the chip's memory from the cited table, the step a batch needs on it, the largest
batch_size that fits, and a loud warning (naming batch_size) for a batch the engine would refuse."""

from __future__ import annotations

import json

from extract import memory
from extract.config import ModelConfig
from extract.costmodel import KNOWN_CONFIGS
from tests.plan.test_plan import QWEN25_7B_JOB, run_tool


def plan(tmp_path, accelerator: str, **job) -> dict:
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({**QWEN25_7B_JOB, **job}))
    result = run_tool("tools/plan.py", str(job_file), "--accelerator", accelerator, "--rows", "1000",
                      "--tokens-per-row", "1040", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_plan_sizes_the_batch_to_the_chip_and_warns_naming_batch_size_when_it_does_not_fit(tmp_path):
    fits = plan(tmp_path, "v5litepod-8", max_seq_len=2048, batch_size=8)
    m = fits["memory"]
    assert m["usable_bytes_per_chip"] == 16 * 2**30  # v5e: 16 GiB HBM a chip (cloud.google.com/tpu/docs/v5e)
    assert m["attention"] == "splash" and m["mesh"] == {"data": 8, "model": 1} and m["fits"]
    largest = m["max_batch_size"]
    assert largest % 8 == 0 and m["max_tokens_per_step"] == largest * 2048
    config = ModelConfig.from_dict(KNOWN_CONFIGS["Qwen/Qwen2.5-7B"])
    shape = dict(config=config, depth=18, kept=4, seq_len=2048, compute_bytes=2, out_bytes=2, kernel="splash")
    budget = memory.HEADROOM * 16 * 2**30
    assert memory.step_memory(rows=largest // 8, **shape).total <= budget < memory.step_memory(
        rows=largest // 8 + 1, **shape).total  # fmt: skip
    assert not [w for w in fits["warnings"] if "batch_size" in w and "fit" in w]

    too_big = plan(tmp_path, "v5litepod-8", max_seq_len=2048, batch_size=largest + 8)
    assert not too_big["memory"]["fits"]
    (warning,) = [w for w in too_big["warnings"] if "does not fit" in w]
    assert f"batch_size {largest + 8}" in warning and f"use batch_size {largest} or less" in warning


def test_gpu_plan_uses_cudnn_and_what_the_jax_client_allocates(tmp_path):
    m = plan(tmp_path, "a3-highgpu-8g", max_seq_len=2048, batch_size=64)["memory"]
    assert m["attention"] == "cudnn" and m["usable_bytes_per_chip"] == int(0.75 * 80e9)
    fp32 = plan(tmp_path, "a3-highgpu-8g", max_seq_len=2048, batch_size=64, compute_dtype="fp32")["memory"]
    assert fp32["attention"] == "materialised" and fp32["max_batch_size"] < m["max_batch_size"]


def test_gpu_plan_for_gemma2_asks_the_engines_kernel_decision_and_sizes_the_oracle(tmp_path):
    """Gemma 2 soft-caps its attention logits, which cuDNN through JAX cannot: the engine runs the oracle on a GPU
    (extract/kernel_choice.py, `for_model`). The planner asks the same decision, so its largest batch is the one
    whose materialised [rows, heads, T, T] logits fit; it used to read the cap under config.json's name, find
    none, and size cuDNN's far smaller working set (a batch the engine then refuses)."""
    from extract import kernel_choice

    m = plan(tmp_path, "a3-highgpu-8g", model="google/gemma-2-2b", max_seq_len=2048, batch_size=8,
             layers=[12])["memory"]  # fmt: skip
    config = ModelConfig.from_dict(KNOWN_CONFIGS["google/gemma-2-2b"])
    assert config.attention_softcap == 50.0
    assert kernel_choice.for_model("gpu", "bfloat16", config).kernel == m["attention"] == "materialised"
    shape = dict(config=config, depth=12, kept=1, seq_len=2048, compute_bytes=2, out_bytes=2, packed=False)
    usable = int(0.75 * 80e9)
    assert m["max_batch_size"] == 8 * memory.rows_that_fit(usable, kernel="materialised", **shape)
    assert m["max_batch_size"] < 8 * memory.rows_that_fit(usable, kernel="cudnn", **shape)

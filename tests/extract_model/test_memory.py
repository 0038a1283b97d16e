"""Batches that fit: the memory model against XLA's own buffer assignment, the largest batch it allows, and the
errors that name `batch_size` and `max_seq_len` when a step does not fit (before loading, at compile, at run)."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from extract import memory as mem
from extract.config import ModelConfig
from extract.engine import Engine
from extract.errors import EX_DATAERR, exit_code_for
from extract.sharding import MODEL, ShardingRules

SMALL = {
    "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2,
}  # fmt: skip
QWEN25_7B = {
    "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
}  # fmt: skip


def step(config: ModelConfig, **overrides) -> dict:
    shape = dict(config=config, depth=4, kept=2, compute_bytes=4, out_bytes=2, kernel="materialised")
    shape.update(overrides)
    return shape


def test_float32_estimate_bounds_what_xla_allocates_for_the_step():
    """XLA's buffer assignment for the compiled step (arguments, outputs, scratch) is the independent figure, at
    lengths where the MLP dominates and where the attention's T² does, of the program the engine compiles (on a CPU,
    float32 without YNNPACK). The estimate must not be below it, nor far
    above (float32 only: XLA's CPU backend widens bf16 matmuls to float32, which no accelerator does)."""
    config = ModelConfig.from_dict(SMALL)
    engine = Engine.with_random_weights(
        config, [2, 4], batch_size=2, max_seq_len=1024, compute_dtype="float32", devices=jax.devices()[:1],
    )  # fmt: skip
    for seq_len in (64, 256, 1024):
        stats = engine._program(seq_len).memory_analysis()
        xla = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
        estimate = mem.step_memory(rows=2, seq_len=seq_len, held_steps=0, **step(config)).total
        assert xla <= estimate <= 1.5 * xla, (seq_len, estimate, xla)


def test_rows_that_fit_is_the_largest_row_count_whose_step_fits():
    config = ModelConfig.from_dict(QWEN25_7B)
    shape = step(config, depth=18, kept=4, compute_bytes=2, seq_len=2048, packed=True)
    for kernel, memory in itertools.product(("materialised", "cudnn", "splash"), (16, 24, 60, 80, 141)):
        shape["kernel"] = kernel
        rows = mem.rows_that_fit(memory * mem.GIB, **shape)
        budget = mem.HEADROOM * memory * mem.GIB
        assert mem.step_memory(rows=rows + 1, **shape).total > budget
        if rows:
            assert mem.step_memory(rows=rows, **shape).total <= budget
    # At the shape the fused kernels fit several times the rows of the materialised logits.
    fused = mem.rows_that_fit(60 * mem.GIB, **{**shape, "kernel": "cudnn"})
    materialised = mem.rows_that_fit(60 * mem.GIB, **{**shape, "kernel": "materialised"})
    assert fused > 2 * materialised > 0


@pytest.mark.parametrize("model_axis", range(1, 9))
def test_weight_split_is_the_sharding_rule(model_axis):
    """memory.py cannot import the JAX-side ShardingRules; its split factors must be the same ones."""
    for raw in (SMALL, QWEN25_7B, {**SMALL, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 32}):
        config = ModelConfig.from_dict(raw)
        rules = ShardingRules.for_config(config, model_axis)
        q_split = mem._split(config.num_attention_heads, model_axis)
        assert (MODEL in tuple(rules.q_proj)) == (q_split > 1)
        assert (MODEL in tuple(rules.kv_proj)) == (q_split > 1 and mem._split(config.num_key_value_heads, model_axis) > 1)
        assert (MODEL in tuple(rules.mlp_in)) == (mem._split(config.intermediate_size, model_axis) > 1)
        assert (MODEL in tuple(rules.embedding)) == (mem._split(config.hidden_size, model_axis) > 1)


def test_hbm_table_knows_the_devices_and_price_families():
    assert mem.hbm_bytes("NVIDIA H100 80GB HBM3") == 80 * 10**9
    assert mem.hbm_bytes("NVIDIA A100-SXM4-40GB") == 40 * 10**9 and mem.hbm_bytes("NVIDIA A100 80GB") == 80 * 10**9
    assert mem.hbm_bytes("TPU v5 lite") == mem.hbm_bytes("v5e") == 16 * mem.GIB
    assert mem.hbm_bytes("TPU v6 lite") == mem.hbm_bytes("v6e") == 32 * mem.GIB
    assert mem.hbm_bytes("TPU v5p") == mem.hbm_bytes("v5p") == 95 * mem.GIB
    assert mem.usable_bytes("NVIDIA H100 80GB HBM3", "gpu") == 60 * 10**9
    assert mem.hbm_bytes("Some future chip") is None


# -- the engine: refused before loading, at compile, and at run time ----------------------------------------------


def test_batch_that_cannot_fit_is_refused_before_loading_naming_both_knobs_and_the_advice_fits(qwen2_untied):
    args = dict(layers=[1, -1], max_seq_len=128, compute_dtype="float32", devices=jax.devices()[:1])
    fits = Engine(str(qwen2_untied.path), batch_size=8, **args)  # memory unknown on CPU: nothing is refused
    plan = mem.step_memory(rows=8, seq_len=128, **fits._step_shape(1))
    limit = int(plan.total / mem.HEADROOM * 0.6)  # 60% of what batch 8 needs
    with pytest.raises(mem.DeviceMemoryError) as refused:
        Engine(str(qwen2_untied.path), batch_size=8, device_memory=limit, **args)
    message = str(refused.value)
    assert "batch_size=8" in message and "max_seq_len=128" in message, message
    assert exit_code_for(refused.value) == EX_DATAERR  # a dead letter: the job must change (docs/PROTOCOL.md)
    advised = int(message.split("Use batch_size ")[1].split()[0])
    assert 1 <= advised < 8
    Engine(str(qwen2_untied.path), batch_size=advised, device_memory=limit, **args)  # the advice works


def test_weights_that_cannot_fit_say_so_instead_of_blaming_the_batch(qwen2_untied):
    with pytest.raises(mem.DeviceMemoryError, match="weights of 3 layers"):
        Engine(str(qwen2_untied.path), [-1], batch_size=1, max_seq_len=16, device_memory=1000,
               devices=jax.devices()[:1])  # fmt: skip


def test_compiled_step_over_the_limit_is_refused_with_xla_figure_and_the_knobs(qwen2_untied):
    engine = Engine(
        str(qwen2_untied.path), [-1], batch_size=4, max_seq_len=64, compute_dtype="float32",
        devices=jax.devices()[:1],
    )  # fmt: skip
    # An artificially small limit: above the weights, below what XLA assigns the compiled step.
    engine.device_memory = mem.step_memory(rows=0, seq_len=64, **engine._step_shape(1)).total * 2
    with pytest.raises(mem.DeviceMemoryError) as refused:
        engine.forward(np.ones((4, 64), np.int32))
    message = str(refused.value)
    assert "compiled program's own figure" in message and "batch_size=4" in message and "max_seq_len=64" in message


def test_out_of_memory_at_run_time_becomes_the_named_error_and_other_failures_stay(qwen2_untied):
    engine = Engine(str(qwen2_untied.path), [-1], batch_size=2, max_seq_len=32, devices=jax.devices()[:1])
    # The status and text XLA raises when an allocation fails on a GPU or TPU.
    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2147483648 bytes.")
    named = engine.memory_error(oom)
    assert isinstance(named, mem.DeviceMemoryError) and exit_code_for(named) == EX_DATAERR
    assert "batch_size=2" in str(named) and "max_seq_len=32" in str(named) and "2147483648" in str(named)
    assert engine.memory_error(jax.errors.JaxRuntimeError("INTERNAL: something else")) is None
    assert engine.memory_error(ValueError("RESOURCE_EXHAUSTED")) is None

"""The attention kernels behind `attend`: each against the materialised oracle, and inside the model against
transformers; the decision that picks one; and the float32 matmul precision.

On CPU the fused kernels run as their portable forms: `jax.nn.dot_product_attention` with its XLA implementation
(the cuDNN path's own arguments: causal flag, local window, same-document mask) and Pallas splash attention in
interpret mode (the TPU kernel's own code, block masks and segment ids included).
"""

from __future__ import annotations

import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from extract import attention as A
from extract.batching import TokenizedSample, pack_window
from extract.engine import Engine
from tests.extract_model.conftest import VOCAB, write_tiny_model

# 200 tokens is not a multiple of splash's 128-token blocks, so its padding is exercised too.
B, T, N, K, H = 2, 200, 4, 2, 32
WINDOW = 17
#: Masks: plain causal rows, a sliding window, packed rows (row 0 holds three documents and trailing padding,
#: row 1 one document), and both.
CASES = {"causal": (None, False), "window": (WINDOW, False), "packed": (None, True), "packed-window": (WINDOW, True)}


def inputs(seed: int, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H)) * H**-0.5  # pre-scaled, as the model passes them
    k, v = rng.standard_normal((B, T, K, H)), rng.standard_normal((B, T, K, H))
    segments = np.zeros((B, T), np.int32)
    segments[0, :50], segments[0, 50:140], segments[0, 140:185] = 1, 2, 3  # 185..199: padding, segment 0
    segments[1, :] = 1
    return (*(jnp.asarray(x, dtype) for x in (q, k, v)), jnp.asarray(segments))


def run(kernel: str, q, k, v, window, segment_ids, softcap=None):
    with A.use(A.Binding(kernel, interpret=True)):
        return jax.jit(lambda q, k, v, s: A.attend(q, k, v, window=window, segment_ids=s, softcap=softcap))(
            q, k, v, segment_ids
        )


# Splash in interpret mode costs seconds a compile: its two cases cover both of its masks and both segment paths.
@pytest.mark.parametrize(
    "kernel, case", [(A.XLA, case) for case in CASES] + [(A.SPLASH, "causal"), (A.SPLASH, "packed-window")]
)
def test_fused_kernel_matches_the_oracle_in_float32(kernel, case):
    window, packed = CASES[case]
    q, k, v, segments = inputs(seed=len(case))
    segments = segments if packed else None
    oracle = A.materialised(q, k, v, window=window, segment_ids=segments)
    fused = run(kernel, q, k, v, window, segments)
    assert fused.shape == oracle.shape and bool(jnp.isfinite(fused).all())
    assert float(jnp.abs(fused - oracle).max()) <= 1e-5 * float(jnp.abs(oracle).max())


@pytest.mark.parametrize("kernel", [A.XLA, A.SPLASH])
def test_fused_kernel_in_bf16_is_as_close_to_float32_as_the_oracle_in_bf16(kernel):
    q, k, v, segments = inputs(seed=7, dtype=jnp.bfloat16)
    exact = A.materialised(*(x.astype(jnp.float32) for x in (q, k, v)), window=WINDOW, segment_ids=segments)
    oracle_error = float(jnp.abs(A.materialised(q, k, v, window=WINDOW, segment_ids=segments) - exact).max())
    fused = run(kernel, q, k, v, WINDOW, segments)
    assert fused.dtype == jnp.bfloat16
    assert float(jnp.abs(fused.astype(jnp.float32) - exact).max()) <= 2 * oracle_error


def test_splash_soft_caps_the_logits_as_the_oracle_does():
    q, k, v, segments = inputs(seed=3)
    q = q * 8  # logits of a few tens, where a cap of 5 changes the result
    oracle = A.materialised(q, k, v, window=WINDOW, segment_ids=segments, softcap=5.0)
    assert float(jnp.abs(oracle - A.materialised(q, k, v, window=WINDOW, segment_ids=segments)).max()) > 0.1
    fused = run(A.SPLASH, q, k, v, WINDOW, segments, softcap=5.0)
    assert float(jnp.abs(fused - oracle).max()) <= 1e-5 * float(jnp.abs(oracle).max())


def test_a_kernel_without_soft_capping_refuses_it_instead_of_ignoring_it():
    q, k, v, segments = inputs(seed=4)
    with pytest.raises(A.AttentionUnavailable, match="softcap"):
        run(A.XLA, q, k, v, None, segments, softcap=30.0)


# -- the decision ----------------------------------------------------------------------------------------------

PLATFORMS, DTYPES, HEAD_DIMS = ("cpu", "gpu", "tpu"), (jnp.float32, jnp.bfloat16, jnp.float16), (60, 64, 128, 256, 512)


def test_every_automatic_choice_is_a_kernel_that_accepts_the_model():
    """Over every platform, dtype, head size, soft-cap and GPU generation: the automatic choice is never `xla`
    (a test vehicle), float32 and CPU always get the oracle, and the kernel chosen also runs when named."""
    for platform, dtype, head_dim, softcap, hopper in itertools.product(
        PLATFORMS, DTYPES, HEAD_DIMS, (None, 50.0), (True, False)
    ):
        case = dict(softcap=softcap, hopper=hopper)
        choice = A.choose_kernel(platform, dtype, head_dim, **case)
        assert choice.kernel in (A.MATERIALISED, A.CUDNN, A.SPLASH) and choice.reason
        if dtype == jnp.float32 or platform == "cpu":
            assert choice.kernel == A.MATERIALISED, (platform, dtype)
        assert A.choose_kernel(platform, dtype, head_dim, requested=choice.kernel, **case).kernel == choice.kernel


def test_gpu_takes_cudnn_and_tpu_splash_for_a_qwen_model_in_bf16():
    assert A.choose_kernel("gpu", jnp.bfloat16, 128).kernel == A.CUDNN
    assert A.choose_kernel("gpu", jnp.float16, 64, hopper=False).kernel == A.CUDNN
    assert A.choose_kernel("tpu", jnp.bfloat16, 128).kernel == A.SPLASH
    assert A.choose_kernel("gpu", jnp.bfloat16, 256, hopper=False).kernel == A.MATERIALISED  # over cuDNN's 128


def test_soft_capping_moves_the_gpu_to_a_kernel_that_has_it_and_keeps_splash_on_tpu():
    choice = A.choose_kernel("gpu", jnp.bfloat16, 128, softcap=50.0)
    assert choice.kernel == A.MATERIALISED and "softcap" in choice.reason
    assert A.choose_kernel("tpu", jnp.bfloat16, 128, softcap=50.0).kernel == A.SPLASH


@pytest.mark.parametrize(
    "requested, platform, dtype, softcap, needle",
    [
        ("cudnn", "cpu", jnp.bfloat16, None, "not a GPU"),
        ("cudnn", "gpu", jnp.float32, None, "bf16 or fp16"),
        ("cudnn", "gpu", jnp.bfloat16, 30.0, "soft-capping"),
        ("flash", "gpu", jnp.bfloat16, None, "not a kernel"),
    ],
)
def test_asking_for_a_kernel_that_cannot_serve_the_model_names_attention(requested, platform, dtype, softcap, needle):
    with pytest.raises(A.AttentionUnavailable, match=needle) as raised:
        A.choose_kernel(platform, dtype, 128, softcap=softcap, requested=requested)
    assert "attention=" in str(raised.value)


# -- inside the model, against transformers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory):
    # Layer 1 attends to everything, layer 2 to its last 4 keys: documents longer than 4 tokens use the window.
    return write_tiny_model(
        tmp_path_factory.mktemp("windowed"), "qwen2", layers=2, seed=31, use_sliding_window=True, sliding_window=4,
        max_window_layers=1,
    )  # fmt: skip


@pytest.mark.parametrize("kernel", [A.XLA, A.SPLASH])
def test_fused_kernel_in_the_model_matches_transformers_on_packed_windowed_rows(kernel, windowed_model, caplog):
    caplog.set_level(logging.INFO, logger="extract.engine")
    engine = Engine(
        str(windowed_model.path), [1, 2], batch_size=2, max_seq_len=32, compute_dtype="float32",
        out_dtype="float32", devices=jax.devices()[:1], attention=kernel,
    )  # fmt: skip
    assert engine.config.sliding_windows == (None, 4)
    rng = np.random.default_rng(9)
    lengths = [13, 7, 20, 3, 9, 1, 30, 6]
    window = [TokenizedSample(p, p, rng.integers(1, VOCAB, n).astype(np.int32)) for p, n in enumerate(lengths)]
    seen = 0
    for batch in pack_window(window, 2, (16, 32), pad_id=0):
        hidden = engine.forward(batch.token_ids, batch.segment_ids, batch.positions)
        for sample, (row, column) in zip(batch.samples, batch.placements):
            reference = windowed_model.reference(sample.token_ids.tolist())
            for layer in (1, 2):
                mine = np.asarray(hidden[layer])[row, column : column + sample.n_tokens]
                np.testing.assert_allclose(mine, reference[layer], atol=1e-4, rtol=0)
            seen += 1
    assert seen == len(lengths)
    decisions = [r.getMessage() for r in caplog.records if r.getMessage().startswith("event=attention ")]
    assert len(decisions) == 1 and f"kernel={kernel}" in decisions[0]  # decided and logged once, at start


# -- float32 matmul precision ------------------------------------------------------------------------------------


def _dot_lines(engine: Engine, seq_len: int) -> list[str]:
    engine.forward(np.ones((engine.batch_size, seq_len), np.int32))
    (program,) = engine._programs.values()
    return [line for line in program.as_text().splitlines() if " dot(" in line]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float32_programs_multiply_at_highest_precision_without_ynnpack_and_others_at_the_default(dtype, qwen2_untied):
    engine = Engine(
        str(qwen2_untied.path), [-1], batch_size=1, max_seq_len=16, compute_dtype=dtype, devices=jax.devices()[:1],
    )  # fmt: skip
    dots = _dot_lines(engine, 16)
    assert len(dots) >= 7 * qwen2_untied.num_hidden_layers  # q, k, v, o, gate, up, down per layer (and attention)
    highest = ["operand_precision={highest,highest}" in line for line in dots]
    assert all(highest) if dtype == "float32" else not any(highest), dots
    # On a CPU, a float32 program's dots are XLA's own, not YNNPACK's, whose float32 sums are 4-5 times looser than
    # torch's from 64 rows on (Engine.compiler_options; docs/MODEL.md, "Real widths").
    (program,) = engine._programs.values()
    assert ("ynn_fusion" in program.as_text()) == (dtype != "float32")


def test_splash_runs_per_device_on_a_mesh_that_splits_rows_and_heads(qwen2_untied):
    """Splash is a Mosaic call XLA cannot partition: under jax.shard_map each device takes its rows and heads."""
    rng = np.random.default_rng(2)
    tokens = rng.integers(1, VOCAB, (4, 40)).astype(np.int32)
    segments = np.where(np.arange(40) < 25, 1, 2).astype(np.int32)[None].repeat(4, 0)
    positions = np.where(np.arange(40) < 25, np.arange(40), np.arange(40) - 25).astype(np.int32)[None].repeat(4, 0)
    args = dict(batch_size=4, max_seq_len=40, compute_dtype="float32", out_dtype="float32")
    oracle = Engine(str(qwen2_untied.path), [1, -1], devices=jax.devices()[:1], **args)
    assert jax.device_count() >= 4, "XLA_FLAGS=--xla_force_host_platform_device_count=4 (tests/conftest.py)"
    sharded = Engine(
        str(qwen2_untied.path), [1, -1], mesh="data=2,model=2", attention=A.SPLASH, devices=jax.devices()[:4], **args
    )  # fmt: skip
    assert sharded._binding.heads_split and dict(sharded.mesh.shape) == {"data": 2, "model": 2}
    expected = oracle.forward(tokens, segments, positions)
    for layer, value in sharded.forward(tokens, segments, positions).items():
        np.testing.assert_allclose(np.asarray(value), np.asarray(expected[layer]), atol=1e-5, rtol=0)

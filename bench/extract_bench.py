"""Extraction throughput: our JAX forward against transformers' PyTorch forward, side by side in one process.

CPU (default): a random Qwen2-shaped checkpoint written with transformers, loaded by both, float32 on both sides.
Each timed iteration runs our forward (to layer k, blocking on the result) and then transformers'
`Qwen2ForCausalLM(output_hidden_states=True)`, interleaved so that machine noise hits both alike. transformers
computes the whole stack and the LM head because that is what its API does; the bare `Qwen2Model` (no LM head) is
timed as well so the figure that isolates the LM-head saving is on the page too.

Accelerator (`--accelerator`, or automatically when a GPU/TPU is present): a Qwen2.5-7B-shaped model with random
weights drawn on the devices, bf16, and MFU = tokens/s * flops_per_token / peak_flops.

    .venv/bin/python bench/extract_bench.py [--iters 5] [--layer K] [--accelerator]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from extract.config import QwenConfig  # noqa: E402
from extract.costmodel import KNOWN_CONFIGS  # noqa: E402
from extract.engine import Engine  # noqa: E402

QWEN25_7B = KNOWN_CONFIGS["Qwen/Qwen2.5-7B"]  # the one copy of its config.json


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _rate(tokens: int, seconds: list[float]) -> float:
    return tokens / statistics.median(seconds)


def cpu_bench(args: argparse.Namespace) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    hf_config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(4096, args.seq),
        tie_word_embeddings=False,
    )
    torch_model = Qwen2ForCausalLM(hf_config).eval()
    layer = args.layer if args.layer is not None else args.layers
    tokens = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq), dtype=np.int32)
    torch_tokens = torch.from_numpy(tokens.astype(np.int64))

    with tempfile.TemporaryDirectory(prefix="extract-bench-") as model_dir:
        torch_model.save_pretrained(model_dir)
        engine = Engine(
            model_dir, [layer], batch_size=args.batch, max_seq_len=args.seq, compute_dtype="float32",
            out_dtype="float32", mesh=args.mesh, devices=jax.devices("cpu"),
        )  # fmt: skip

    def ours() -> None:
        jax.block_until_ready(engine.forward(tokens))

    def torch_causal_lm() -> None:
        with torch.inference_mode():
            torch_model(torch_tokens, output_hidden_states=True)

    def torch_base() -> None:
        with torch.inference_mode():
            torch_model.model(torch_tokens, output_hidden_states=True)

    for fn in (ours, torch_causal_lm, torch_base):  # warm-up: compilation, allocator, thread pools
        fn()
        fn()
    times: dict[str, list[float]] = {"ours": [], "causal_lm": [], "base": []}
    for _ in range(args.iters):
        times["ours"].append(_timed(ours))
        times["causal_lm"].append(_timed(torch_causal_lm))
        times["base"].append(_timed(torch_base))

    n_tokens = args.batch * args.seq
    print(
        f"model: qwen2 hidden={args.hidden} layers={args.layers} heads={args.heads} kv_heads={args.kv_heads} "
        f"intermediate={args.intermediate} vocab={args.vocab}; batch={args.batch} seq={args.seq} float32; "
        f"our forward to hidden state {layer}; cpus={os.cpu_count()} torch_threads={torch.get_num_threads()} "
        f"mesh={dict(engine.mesh.shape)} iters={args.iters}, interleaved; load average {os.getloadavg()[0]:.1f}"
    )
    labels = {
        "ours": "ours (JAX/Flax NNX, to layer k)",
        "causal_lm": "transformers Qwen2ForCausalLM",
        "base": "transformers Qwen2Model (no LM head)",
    }
    print(f"{'':40s} {'median tok/s':>13s} {'best tok/s':>11s} {'ours/this (median)':>19s} {'(best)':>7s}")
    ours_median, ours_best = _rate(n_tokens, times["ours"]), n_tokens / min(times["ours"])
    for key, label in labels.items():
        median, best = _rate(n_tokens, times[key]), n_tokens / min(times[key])
        ratios = "" if key == "ours" else f"{ours_median / median:18.2f}x {ours_best / best:6.2f}x"
        print(f"{label:40s} {median:13.0f} {best:11.0f} {ratios}")
    print(f"forward GFLOP/token (ours, to layer {layer}): {engine.flops_per_token(args.seq) / 1e9:.4f}")


def accelerator_bench(args: argparse.Namespace) -> None:
    config = QwenConfig.from_dict(QWEN25_7B, source="Qwen2.5-7B shape")
    layer = args.layer if args.layer is not None else config.num_hidden_layers
    batch = args.accel_batch
    seq = args.accel_seq
    engine = Engine.with_random_weights(
        config, [layer], batch_size=batch, max_seq_len=seq, compute_dtype="bfloat16", out_dtype="bfloat16",
        mesh=args.mesh,
    )  # fmt: skip
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (batch, seq), dtype=np.int32)
    for _ in range(2):
        jax.block_until_ready(engine.forward(tokens))
    seconds = []
    for _ in range(args.iters):
        seconds.append(_timed(lambda: jax.block_until_ready(engine.forward(tokens))))
    rate = _rate(batch * seq, seconds)
    flops = engine.flops_per_token(seq)
    peak = engine.peak_flops()
    devices = engine.mesh.devices.flat
    print(
        f"model: Qwen2.5-7B shape (random weights) bf16; batch={batch} seq={seq}; to hidden state {layer}; "
        f"devices={len(engine.mesh.devices.flat)} x {next(iter(devices)).device_kind} mesh={dict(engine.mesh.shape)}"
    )
    print(f"tokens/s: {rate:.0f}   GFLOP/token: {flops / 1e9:.2f}   achieved TFLOP/s: {rate * flops / 1e12:.1f}")
    if peak is None:
        print(f"MFU: unknown (no bf16 peak FLOP/s known for {next(iter(engine.mesh.devices.flat)).device_kind})")
    else:
        print(f"peak bf16 TFLOP/s: {peak / 1e12:.0f}   MFU: {rate * flops / peak:.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--layer", type=int, default=None, help="hidden-state index k (default: the last layer)")
    parser.add_argument("--mesh", default=None, help="e.g. data=2,model=1 (default: automatic)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accelerator", action="store_true", help="also run the Qwen2.5-7B-shaped bf16 MFU benchmark")
    parser.add_argument("--accel-seq", type=int, default=512)
    parser.add_argument("--accel-batch", type=int, default=16)
    parser.add_argument("--skip-cpu", action="store_true", help="only the accelerator benchmark")
    args = parser.parse_args(argv)
    has_accelerator = jax.default_backend() in ("gpu", "tpu")
    if not args.skip_cpu:
        cpu_bench(args)
    if args.accelerator or has_accelerator:
        if not has_accelerator:
            # Still useful to check the path end to end (e.g. with --layer 1 --accel-batch 1 --accel-seq 64).
            print("--accelerator: no GPU/TPU present; running the 7B-shaped model on CPU, MFU unknown", file=sys.stderr)
        accelerator_bench(args)


if __name__ == "__main__":
    main()

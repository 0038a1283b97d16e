"""Extraction throughput: our JAX forward against transformers' PyTorch forward, side by side in one process.

CPU (default): a random Qwen2-shaped checkpoint written with transformers, loaded by both, float32 on both sides.
Each timed iteration runs our forward (to layer k, blocking on the result) and then transformers'
`Qwen2ForCausalLM(output_hidden_states=True)`, interleaved so that machine noise hits both alike. transformers
computes the whole stack and the LM head because that is what its API does; the bare `Qwen2Model` (no LM head) is
timed as well so the figure that isolates the LM-head saving is on the page too.

Accelerator (`--accelerator`, or automatically when a GPU/TPU is present), the measurement of docs/PERFORMANCE.md: a
Qwen2.5-7B-shaped model with random bf16 weights drawn on the devices, hidden states 15-18, packed rows of 2,048
tokens, each attention kernel side by side (by default the engine's own choice and the materialised oracle), at
the batch the memory model fits. Per kernel: tokens/s of the device alone (steps back to back) and of the
consumer's pipeline (the engine feeding the real shard writer), MFU against the published dense bf16 peak and
against a bf16 matmul measured here, and the device-busy fraction of the pipeline's wall time, beside that of a
control loop that reads each step to the host before dispatching the next. Without a GPU/TPU `--accelerator` runs
the same measurement on the CPU (busy fraction included; MFU against a published peak is then unknown).

    .venv/bin/python bench/extract_bench.py [--iters 5] [--layer K]
    python3 bench/extract_bench.py --accelerator --skip-cpu            # on a GPU/TPU host
    .venv/bin/python bench/extract_bench.py --accelerator --skip-cpu --accel-shape tiny --accel-seq 256 \
        --matmul-size 512 --attention xla,materialised --iters 3      # the same path, end to end, on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from extract import attention, memory  # noqa: E402
from extract.batching import PACKED_WINDOW_BATCHES, Batch, TokenizedSample, pack_window, shard_token_limit  # noqa: E402
from extract.config import ModelConfig  # noqa: E402
from extract.costmodel import KNOWN_CONFIGS  # noqa: E402
from extract.engine import Engine, device_peak_flops  # noqa: E402
from extract.memory import IN_FLIGHT_STEPS, DeviceMemoryError  # noqa: E402
from extract.sharding import device_memory_bytes  # noqa: E402
from extract.writer import ProgressLog, ShardWriter, numpy_dtype  # noqa: E402
from objectstore.local import LocalStore  # noqa: E402

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


# -- the accelerator benchmark -------------------------------------------------------------------------------------

#: A shape small enough for a CPU to run the accelerator benchmark end to end (layers 15-18 exist in it).
TINY_SHAPE = {
    "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 20,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip
#: Document lengths (tokens) drawn log-normally around FineWeb-Edu's ~1,000-token mean, then packed into rows.
DOC_LOG_MEAN, DOC_LOG_SIGMA = 6.5, 1.0


def packed_batches(batch_size: int, seq_len: int, steps: int, vocab: int, seed: int = 0) -> tuple[list[Batch], int]:
    """At least `steps` packed batches of random documents, whole windows only, as the consumer forms them
    (`extract.batching.pack_window`); and the number of documents (slice positions 0..n-1)."""
    rng = np.random.default_rng(seed)
    batches: list[Batch] = []
    position = 0
    while len(batches) < steps:
        window = []
        for _ in range(PACKED_WINDOW_BATCHES * batch_size):
            n = int(np.clip(rng.lognormal(DOC_LOG_MEAN, DOC_LOG_SIGMA), 1, seq_len))
            window.append(TokenizedSample(position, position, rng.integers(1, vocab, n).astype(np.int32)))
            position += 1
        batches.extend(pack_window(window, batch_size, (seq_len,), pad_id=0))
    return batches, position


class DeviceTimeline:
    """When each dispatched step was handed to the device and when its outputs were ready (a watcher thread waits
    on each in order). Busy time is each step's span from the later of its dispatch and the previous step's end to
    its own end; gaps are the device waiting for the host."""

    def __init__(self) -> None:
        self.dispatched: list[float] = []
        self.done: list[float] = []
        self._steps: queue.Queue = queue.Queue()
        self._watcher = threading.Thread(target=self._watch, name="device-timeline", daemon=True)
        self._watcher.start()

    def dispatch(self, hidden) -> None:
        self.dispatched.append(time.perf_counter())
        self._steps.put(hidden)

    def _watch(self) -> None:
        while (hidden := self._steps.get()) is not None:
            jax.block_until_ready(hidden)
            self.done.append(time.perf_counter())

    def busy_fraction(self) -> float:
        self._steps.put(None)
        self._watcher.join()
        busy, previous = 0.0, float("-inf")
        for dispatched, done in zip(self.dispatched, self.done):
            busy += done - max(previous, dispatched)
            previous = done
        return busy / (self.done[-1] - self.dispatched[0])


class DroppingStore(LocalStore):
    """A local store whose shard uploads are dropped: the pipeline measures the device-to-host copies and the
    encoding between the engine and storage, not a disk (a 7B step writes gigabytes; docs/PERFORMANCE.md)."""

    def put(self, name, data, metadata=None, content_type=None) -> int:
        return 1


def matmul_peak(size: int, dtype, device: jax.Device, iters: int = 10) -> float:
    """Measured FLOP/s of a size^3 matrix product on one device, on random data (zeros can run faster), rotating
    three operand pairs, after warm-up."""
    keys = jax.random.split(jax.random.key(0), 6)
    operands = [jax.device_put(jax.random.normal(k, (size, size), dtype), device) for k in keys]
    pairs = [(operands[i], operands[i + 3]) for i in range(3)]
    product = jax.jit(lambda a, b: a @ b)
    for a, b in pairs:
        product(a, b).block_until_ready()
    started = time.perf_counter()
    results = [product(*pairs[i % 3]) for i in range(iters)]
    jax.block_until_ready(results)
    return 2 * size**3 * iters / (time.perf_counter() - started)


def _auto_batch(config: ModelConfig, layers, seq_len: int, requested: str, cap: int) -> int:
    """The largest batch the memory model fits on one device (a multiple of the device count), at most `cap`."""
    device = jax.devices()[0]
    usable = device_memory_bytes(device) or memory.usable_bytes(device.device_kind, device.platform)
    if usable is None:  # CPU: memory unknown
        return min(cap, 2 * jax.device_count())
    kernel = attention.choose_kernel(device.platform, jnp.bfloat16, config.head_dim, requested=requested).kernel
    rows = memory.rows_that_fit(
        usable, config=config, depth=max(layers), kept=len(layers), seq_len=seq_len, compute_bytes=2, out_bytes=2,
        kernel=kernel, packed=True,
    )  # fmt: skip
    return max(1, min(rows, cap)) * jax.device_count()


def _bench_kernel(config, layers, args, kernel: str, batch: int, peaks: dict) -> dict:
    seq = args.accel_seq
    engine = Engine.with_random_weights(
        config, layers, batch_size=batch, max_seq_len=seq, compute_dtype="bfloat16", out_dtype="bfloat16",
        mesh=args.mesh, attention=kernel,
    )  # fmt: skip
    batches, documents = packed_batches(batch, seq, args.iters, config.vocab_size)
    tokens = sum(b.n_tokens for b in batches)
    flops = sum(s.n_tokens * engine.flops_per_token(s.n_tokens) for b in batches for s in b.samples)

    def forward(b: Batch):
        return engine.forward(b.token_ids, b.segment_ids, b.positions)

    for b in batches[:2]:  # compilation and warm-up
        jax.block_until_ready(forward(b))
    started = time.perf_counter()  # the device alone: steps back to back, nothing else on the host
    jax.block_until_ready([forward(b) for b in batches])
    device_seconds = time.perf_counter() - started

    # The consumer's pipeline: dispatch, then the real shard writer (device-to-host copies, encoding).
    timeline = DeviceTimeline()
    with tempfile.TemporaryDirectory(prefix="extract-bench-") as out:
        per_token = len(engine.layers) * config.hidden_size * 2 + 4
        writer = ShardWriter(
            store=DroppingStore(out), layers=engine.layers, out_dtype=numpy_dtype("bfloat16"), start=0,
            end=documents, shard_size=10**9,
            metadata={"hidden_size": str(config.hidden_size)}, progress=ProgressLog(None), depth=IN_FLIGHT_STEPS,
            shard_tokens=shard_token_limit(256 * 2**20, per_token),
        )  # fmt: skip
        started = time.perf_counter()
        for b in batches:
            hidden = forward(b)
            timeline.dispatch(hidden)
            writer.submit(b, hidden)
        writer.finish()
        pipeline_seconds = time.perf_counter() - started
    busy = timeline.busy_fraction()
    # The control: the same steps, each read to the host before the next is dispatched (no overlap). The busy
    # fraction must fall here by the host's share; if it does not, it is not measuring overlap.
    serial = DeviceTimeline()
    for b in batches:
        hidden = forward(b)
        serial.dispatch(hidden)
        jax.device_get(hidden)
    serial_busy = serial.busy_fraction()
    devices = engine.mesh.devices.size
    row_tokens = sum(b.token_ids.size for b in batches)
    return {
        "kernel": engine.attention.kernel,
        "batch": batch,
        "padding": 1 - tokens / row_tokens,
        "device_tokens_per_s": tokens / device_seconds,
        "pipeline_tokens_per_s": tokens / pipeline_seconds,
        "flops_per_s": flops / device_seconds,
        "pipeline_flops_per_s": flops / pipeline_seconds,
        "mfu_published": None if peaks["published"] is None else flops / device_seconds / peaks["published"],
        "mfu_measured": flops / device_seconds / (peaks["measured"] * devices),
        "pipeline_mfu_published": (
            None if peaks["published"] is None else flops / pipeline_seconds / peaks["published"]
        ),
        "busy": busy,
        "serial_busy": serial_busy,
        "steps": len(batches),
    }


def accelerator_bench(args: argparse.Namespace) -> None:
    """The issue's measurement: Qwen2.5-7B shape, random bf16 weights, layers 15-18, packed rows of 2,048 tokens,
    each attention kernel side by side: tokens/s, MFU against the published and the measured matmul peak, and the
    device-busy fraction of the consumer's pipeline."""
    raw = QWEN25_7B if args.accel_shape == "qwen2.5-7b" else TINY_SHAPE
    config = ModelConfig.from_dict(raw, source=f"{args.accel_shape} shape")
    layers = [int(x) for x in args.accel_layers.split(",")]
    device = jax.devices()[0]
    published = device_peak_flops(device)
    peaks = {
        "published": None if published is None else published * jax.device_count(),
        "measured": matmul_peak(args.matmul_size, jnp.bfloat16, device),
    }
    print(
        f"devices: {jax.device_count()} x {device.device_kind} ({device.platform}); jax {jax.__version__}; "
        f"published dense bf16 peak {'unknown' if published is None else f'{published / 1e12:.0f} TFLOP/s'} a device; "
        f"measured bf16 {args.matmul_size}^3 matmul {peaks['measured'] / 1e12:.1f} TFLOP/s; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"model: {args.accel_shape} (random weights) bf16, layers {args.accel_layers} (computes {max(layers)}), "
        f"packed rows of {args.accel_seq} tokens (documents ~lognormal({DOC_LOG_MEAN}, {DOC_LOG_SIGMA})), "
        f"whole packing windows of at least {args.iters} steps a kernel"
    )
    rows = []
    for requested in args.attention.split(","):
        batch = int(args.accel_batch) if args.accel_batch != "auto" else _auto_batch(
            config, layers, args.accel_seq, requested, args.max_rows
        )  # fmt: skip
        try:
            rows.append(_bench_kernel(config, layers, args, requested, batch, peaks))
        except DeviceMemoryError as refused:
            print(f"attention={requested} batch={batch}: {refused}")
    header = (
        f"{'attention':13s} {'batch':>5s} {'pad':>5s} {'tok/s device':>13s} {'tok/s pipeline':>15s} {'TFLOP/s':>8s} "
        f"{'MFU(pub)':>8s} {'MFU(meas)':>9s} {'MFU pipe':>8s} {'busy':>6s} {'serial':>6s} {'steps':>5s}"
    )
    print(header)
    for r in rows:
        pub = "n/a" if r["mfu_published"] is None else f"{r['mfu_published']:.3f}"
        pipe = "n/a" if r["pipeline_mfu_published"] is None else f"{r['pipeline_mfu_published']:.3f}"
        print(
            f"{r['kernel']:13s} {r['batch']:5d} {r['padding']:5.1%} {r['device_tokens_per_s']:13.0f} "
            f"{r['pipeline_tokens_per_s']:15.0f} {r['flops_per_s'] / 1e12:8.2f} {pub:>8s} {r['mfu_measured']:9.3f} "
            f"{pipe:>8s} {r['busy']:6.1%} {r['serial_busy']:6.1%} {r['steps']:5d}"
        )
    print(
        "MFU = useful FLOPs (each document at its own length, Engine.flops_per_token) per second of the device alone, "
        "over the peak; 'pipe' and 'busy' are the consumer's pipeline (engine + shard writer, uploads dropped); "
        "'serial' is the busy fraction of a control loop that reads each step to the host before the next"
    )
    if args.json:
        print(json.dumps({"peaks": peaks, "results": rows}))


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
    parser.add_argument("--accelerator", action="store_true", help="run the accelerator benchmark (also on CPU)")
    parser.add_argument("--accel-shape", choices=("qwen2.5-7b", "tiny"), default="qwen2.5-7b")
    parser.add_argument("--accel-layers", default="15,16,17,18", help="hidden states kept (default 15,16,17,18)")
    parser.add_argument("--accel-seq", type=int, default=2048, help="packed row length (default 2048)")
    parser.add_argument("--accel-batch", default="auto", help="rows a step, or auto: what the memory model fits")
    parser.add_argument("--max-rows", type=int, default=64, help="cap on auto rows per device (default 64)")
    parser.add_argument("--attention", default="auto,materialised", help="kernels side by side (default auto,materialised)")
    parser.add_argument("--matmul-size", type=int, default=8192, help="bf16 matmul measured for the peak (default 8192)")
    parser.add_argument("--json", action="store_true", help="also print the accelerator figures as one JSON line")
    parser.add_argument("--skip-cpu", action="store_true", help="only the accelerator benchmark")
    args = parser.parse_args(argv)
    has_accelerator = jax.default_backend() in ("gpu", "tpu")
    if not args.skip_cpu:
        cpu_bench(args)
    if args.accelerator or has_accelerator:
        if not has_accelerator:
            print("--accelerator: no GPU/TPU present; running on CPU, MFU against a published peak unknown",
                  file=sys.stderr)  # fmt: skip
        accelerator_bench(args)


if __name__ == "__main__":
    main()

"""The host's ceiling: how fast this machine feeds the extraction pipeline when the accelerator costs nothing.

Runs the real consume pipeline (`extract.consumer.run`: parquet reading, tokenisation, batching, the shard writer,
the object store) with a stand-in engine whose `forward` returns activations of the job's shape at once (the same
device arrays every time, so the device costs nothing), and prints, side by side in one run:

- the host ceiling in tokens/s and GB/s, to a null store (no I/O), the local store and the test GCS server;
- what a v4-8, a v5litepod-8 and an H100 need at 50% MFU for the same job, and ceiling / need;
- the ceiling per host core;
- each stage measured alone on the same documents (read, tokenise + batch, device->host, writer encode,
  store upload), so the bottleneck is named;
- peak resident memory of the process during each pipeline run;
- upload throughput against the test GCS server with added latency as parallel streams grow;
- the padding fraction (real tokens / computed tokens) of today's bucketed batching on a FineWeb-Edu-like
  length distribution at max_seq_len 512 and 2048.

Document lengths: lognormal in tokens, median 650 and mean ~1030 (sigma 0.96). FineWeb-Edu sample-10BT holds about
10B GPT-2 tokens in 9.67M documents (dataset card), a mean of ~1030 tokens per document; web-document lengths are
heavy-tailed with the median well below the mean, and sigma is chosen so that median/mean = 0.63. The tokenizer
here is a small byte-level BPE trained on the spot (no network), so texts are generated to hit those token counts.

    .venv/bin/python bench/host_bench.py                       # 7B shape: layers 15-18 x 3584, bf16
    .venv/bin/python bench/host_bench.py --docs 600 --skip-gcs # quicker
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import ml_dtypes
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import objectstore  # noqa: E402
from extract import batching, consumer, data  # noqa: E402
from extract.config import ModelConfig  # noqa: E402
from extract.engine import Engine, normalize_layers  # noqa: E402
from extract.job import Job, Task, default_buckets  # noqa: E402
from extract.tiny import write_tiny_tokenizer  # noqa: E402
from extract.writer import ProgressLog, ShardWriter  # noqa: E402
from extract.costmodel import KNOWN_CONFIGS  # noqa: E402

QWEN25_7B = KNOWN_CONFIGS["Qwen/Qwen2.5-7B"]  # the one copy of its config.json
#: Dense bf16 peak per chip, as in extract/engine.py, times chips per machine.
ACCELERATORS = (("v4-8", 4 * 275e12), ("v5litepod-8", 8 * 197e12), ("H100", 989e12))
MFU = 0.5
LENGTH_MEDIAN = 650
LENGTH_SIGMA = 0.96


# -- inputs -------------------------------------------------------------------------------------------------------


def document_lengths(n: int, seed: int) -> np.ndarray:
    """FineWeb-Edu-like token counts (see the module docstring), at least 1."""
    rng = np.random.default_rng(seed)
    return np.maximum(1, np.round(rng.lognormal(math.log(LENGTH_MEDIAN), LENGTH_SIGMA, n))).astype(np.int64)


def make_corpus(directory: pathlib.Path, tokenizer: batching.Tokenizer, n_docs: int, seed: int) -> pathlib.Path:
    """One parquet file of `n_docs` texts whose token counts follow `document_lengths`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    words = [w for w in (tokenizer.hf.decode([i]).strip() for i in range(300, len(tokenizer.hf))) if w.isalpha()]
    words = words or ["word"]
    probe = " ".join(rng.choice(words) for _ in range(4000))
    tokens_per_word = len(tokenizer.hf(probe, add_special_tokens=False)["input_ids"]) / 4000
    texts = [
        " ".join(rng.choice(words) for _ in range(max(1, round(n / tokens_per_word))))
        for n in document_lengths(n_docs, seed)
    ]
    path = directory / "000_00000.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=256)
    return path


class StandInEngine:
    """The engine's interface with no model: `forward` returns the same [batch, T, hidden] device array per bucket
    for every requested layer, so the device side costs nothing and only the host is measured."""

    def __init__(self, model_dir: pathlib.Path, config: ModelConfig, layers: list[int], batch_size: int, out_dtype):
        self.model_dir = model_dir
        self.config = config
        self.layers = normalize_layers(layers, config.num_hidden_layers)
        self.num_computed_layers = max(self.layers)
        self.batch_size = batch_size
        self.compiled_programs = 0
        self._dtype = out_dtype
        self._outputs: dict[int, jax.Array] = {}

    def forward(self, token_ids: np.ndarray) -> dict[int, jax.Array]:
        seq = token_ids.shape[1]
        if seq not in self._outputs:
            rng = np.random.default_rng(seq)
            host = rng.standard_normal((self.batch_size, seq, self.config.hidden_size), dtype=np.float32)
            self._outputs[seq] = jax.device_put(host.astype(self._dtype))
            self.compiled_programs += 1
        return {layer: self._outputs[seq] for layer in self.layers}

    flops_per_token = Engine.flops_per_token

    def peak_flops(self) -> None:
        return None


class NullStore:
    """A store that keeps nothing: the writer's own cost without I/O."""

    root_url = "null://"

    def put(self, name: str, payload: Any, metadata: Any = None) -> int:
        return 1

    def url(self, name: str) -> str:
        return f"null://{name}"


# -- measurement helpers ------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples resident memory every 20 ms while active."""

    def __enter__(self) -> "PeakRSS":
        self.start = _rss_bytes()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


@contextlib.contextmanager
def fake_gcs_server() -> Iterator[str]:
    """`python -m tests.fakegcs` in its own process (its own GIL), with bucket `bench`; yields its URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.fakegcs", "--port", "0", "--print-url", "--bucket", "bench"],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        url = process.stdout.readline().strip()
        if not url.startswith("http"):
            raise RuntimeError(f"the fake GCS server did not print its URL (got {url!r})")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


@dataclasses.dataclass
class Setup:
    job: Job
    task: Task
    engine: StandInEngine
    tokenizer: batching.Tokenizer
    bytes_per_token: int


def make_setup(args: argparse.Namespace, root: pathlib.Path) -> Setup:
    config = ModelConfig.from_dict(QWEN25_7B, source="Qwen2.5-7B shape")
    model_dir = root / "model"
    write_tiny_tokenizer(model_dir, vocab=args.vocab, seed=0, model_max_length=args.max_seq_len)
    (model_dir / "config.json").write_text(json.dumps(QWEN25_7B))
    tokenizer = batching.Tokenizer(model_dir, args.max_seq_len)
    parquet = make_corpus(root, tokenizer, args.docs, seed=1)
    job = Job.from_dict(
        {
            "data_files": [str(parquet)],
            "model": str(model_dir),
            "layers": args.layers,
            "max_seq_len": args.max_seq_len,
            "batch_size": args.batch_size,
            "shard_size": args.shard_size,
            "dtype": "bf16",
            **({"shard_bytes": args.shard_bytes} if args.shard_bytes else {}),
        }
    )
    task = Task.from_dict({"id": "bench", "files": [{"path": str(parquet), "base": 0, "start": 0, "end": args.docs}]})
    out_dtype = np.dtype(ml_dtypes.bfloat16)
    engine = StandInEngine(model_dir, config, args.layers, args.batch_size, out_dtype)
    bytes_per_token = len(engine.layers) * config.hidden_size * out_dtype.itemsize
    return Setup(job, task, engine, tokenizer, bytes_per_token)


@dataclasses.dataclass
class PipelineRun:
    sink: str
    seconds: float
    tokens: int
    payload_bytes: int
    shards: int
    peak_rss: int
    start_rss: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def gb_per_s(self) -> float:
        return self.payload_bytes / self.seconds / 1e9


def run_pipeline(setup: Setup, sink: str, output_url: str, store: Any | None = None) -> PipelineRun:
    """The whole consume loop to one sink. `store` replaces `objectstore.open_store` (the null sink)."""
    inputs = consumer.RunInputs(job=setup.job, task=setup.task, output_url=output_url, log_every_s=1e9)
    original = objectstore.open_store
    if store is not None:
        objectstore.open_store = lambda url, client=None: store
    try:
        with PeakRSS() as rss:
            started = time.perf_counter()
            result = consumer.run(inputs, engine=setup.engine)
            seconds = time.perf_counter() - started
    finally:
        objectstore.open_store = original
    return PipelineRun(
        sink=sink,
        seconds=seconds,
        tokens=sum(r["tokens"] for r in result.records),
        payload_bytes=sum(r["bytes"] for r in result.records),
        shards=len(result.records),
        peak_rss=rss.peak,
        start_rss=rss.start,
    )


def writer_alone(setup: Setup, batches: list[batching.Batch]) -> list[dict[str, Any]]:
    """The shard writer fed ready batches and device outputs, storing to a NullStore: its records."""
    writer = ShardWriter(
        store=NullStore(), layers=setup.engine.layers, out_dtype=np.dtype(ml_dtypes.bfloat16), start=0,
        end=setup.task.num_samples, shard_size=setup.job.shard_size,
        metadata={"hidden_size": str(setup.engine.config.hidden_size)}, progress=ProgressLog(None),
    )  # fmt: skip
    for batch in batches:
        writer.submit(batch, setup.engine.forward(batch.token_ids) if batch.token_ids is not None else {})
    return writer.finish()


def stage_times(setup: Setup, upload_stores: dict[str, Any]) -> tuple[dict[str, float], int]:
    """Each stage alone over the same documents: seconds, and the number of real tokens."""
    job, task, tokenizer = setup.job, setup.task, setup.tokenizer
    times: dict[str, float] = {}

    started = time.perf_counter()
    documents = list(data.read_slice(task, job.text_field))
    times["read"] = time.perf_counter() - started

    started = time.perf_counter()
    batches = list(
        batching.batches_for_slice(
            iter(documents), tokenizer, start=0, end=task.num_samples, batch_size=job.batch_size,
            shard_size=job.shard_size, buckets=job.buckets,
        )
    )  # fmt: skip
    times["tokenise+batch"] = time.perf_counter() - started
    tokens = sum(b.n_tokens for b in batches)

    started = time.perf_counter()
    for batch in batches:
        if batch.token_ids is not None:
            jax.device_get(setup.engine.forward(batch.token_ids))
    times["device->host"] = time.perf_counter() - started

    started = time.perf_counter()
    records = writer_alone(setup, batches)
    times["writer encode (null store)"] = time.perf_counter() - started

    # One shard-sized payload stored as many times as the run stores shards.
    shard_bytes = max(1, sum(r["bytes"] for r in records) // len(records))
    payload = np.random.default_rng(0).integers(0, 255, shard_bytes, dtype=np.uint8).tobytes()
    for name, store in upload_stores.items():
        started = time.perf_counter()
        for k in range(len(records)):
            store.put(f"stage/upload-{k}.bin", payload)
        times[f"upload to {name}"] = time.perf_counter() - started
    return times, tokens


# -- streams ------------------------------------------------------------------------------------------------------


def streams_scaling(store: Any, object_bytes: int, objects: int, streams: list[int]) -> list[tuple[int, float]]:
    """GB/s of `objects` puts of `object_bytes` each through a pool of n threads, for each n."""
    payload = np.random.default_rng(1).integers(0, 255, object_bytes, dtype=np.uint8).tobytes()
    results = []
    for n in streams:
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=n) as pool:
            list(pool.map(lambda k: store.put(f"streams/{n}/{k}.bin", payload), range(objects)))
        results.append((n, objects * object_bytes / (time.perf_counter() - started) / 1e9))
    return results


# -- padding ------------------------------------------------------------------------------------------------------


def padding_fraction(
    max_seq_len: int, batch_size: int, n_docs: int, seed: int, packing: bool = False
) -> tuple[float, float]:
    """(real / computed tokens, mean real tokens per document) for the batcher on `document_lengths`."""
    lengths = np.minimum(document_lengths(n_docs, seed), max_seq_len)
    buckets = default_buckets(max_seq_len)
    window = batching.window_size(batch_size, packing)
    real = computed = 0
    for lo in range(0, n_docs, window):
        samples = [
            batching.TokenizedSample(p, p, np.zeros(int(n), np.int32)) for p, n in enumerate(lengths[lo : lo + window])
        ]
        form = batching.pack_window if packing else batching.make_batches
        for batch in form(samples, batch_size, buckets, pad_id=0):
            real += batch.n_tokens
            computed += batch.token_ids.size
    return real / computed, float(lengths.mean())


# -- main ---------------------------------------------------------------------------------------------------------


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=1500, help="documents in the benchmark's task")
    parser.add_argument("--layers", type=int, nargs="+", default=[15, 16, 17, 18])
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--shard-size", type=int, default=8, help="samples per shard (7B x 4 layers: ~230 MB)")
    parser.add_argument("--shard-bytes", type=int, default=None, help="job.shard_bytes (default: the job default)")
    parser.add_argument("--vocab", type=int, default=2048, help="size of the stand-in byte-level BPE")
    parser.add_argument("--local-dir", default=None, help="local store root (default: a temporary directory)")
    parser.add_argument("--skip-gcs", action="store_true", help="no test GCS server runs")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--latency", type=float, default=0.05, help="seconds added per request in the streams test")
    parser.add_argument("--stream-object-mb", type=int, default=8)
    parser.add_argument("--stream-objects", type=int, default=16)
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1

    with contextlib.ExitStack() as stack:
        root = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="host-bench-")))
        local_root = pathlib.Path(args.local_dir) if args.local_dir else root / "store"
        setup = make_setup(args, root)
        gcs_url = None if args.skip_gcs else stack.enter_context(fake_gcs_server())
        if gcs_url:
            os.environ["STORAGE_EMULATOR_HOST"] = gcs_url
        stores = {"local": objectstore.open_store(str(local_root / "stage"))}
        if gcs_url:
            stores["gcs"] = objectstore.open_store("gs://bench/stage")

        for bucket in setup.job.buckets:  # allocate the stand-in outputs before timing
            setup.engine.forward(np.zeros((args.batch_size, bucket), np.int32))
        times, stage_tokens = stage_times(setup, stores)
        runs = [run_pipeline(setup, "null", "null://", store=NullStore())]
        runs.append(run_pipeline(setup, "local", str(local_root / "run")))
        if gcs_url:
            runs.append(run_pipeline(setup, "gcs", "gs://bench/run"))
        scaling = []
        if gcs_url:
            from tests.fakegcs.server import FakeGCSAdmin

            FakeGCSAdmin(gcs_url).faults.add_latency(args.latency)
            scaling = streams_scaling(
                stores["gcs"], args.stream_object_mb << 20, args.stream_objects, args.streams
            )
            FakeGCSAdmin(gcs_url).faults.reset()

    flops = setup.engine.flops_per_token(args.max_seq_len)
    print(
        f"job: Qwen2.5-7B shape, layers {','.join(map(str, setup.engine.layers))} "
        f"x hidden {setup.engine.config.hidden_size} "
        f"bf16 = {setup.bytes_per_token} B/token; max_seq_len={args.max_seq_len} batch={args.batch_size} "
        f"shard_size={args.shard_size}; {args.docs} docs, {stage_tokens} real tokens; cores={cores}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"compute to layer {max(setup.engine.layers)}: {flops / 1e9:.2f} GFLOP/token (at seq {args.max_seq_len})")
    print("host copies per output byte, device -> store: 2 (device_get; rows into the shard buffer), see ShardWriter")
    print()
    print(f"{'sink':8s} {'tokens/s':>10s} {'GB/s':>7s} {'tokens/s/core':>14s} {'shards':>7s} {'peak RSS':>10s} "
          f"{'(+ over start)':>15s}")  # fmt: skip
    for run in runs:
        print(
            f"{run.sink:8s} {run.tokens_per_s:10.0f} {run.gb_per_s:7.3f} {run.tokens_per_s / cores:14.0f} "
            f"{run.shards:7d} {_gb(run.peak_rss):>10s} {_gb(run.peak_rss - run.start_rss):>15s}"
        )
    print()
    header = f"{'accelerator at 50% MFU':24s} {'tokens/s':>10s} {'GB/s':>7s}"
    print(header + "".join(f" {'ceiling/need ' + r.sink:>20s}" for r in runs))
    for name, peak in ACCELERATORS:
        need = MFU * peak / flops
        ratios = "".join(f" {r.tokens_per_s / need:20.2f}" for r in runs)
        print(f"{name:24s} {need:10.0f} {need * setup.bytes_per_token / 1e9:7.2f}{ratios}")
    print()
    print("stages alone (same documents; the pipeline overlaps them on the host's cores):")
    for name, seconds in times.items():
        print(f"  {name:28s} {seconds:8.2f} s {stage_tokens / seconds:12.0f} tokens/s")
    slowest = min(
        times, key=lambda k: stage_tokens / times[k],
    )
    print(f"  bottleneck stage: {slowest}")
    if scaling:
        print()
        base = scaling[0][1]
        print(f"uploads to the test GCS server with {args.latency * 1000:.0f} ms added per request, "
              f"{args.stream_objects} x {args.stream_object_mb} MB:")  # fmt: skip
        for n, rate in scaling:
            print(f"  streams={n:<3d} {rate:7.3f} GB/s  x{rate / base:.2f}")
    print()
    print("padding (real / computed tokens) with today's buckets, lognormal median "
          f"{LENGTH_MEDIAN} sigma {LENGTH_SIGMA}, batch {args.batch_size}:")  # fmt: skip
    for max_len in (512, 2048):
        fraction, mean = padding_fraction(max_len, args.batch_size, 20000, seed=2)
        packed, _ = padding_fraction(max_len, args.batch_size, 20000, seed=2, packing=True)
        print(f"  max_seq_len={max_len:<5d} real fraction {fraction:.3f} bucketed, {packed:.3f} packed "
              f"(job.packing)  (mean real tokens/doc {mean:.0f})")  # fmt: skip


if __name__ == "__main__":
    main()

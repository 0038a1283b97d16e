"""The training loader's throughput, beside a plain-numpy reference of its buffer algorithm and the shard writer's
ceiling on the same shape.

Writes shards of the Qwen2.5-7B shape (layers 15-18 x d=3584, bf16, ~9,000 tokens and ~256 MB a shard, with the
statistics and tensors the real writer stores) to tmpfs (/dev/shm), local disk and the test GCS server (tests/fakegcs
in its own process), then reads one layer back with `ActivationLoader` and prints, side by side:

- the loader against `numpy_reference`, the same buffer algorithm in plain numpy on one thread (each shard's layer
  mapped with np.memmap, rows gathered with np.take into the batch and scattered with fancy assignment), from
  tmpfs with the shuffle on, in steady state: GB/s and GB delivered per CPU-second of each, and their ratio, over
  alternating windows in this one process. The reference is first checked to emit exactly the loader's batches
  (the bench stops otherwise);
- tokens/s and GB/s of activations delivered (bf16 payload, one layer), shuffle on (a 2^15-token buffer by default,
  smaller than the data so that most steps are steady-state swaps) and off, from each place, and GB delivered per
  CPU-second of the process (what one free core delivers, whatever else the machine runs);
- how throughput scales with read-ahead (tmpfs, shuffle on; local shards are mapped, so reader threads do not
  apply there), and with reader threads x read-ahead from the test GCS server (one epoch each);
- the writer's ceiling on the same shape: `ShardWriter` fed ready batches of FineWeb-like lengths and storing to a
  null store (bench/host_bench.py's "writer encode" stage), in tokens/s and GB/s of all four layers, and per layer;
- the load average while measuring (the machine may be shared), and what an H100 training a 64k-latent SAE needs.

Local disk is read through the page cache: the shards were just written, so the figures are the loader's cost over
cached files, not the device's speed (dropping the cache would disturb other users of the machine).

    .venv/bin/python bench/read_bench.py                    # 6 shards (1.5 GB) per place
    .venv/bin/python bench/read_bench.py --reference-only   # the loader against the numpy reference alone
    .venv/bin/python bench/read_bench.py --shards 2 --skip-gcs --skip-writer
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

# OpenBLAS's idle threads spin for a while after each matrix product (the shard statistics are matrix products);
# their CPU time would be counted against whichever figure is measured next.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator

import ml_dtypes
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from activations.format import LayerStats, encode_safetensors, layer_key, shard_name  # noqa: E402
from activations.loader import ActivationLoader  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
HIDDEN = 3584
LAYERS = (15, 16, 17, 18)
#: H100 dense bf16 at a realistic fraction of its 989 TFLOP/s peak, as the issue states it.
H100_FLOPS = 400e12
READAHEADS = (0, 1, 2, 4)
THREADS = (1, 2, 4, 8)


def make_shards(directory: pathlib.Path, shards: int, tokens: int, seed: int) -> list[pathlib.Path]:
    """`shards` files of `tokens` tokens in the writer's layout (documents of ~1,000 tokens)."""
    rng = np.random.default_rng(seed)
    block = rng.standard_normal((tokens, HIDDEN), dtype=np.float32).astype(BF16)
    lengths = np.full(tokens // 1000, 1000)
    lengths[-1] += tokens - lengths.sum()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(shards):
        layers = {layer: np.roll(block, k * 7 + layer, axis=0) for layer in LAYERS}
        tensors = {}
        for layer in LAYERS:
            tensors.update(LayerStats.of(layers[layer]).tensors(layer))
        tensors.update({layer_key(layer): layers[layer] for layer in LAYERS})
        tensors["token_ids"] = rng.integers(0, 150000, tokens).astype(np.int32)
        tensors["sample_ids"] = np.arange(len(lengths), dtype=np.int64) + k * len(lengths)
        tensors["offsets"] = offsets
        metadata = {"format": "activations/v1", "layers": json.dumps(list(LAYERS)), "hidden_size": str(HIDDEN),
                    "num_hidden_layers": "28"}  # fmt: skip
        path = directory / shard_name(k * len(lengths), (k + 1) * len(lengths))
        path.write_bytes(encode_safetensors(tensors, metadata))
        paths.append(path)
    return paths


def measure(source: str | list[str], epochs: int, **options) -> tuple[float, float, float]:
    """(tokens/s, GB/s, GB per CPU-second of this process) of one layer delivered as numpy bf16 batches; the loader's
    start-up is included. CPU time counts every thread of this process (not the test GCS server's), so the last
    figure is what one fully available core delivers, whatever else the machine runs."""
    started, cpu_started = time.perf_counter(), time.process_time()
    tokens = 0
    with ActivationLoader(source, layers=16, batch_size=4096, epochs=epochs, dtype="bfloat16", **options) as loader:
        for batch in loader:
            tokens += batch.shape[0]
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    payload = tokens * HIDDEN * BF16.itemsize / 1e9
    return tokens / seconds, payload / seconds, payload / max(cpu, 1e-9)


def numpy_reference(
    paths: list[str], layer: int, batch_size: int, capacity: int, seed: int, epochs: int | None
) -> Iterator[np.ndarray]:
    """The loader's shuffle (docs/TRAINING.md, "Mixing") written plainly in numpy on one thread: batches of one layer
    of local shards as raw 16-bit words, the same rows in the same order as `ActivationLoader(paths, layers=layer,
    batch_size=..., shuffle_tokens=capacity, seed=..., epochs=..., dtype="bfloat16")` gives for rank 0 of 1 without
    filters. Each shard's layer is mapped (np.memmap: its rows are copied once, from the page cache); the buffer
    fills from the stream, then each step draws as many distinct slots as it takes rows from the current shard,
    gathers what they hold into the batch (np.take into place) and scatters the new rows there (fancy assignment);
    at the end of an epoch the buffer leaves in one random permutation."""
    where = []  # per shard: (byte offset of the layer's rows, rows, width), from the safetensors header
    for path in paths:
        with open(path, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            entry = json.loads(handle.read(size))[layer_key(layer)]
        where.append((8 + size + entry["data_offsets"][0], *entry["shape"]))
    width = where[0][2]
    buffer = np.empty((capacity, width), np.uint16)
    for epoch in itertools.count() if epochs is None else range(epochs):
        order = np.random.default_rng([seed, epoch, 0]).permutation(len(paths))
        rng = np.random.default_rng([seed, epoch, 0, 1])  # (seed, epoch, rank, 1), as the loader seeds its buffer
        filled, batch, at = 0, np.empty((batch_size, width), np.uint16), 0
        for k in order:
            offset, n, _ = where[k]
            rows = np.memmap(paths[k], dtype=np.uint16, mode="r", offset=offset, shape=(n, width)) if n else []
            j = 0
            while j < n:
                if filled < capacity:
                    m = min(capacity - filled, n - j)
                    buffer[filled : filled + m] = rows[j : j + m]
                    filled += m
                else:
                    m = min(batch_size - at, n - j)
                    slots = rng.choice(capacity, m, replace=False)
                    np.take(buffer, slots, axis=0, out=batch[at : at + m], mode="clip")  # "raise" buffers `out`
                    buffer[slots] = rows[j : j + m]
                    at += m
                    if at == batch_size:
                        yield batch
                        batch, at = np.empty((batch_size, width), np.uint16), 0
                j += m
        drain, gone = rng.permutation(filled), 0
        while gone < filled:  # its first rows complete the batch in progress
            m = min(batch_size - at, filled - gone)
            np.take(buffer, drain[gone : gone + m], axis=0, out=batch[at : at + m], mode="clip")
            at, gone = at + m, gone + m
            if at == batch_size or gone == filled:
                yield batch[:at]
                batch, at = np.empty((batch_size, width), np.uint16), 0


def side_by_side(paths: list[str], capacity: int, epochs: int, repeats: int) -> tuple[list[tuple[float, ...]], int]:
    """The loader and `numpy_reference` in this one process, in steady state: both run without end, and windows of
    `epochs` epochs (fill, steady swaps and drain in their real proportions) are timed from each in turn, the order
    alternating. First, two epochs of both in lockstep, compared batch by batch: the reference must emit exactly the
    loader's rows (the bench stops otherwise). That also touches each one's buffer once: a fresh 235 MB array's
    first touch costs the kernel about 0.5 s here (zeroing its pages), which a training run pays once.

    Returns ((loader GB/s, loader GB per CPU-s, reference GB/s, reference GB per CPU-s) per repeat, batches
    compared). CPU time is the process's, every thread of it: the loader's fetching threads count."""
    loader = ActivationLoader(paths, layers=16, batch_size=4096, shuffle_tokens=capacity, seed=0, epochs=None,
                              dtype="bfloat16")  # fmt: skip
    reference = numpy_reference(paths, 16, 4096, capacity, seed=0, epochs=None)
    tokens = sum(int(np.prod(header_shape(path, 16)[:1])) for path in paths)
    per_epoch = -(-tokens // 4096)  # the last batch of an epoch is short
    compared = 2 * per_epoch
    for k in range(compared):
        if not np.array_equal(next(loader).view(np.uint16), next(reference)):
            raise SystemExit(f"numpy_reference differs from the loader at batch {k}: fix the reference first")

    def window(batches: Iterator[np.ndarray]) -> tuple[float, float]:
        started, cpu_started = time.perf_counter(), time.process_time()
        rows = sum(next(batches).shape[0] for _ in range(epochs * per_epoch))
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        payload = rows * HIDDEN * BF16.itemsize / 1e9
        return payload / seconds, payload / max(cpu, 1e-9)

    results = []
    with loader:
        for repeat in range(repeats):
            if repeat % 2 == 0:
                ours, theirs = window(loader), window(reference)
            else:
                theirs, ours = window(reference), window(loader)
            results.append((*ours, *theirs))
    return results, compared


def header_shape(path: str, layer: int) -> list[int]:
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        return json.loads(handle.read(size))[layer_key(layer)]["shape"]


def print_side_by_side(results: list[tuple[float, ...]], compared: int, capacity: int, epochs: int) -> None:
    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    ratios = [ours_cpu / theirs_cpu for _, ours_cpu, _, theirs_cpu in results]
    print(f"loader against numpy_reference: tmpfs, shuffle on, {capacity}-token buffer, steady state, windows of "
          f"{epochs} epochs alternating; the reference emitted the loader's first {compared} batches "
          "exactly")  # fmt: skip
    print(f"{'window':>6s} {'loader GB/s':>12s} {'GB per CPU-s':>13s} {'numpy GB/s':>11s} {'GB per CPU-s':>13s} "
          f"{'ratio per CPU-s':>16s}")  # fmt: skip
    for repeat, (ours, ours_cpu, theirs, theirs_cpu) in enumerate(results):
        print(f"{repeat:6d} {ours:12.2f} {ours_cpu:13.2f} {theirs:11.2f} {theirs_cpu:13.2f} "
              f"{ours_cpu / theirs_cpu:15.2f}x")  # fmt: skip
    print(f"median: loader {median([r[0] for r in results]):.2f} GB/s, {median([r[1] for r in results]):.2f} GB per "
          f"CPU-s; numpy {median([r[2] for r in results]):.2f} GB/s, {median([r[3] for r in results]):.2f} GB per "
          f"CPU-s; ratio per CPU-s {median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip


def writer_ceiling(docs: int) -> tuple[float, float]:
    """(tokens/s, GB/s of 4 layers) of ShardWriter alone on ready batches, to a null store."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from bench.host_bench import NullStore, document_lengths
    from extract.batching import TokenizedSample, make_batches
    from extract.writer import ProgressLog, ShardWriter

    lengths = np.minimum(document_lengths(docs, seed=2), 2048)
    samples = [TokenizedSample(i, i, np.zeros(int(n), np.int32)) for i, n in enumerate(lengths)]
    batches = []
    for lo in range(0, docs, 128):
        batches += make_batches(samples[lo : lo + 128], batch_size=16, buckets=(256, 512, 1024, 2048), pad_id=0)
    outputs = {}
    for batch in batches:  # the same device array per bucket, as host_bench's stand-in engine returns
        seq = batch.token_ids.shape[1]
        if seq not in outputs:
            outputs[seq] = jax.device_put(np.random.default_rng(seq).standard_normal((16, seq, HIDDEN), np.float32).astype(BF16))
    writer = ShardWriter(store=NullStore(), layers=LAYERS, out_dtype=BF16, start=0, end=docs, shard_size=8,
                         metadata={"hidden_size": str(HIDDEN)}, progress=ProgressLog(None))  # fmt: skip
    started = time.perf_counter()
    for batch in batches:
        writer.submit(batch, {layer: outputs[batch.token_ids.shape[1]] for layer in LAYERS})
    records = writer.finish()
    seconds = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in records)
    return tokens / seconds, tokens * len(LAYERS) * HIDDEN * BF16.itemsize / seconds / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=6, help="shards per place")
    parser.add_argument("--shuffle-tokens", type=int, default=1 << 15,
                        help="shuffle buffer (smaller than the data, so that most steps are steady-state swaps)")
    parser.add_argument("--tokens", type=int, default=9000, help="tokens per shard (9,000 x 4 layers = 258 MB)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the shards per measurement")
    parser.add_argument("--disk-dir", default=None, help="local-disk directory (default: a temporary one)")
    parser.add_argument("--skip-gcs", action="store_true")
    parser.add_argument("--skip-writer", action="store_true")
    parser.add_argument("--writer-docs", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=10, help="timed windows of the loader and of numpy_reference")
    parser.add_argument("--reference-epochs", type=int, default=2, help="epochs per timed window")
    parser.add_argument("--reference-only", action="store_true", help="only the loader against numpy_reference")
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    shuffle_on = {"shuffle_tokens": args.shuffle_tokens}
    shuffle_off = {"shuffle": False}

    rows: list[tuple[str, str, float, float, float]] = []
    local_scaling: list[tuple[int, float, float, float]] = []
    scaling: list[tuple[int, int, float, float, float]] = []
    shm = pathlib.Path(tempfile.mkdtemp(prefix="read-bench-", dir="/dev/shm"))
    disk = pathlib.Path(args.disk_dir or tempfile.mkdtemp(prefix="read-bench-disk-"))
    try:
        shm_paths = [str(p) for p in make_shards(shm, args.shards, args.tokens, seed=0)]
        shard_mb = os.path.getsize(shm_paths[0]) / 1e6
        load_before = os.getloadavg()[0]
        versus, compared = side_by_side(shm_paths, args.shuffle_tokens, args.reference_epochs, args.repeats)
        if args.reference_only:
            print(f"shape: layer 16 of {args.shards} shards of {args.tokens} tokens x d={HIDDEN} bf16 on tmpfs, batch "
                  f"4096; cores={cores}; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
            print_side_by_side(versus, compared, args.shuffle_tokens, args.reference_epochs)
            return
        disk_paths = [str(p) for p in make_shards(disk, args.shards, args.tokens, seed=0)]
        for place, paths in (("tmpfs", shm_paths), ("local disk", disk_paths)):
            rows.append((place, "on", *measure(paths, args.epochs, **shuffle_on)))
            rows.append((place, "off", *measure(paths, args.epochs, **shuffle_off)))
        for readahead in READAHEADS:
            local_scaling.append((readahead, *measure(shm_paths, args.epochs, readahead=readahead, **shuffle_on)))
        if not args.skip_gcs:
            from bench.host_bench import fake_gcs_server

            with fake_gcs_server() as url:
                os.environ["STORAGE_EMULATOR_HOST"] = url
                import objectstore

                store = objectstore.open_store("gs://bench/shards")
                for path in shm_paths:
                    store.put_file(pathlib.Path(path).name, path)
                rows.append(("test GCS server", "on", *measure("gs://bench/shards", args.epochs, **shuffle_on)))
                rows.append(("test GCS server", "off", *measure("gs://bench/shards", args.epochs, **shuffle_off)))
                for threads in THREADS:
                    for readahead in (0, 2):
                        scaling.append((threads, readahead, *measure("gs://bench/shards", 1, threads=threads,
                                                                     readahead=readahead, **shuffle_on)))  # fmt: skip
        writer = None if args.skip_writer else writer_ceiling(args.writer_docs)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if not args.disk_dir:
            shutil.rmtree(disk, ignore_errors=True)
    load_after = os.getloadavg()[0]

    print(f"shape: Qwen2.5-7B layers {LAYERS[0]}-{LAYERS[-1]} x d={HIDDEN} bf16; {args.shards} shards of {args.tokens} "
          f"tokens ({shard_mb:.0f} MB) per place; the loader reads layer 16 ({HIDDEN * 2} B/token), batch 4096, "
          f"{args.epochs} epochs per figure; cores={cores}; load average {load_before:.1f} before, {load_after:.1f} "
          "after")  # fmt: skip
    print()
    print_side_by_side(versus, compared, args.shuffle_tokens, args.reference_epochs)
    print()
    print(f"{'source':16s} {'shuffle':>7s} {'tokens/s':>10s} {'GB/s':>6s} {'GB per CPU-s':>13s}")
    for place, shuffle, tokens_s, gb_s, gb_cpu in rows:
        print(f"{place:16s} {shuffle:>7s} {tokens_s:10.0f} {gb_s:6.2f} {gb_cpu:13.2f}")
    print()
    print(f"tmpfs, shuffle on ({args.shuffle_tokens}-token buffer): GB/s (GB per CPU-s) by read-ahead shards")
    print("".join(f" {'readahead=' + str(r):>14s}" for r, *_ in local_scaling))
    print("".join(f" {gb:6.2f} ({cpu:5.2f})" for _, _, gb, cpu in local_scaling))
    if scaling:
        print()
        print("test GCS server, shuffle on, one epoch: GB/s by reader threads x read-ahead shards")
        print(f"{'threads':>8s}" + "".join(f" {'readahead=' + str(r):>12s}" for r in (0, 2)))
        for threads in THREADS:
            cells = [gb for t, r, _, gb, _ in scaling if t == threads]
            print(f"{threads:8d}" + "".join(f" {gb:12.2f}" for gb in cells))
    if writer:
        print()
        print(f"writer ceiling (ShardWriter to a null store, same shape, 4 layers): {writer[0]:.0f} tokens/s, "
              f"{writer[1]:.2f} GB/s ({writer[1] / len(LAYERS):.2f} GB/s per layer)")
    need_tokens = H100_FLOPS / (6 * HIDDEN * 65536)
    need_gb = need_tokens * HIDDEN * BF16.itemsize / 1e9
    _, _, _, wall, per_cpu = rows[0]  # tmpfs, shuffle on
    print()
    print(f"H100, 64k-latent SAE on d={HIDDEN}: 6 x batch x {HIDDEN} x 65536 FLOPs/step at {H100_FLOPS / 1e12:.0f} "
          f"TFLOP/s -> {need_tokens:,.0f} tokens/s = {need_gb:.2f} GB/s bf16. tmpfs shuffled: {wall:.2f} GB/s here, "
          f"{per_cpu:.2f} GB per CPU-second -> {need_gb / per_cpu:.1f} cores to feed it")


if __name__ == "__main__":
    main()

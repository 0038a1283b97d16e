"""The training loader's throughput, beside a plain-numpy reference of its buffer algorithm and the shard writer's
ceiling on the same shape.

Writes shards of the Qwen2.5-7B shape (layers 15-18 x d=3584, bf16, ~9,000 tokens and ~256 MB a shard, with the
statistics and tensors the real writer stores) to tmpfs (/dev/shm), local disk and the test GCS server (tests/fakegcs
in its own process), then reads one layer back with `ActivationLoader` and prints, side by side:

- three figures side by side, from tmpfs with the shuffle on, in steady state, over windows taken in rotating
  order in this one process: the loader; `numpy_reference`, the same buffer algorithm written in plain numpy on one
  thread as fast as numpy allows (rows left in their mapped shards and gathered with one np.take per shard straight
  into the batch, as the loader does); and one core's memcpy (np.copyto of 256 MiB). For each: GB/s and GB
  delivered per CPU-second; and the ratios loader / numpy and loader / memcpy per CPU-second, with their spread.
  The reference is first checked to emit exactly the loader's batches (the bench stops otherwise). An epoch is
  many shards long, as a job's is (each tmpfs shard under 8 names); `--copies` adds `numpy_copies`, the buffer of
  copies the loader was before #38 (two copies a row), `--dtype float32` widens the batches as the loader's default
  output does;
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
    .venv/bin/python bench/read_bench.py --reference-only   # the side-by-side alone: loader, numpy, memcpy
    .venv/bin/python bench/read_bench.py --shards 2 --skip-gcs --skip-writer
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
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


def many_names(paths: list[str], names: int) -> list[str]:
    """`names` symbolic links to each shard, in a directory beside them, listed name by name: an epoch of
    len(paths) x names shards, read from the page cache of len(paths) files."""
    directory = pathlib.Path(paths[0]).parent / "names"
    directory.mkdir(exist_ok=True)
    named = []
    for n in range(names):
        for path in paths:
            link = directory / f"{n:03d}-{pathlib.Path(path).name}"
            if not link.exists():
                link.symlink_to(path)
            named.append(str(link))
    return named


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


def shard_rows(path: str, layer: int) -> tuple[int, int, int]:
    """(byte offset of the layer's rows, rows, width) from a shard's safetensors header."""
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        entry = json.loads(handle.read(size))[layer_key(layer)]
    return 8 + size + entry["data_offsets"][0], *entry["shape"]


def numpy_reference(
    paths: list[str], layer: int, batch_size: int, capacity: int, seed: int, epochs: int | None, hold: float,
    widen: bool = False,
) -> Iterator[np.ndarray]:  # fmt: skip
    """The loader's buffer algorithm (docs/TRAINING.md, "Mixing"; activations/loader.py, "Rows stay in their
    shards") written in plain numpy on one thread, as fast as numpy allows: batches of one layer of local shards, the
    rows `ActivationLoader(paths, layers=layer, batch_size=..., shuffle_tokens=capacity, seed=..., epochs=...,
    hold=..., dtype="bfloat16")` gives for rank 0 of 1 without filters, as raw 16-bit words (float32 with `widen`,
    as `dtype="float32"` gives them: gathered a cache-sized chunk at a time and widened from there, by numpy's cast,
    so that the stored bits never go through memory).

    Each shard's layer is mapped (its pages faulted in 64 KiB at a time by a touch) and stays where it is: a slot
    holds (shard, row), so a row is copied once, by one `np.take` per shard straight into the batch, its rows
    moving as opaque records (one memcpy each). The buffer fills from the stream; each step draws as many distinct
    slots as it takes rows from the current shard, notes the rows they held and points them at the new rows; a
    batch's noted rows are gathered grouped by shard (the epoch's order), in draw order within one. A shard whose
    last row entered `hold` x C emitted rows ago has its rows still in the buffer copied into the spill (a buffer
    of copies, slot for slot) and is unmapped. At an epoch's end the buffer leaves in one random permutation (and
    the shards still held go with it).
    Batches alternate between two arrays (the consumer drops each before asking for the next but one)."""
    where = [shard_rows(path, layer) for path in paths]
    width = where[0][2]
    record = np.dtype((np.void, width * 2))
    spill_rows = np.zeros((capacity, width), np.uint16).view(record)[:, 0]
    group = np.zeros(capacity, np.int32)
    held_row = np.zeros(capacity, np.int64)
    spilled = np.zeros(capacity, bool)
    out_group = np.zeros(batch_size, np.int32)
    out_source = np.zeros(batch_size, np.int32)
    out_row = np.zeros(batch_size, np.int64)
    batches = [np.zeros((batch_size, width), np.uint16) for _ in range(2)]
    wides = [np.zeros((batch_size, width), np.float32) for _ in range(2)] if widen else None
    chunk = np.zeros(max(1, (256 << 10) // (width * 2)), record)
    made = 0

    def mapped(path: str, offset: int, n: int) -> np.ndarray:
        with open(path, "rb") as handle:
            aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
            pages = np.frombuffer(mmap.mmap(handle.fileno(), offset + n * width * 2 - aligned, prot=mmap.PROT_READ,
                                            offset=aligned), np.uint8)  # fmt: skip
        pages[:: 64 << 10].max()
        return pages[offset - aligned :].view(record)

    def note(slots: np.ndarray, at: int) -> None:
        out_group[at : at + len(slots)] = group[slots]
        out_source[at : at + len(slots)] = np.where(spilled[slots], -1, group[slots])
        out_row[at : at + len(slots)] = np.where(spilled[slots], slots, held_row[slots])

    def gather(count: int, held: dict[int, np.ndarray]) -> np.ndarray:
        nonlocal made
        made += 1
        batch = batches[made % 2] if wides is None else wides[made % 2]
        rows = batch.view(record)[:, 0] if wides is None else None
        keys = out_group[:count] - out_group[:count].min()  # radix-sorted as 16-bit keys (shards of one batch)
        order = np.argsort(keys.astype(np.uint16) if keys.max() < 1 << 16 else keys, kind="stable")
        sources, picked = out_source[:count][order], out_row[:count][order]
        cuts = [0, *(np.flatnonzero(sources[1:] != sources[:-1]) + 1).tolist(), count]
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            source = spill_rows if sources[lo] < 0 else held[int(sources[lo])]
            if rows is not None:
                np.take(source, picked[lo:hi], out=rows[lo:hi], mode="clip")  # "raise" buffers `out`
                continue
            for at in range(lo, hi, len(chunk)):  # widened a cache-sized chunk at a time
                m = min(len(chunk), hi - at)
                np.take(source, picked[at : at + m], out=chunk[:m], mode="clip")
                np.copyto(batch[at : at + m], chunk[:m].view(np.uint16).reshape(m, width).view(BF16), casting="unsafe")
        return batch[:count]

    def let_go(held: dict[int, np.ndarray], ended: dict[int, int], rows_out: int, filled: int) -> None:
        for place in [place for place, end in ended.items() if rows_out - end >= hold * capacity]:
            rows = held.pop(place)
            del ended[place]
            slots = np.flatnonzero((group[:filled] == place) & ~spilled[:filled])
            spill_rows[slots] = rows[held_row[slots]]
            spilled[slots] = True

    for epoch in itertools.count() if epochs is None else range(epochs):
        order = np.random.default_rng([seed, epoch, 0]).permutation(len(paths))
        rng = np.random.default_rng([seed, epoch, 0, 1])  # (seed, epoch, rank, 1), as the loader seeds its buffer
        held: dict[int, np.ndarray] = {}
        ended: dict[int, int] = {}
        filled = at = rows_out = 0
        for place, k in enumerate(order):
            offset, n, _ = where[k]
            if not n:
                continue
            held[place] = mapped(paths[k], offset, n)
            j = 0
            while j < n:
                if filled < capacity:
                    m = min(capacity - filled, n - j)
                    slots = np.arange(filled, filled + m)
                    filled += m
                else:
                    m = min(batch_size - at, n - j)
                    slots = rng.choice(capacity, m, replace=False)
                    note(slots, at)
                    at += m
                group[slots], held_row[slots], spilled[slots] = place, np.arange(j, j + m), False
                j += m
                if at == batch_size:
                    yield gather(at, held)
                    rows_out, at = rows_out + batch_size, 0
                    let_go(held, ended, rows_out, filled)
            ended[place] = rows_out
        drain, gone = rng.permutation(filled), 0
        while gone < filled:  # its first rows complete the batch in progress
            m = min(batch_size - at, filled - gone)
            note(drain[gone : gone + m], at)
            at, gone = at + m, gone + m
            if at == batch_size or gone == filled:  # no shard is let go while the buffer drains
                yield gather(at, held)
                at = 0


def numpy_copies(paths: list[str], layer: int, batch_size: int, capacity: int, seed: int) -> Iterator[np.ndarray]:
    """The same buffer holding copies of its rows (the loader's design before #38), plainly in numpy without end:
    the same rows in each batch as `numpy_reference`, in draw order. A row is copied twice: from its mapped shard
    into its slot, then from its slot into the batch (np.take into place, then fancy assignment)."""
    where = [shard_rows(path, layer) for path in paths]
    width = where[0][2]
    record = np.dtype((np.void, width * 2))
    buffer = np.zeros((capacity, width), np.uint16).view(record)[:, 0]
    batches = [np.zeros((batch_size, width), np.uint16) for _ in range(2)]
    made = 0
    for epoch in itertools.count():
        order = np.random.default_rng([seed, epoch, 0]).permutation(len(paths))
        rng = np.random.default_rng([seed, epoch, 0, 1])
        filled, at, batch = 0, 0, batches[made % 2].view(record)[:, 0]
        for k in order:
            offset, n, _ = where[k]
            rows = np.memmap(paths[k], dtype=record, mode="r", offset=offset, shape=(n,)) if n else []
            j = 0
            while j < n:
                if filled < capacity:
                    m = min(capacity - filled, n - j)
                    buffer[filled : filled + m] = rows[j : j + m]
                    filled += m
                else:
                    m = min(batch_size - at, n - j)
                    slots = rng.choice(capacity, m, replace=False)
                    np.take(buffer, slots, out=batch[at : at + m], mode="clip")
                    buffer[slots] = rows[j : j + m]
                    at += m
                    if at == batch_size:
                        yield batches[made % 2]
                        made, at = made + 1, 0
                        batch = batches[made % 2].view(record)[:, 0]
                j += m
        drain, gone = rng.permutation(filled), 0
        while gone < filled:
            m = min(batch_size - at, filled - gone)
            np.take(buffer, drain[gone : gone + m], out=batch[at : at + m], mode="clip")
            at, gone = at + m, gone + m
            if at == batch_size or gone == filled:
                yield batches[made % 2][:at]
                made, at = made + 1, 0
                batch = batches[made % 2].view(record)[:, 0]


def memcpy_windows(payload: float, size: int) -> Iterator[float]:
    """Windows of about `payload` GB copied by np.copyto (one memcpy call each) between two arrays of `size` bytes;
    yields the GB copied. At 256 MiB (the default) a copy is larger than the shuffle buffer and than any cache, so
    it is the rate of one core copying memory; glibc copies a block that large with non-temporal stores (above
    `x86_non_temporal_threshold`, 190 MB on this machine), which no copy of a 7 KiB row gets. `--memcpy-mib 64`
    measures a copy glibc makes with ordinary stores, as a row's is."""
    source, target = np.ones(size, np.uint8), np.ones(size, np.uint8)
    copies = max(1, round(payload * 1e9 / size))
    while True:
        for _ in range(copies):
            np.copyto(target, source)
        yield copies * size / 1e9


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal shapes and bytes, whatever the dtypes (the loader's bfloat16, the reference's raw 16-bit words)."""
    raw = [np.ascontiguousarray(x).view(np.uint8) for x in (a, b)]
    return a.shape == b.shape and np.array_equal(*raw)


def side_by_side(
    paths: list[str], capacity: int, repeats: int, dtype: str, hold: float, copies: bool, memcpy_bytes: int = 256 << 20
) -> tuple[dict[str, list[tuple[float, float]]], list[float], int]:
    """The loader, `numpy_reference` and one core's memcpy (and `numpy_copies` with `copies`) in this one process,
    in steady state, without end: windows of one epoch of the stream (fill, steady swaps and drain in their
    proportions at this length) are timed from each in turn, the order rotating every repeat. First, a little more
    than one epoch of the loader and the reference in lockstep, compared batch by batch: the reference must emit
    exactly the loader's rows (the bench stops otherwise; `numpy_copies` must emit the same rows, in draw order).
    That also touches each one's buffer once: a fresh 235 MB array's first touch costs the kernel about 0.5 s
    (zeroing its pages), which a training run pays once.

    Returns ({name: [(GB/s, GB per CPU-s) per repeat]}, the 1-minute load average before each repeat, batches
    compared). GB are bf16 activations delivered (for memcpy: bytes copied); CPU time is the process's, every
    thread of it: the loader's fetching threads count."""
    widen = dtype == "float32"
    loader = ActivationLoader(paths, layers=16, batch_size=4096, shuffle_tokens=capacity, seed=0, epochs=None,
                              dtype=dtype, hold=hold)  # fmt: skip
    reference = numpy_reference(paths, 16, 4096, capacity, seed=0, epochs=None, hold=hold, widen=widen)
    contenders: dict[str, Iterator[np.ndarray]] = {"loader": loader, "numpy": reference}
    if copies:
        contenders["numpy, copies"] = numpy_copies(paths, 16, 4096, capacity, seed=0)
    tokens = sum(shard_rows(path, 16)[1] for path in paths)
    per_epoch = -(-tokens // 4096)  # the last batch of an epoch is short
    compared = per_epoch + 5
    for k in range(compared):
        ours, theirs = next(loader), next(reference)
        if not same_bits(ours, theirs):
            raise SystemExit(f"numpy_reference differs from the loader at batch {k}: fix the reference first")
        if copies:
            plain = next(contenders["numpy, copies"])
            stored = (theirs.view(np.uint32) >> 16).astype(np.uint16) if widen else theirs
            if sorted(map(bytes, plain)) != sorted(map(bytes, stored)):
                raise SystemExit(f"numpy_copies' batch {k} holds other rows than the reference's")
    copier = memcpy_windows(tokens * HIDDEN * BF16.itemsize / 1e9, memcpy_bytes)
    next(copier)  # its arrays' first touch

    def window(name: str) -> tuple[float, float]:
        started, cpu_started = time.perf_counter(), time.process_time()
        if name == "memcpy":
            payload = next(copier)
        else:
            stream = contenders[name]
            payload = sum(next(stream).shape[0] for _ in range(per_epoch)) * HIDDEN * BF16.itemsize / 1e9
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        return payload / seconds, payload / max(cpu, 1e-9)

    names = [*contenders, "memcpy"]
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    loads = []
    with loader:
        for repeat in range(repeats):
            loads.append(os.getloadavg()[0])
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                results[name].append(window(name))
    return results, loads, compared


def print_side_by_side(results: dict[str, list[tuple[float, float]]], loads: list[float], compared: int,
                       capacity: int, shards: int, dtype: str, hold: float, memcpy_mib: int) -> None:  # fmt: skip
    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    def spread(values: list[float]) -> str:
        return f"{median(values):.2f}x (range {min(values):.2f}-{max(values):.2f})"

    names = list(results)
    per_cpu = {name: [cpu for _, cpu in results[name]] for name in names}
    versus_numpy = [a / b for a, b in zip(per_cpu["loader"], per_cpu["numpy"])]
    versus_memcpy = {name: [a / b for a, b in zip(per_cpu[name], per_cpu["memcpy"])] for name in names[:-1]}
    print(f"loader against numpy_reference and one core's memcpy ({memcpy_mib} MiB copies): tmpfs, shuffle on, "
          f"{capacity}-token buffer, hold "
          f"{hold:g}, {dtype} batches of 4096, windows of one epoch ({shards} shards) in rotating order; the "
          f"reference emitted the loader's first {compared} batches exactly")  # fmt: skip
    header = "".join(f" {name + ' GB/s':>18s} {'per CPU-s':>9s}" for name in names)
    print(f"{'window':>6s} {'load':>5s}{header} {'loader/numpy':>12s} {'loader/memcpy':>13s}")
    for repeat, load in enumerate(loads):
        cells = "".join(f" {results[name][repeat][0]:18.2f} {results[name][repeat][1]:9.2f}" for name in names)
        print(f"{repeat:6d} {load:5.1f}{cells} {versus_numpy[repeat]:11.2f}x {versus_memcpy['loader'][repeat]:12.2f}x")
    figures = "; ".join(f"{name} {median([r[0] for r in results[name]]):.2f} GB/s, {median(per_cpu[name]):.2f} GB "
                        "per CPU-s" for name in names)  # fmt: skip
    print(f"median: {figures}")
    print("per CPU-second: loader / numpy " + spread(versus_numpy) + "; " +
          "; ".join(f"{name} / memcpy {spread(values)}" for name, values in versus_memcpy.items()))  # fmt: skip


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
    parser.add_argument("--repeats", type=int, default=10, help="timed windows of each in the side-by-side")
    parser.add_argument("--names", type=int, default=8,
                        help="names (symbolic links) per tmpfs shard in the side-by-side, so that an epoch is many "
                             "shards long, as a job's is: 6 shards x 8 names = 48 shards, 432,000 rows an epoch")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the batches' dtype in the side-by-side (the stored bits, or widened to float32)")
    parser.add_argument("--hold", type=float, default=3.0, help="the loader's (and the reference's) hold")
    parser.add_argument("--copies", action="store_true",
                        help="also time numpy_copies, the buffer of copies the loader used before (two copies a row)")
    parser.add_argument("--memcpy-mib", type=int, default=256, help="bytes of each memcpy in the side-by-side, MiB")
    parser.add_argument("--reference-only", action="store_true",
                        help="only the side-by-side: the loader, numpy_reference and memcpy")
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
        named = many_names(shm_paths, args.names)
        load_before = os.getloadavg()[0]
        versus, loads, compared = side_by_side(named, args.shuffle_tokens, args.repeats, args.dtype, args.hold,
                                               args.copies, args.memcpy_mib << 20)  # fmt: skip
        if args.reference_only:
            print(f"shape: layer 16 of {len(named)} shards ({args.shards} files x {args.names} names) of {args.tokens} "
                  f"tokens x d={HIDDEN} bf16 on tmpfs, batch 4096; cores={cores}; load average {load_before:.1f} "
                  f"before, {os.getloadavg()[0]:.1f} after")  # fmt: skip
            print_side_by_side(versus, loads, compared, args.shuffle_tokens, len(named), args.dtype, args.hold, args.memcpy_mib)
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
    print_side_by_side(versus, loads, compared, args.shuffle_tokens, len(named), args.dtype, args.hold, args.memcpy_mib)
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

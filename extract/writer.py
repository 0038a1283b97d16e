"""The background writer that turns device batches into activation shards.

Shard format (docs/EXTRACTION.md; defined once, in `activations.format`, which every reader shares): one
safetensors file per run of `shard_size` consecutive slice positions, holding each output in the output dtype
(hidden states as `layer_<L>` [n_tokens, hidden], hook points as `<site>_<l>` [n_tokens, width]), `token_ids` int32
[n_tokens], `sample_ids` int64 [n_samples], `offsets` int64 [n_samples + 1] (sample k's tokens are rows
offsets[k]:offsets[k+1]) and each output's normalisation statistics (`stats.<tensor>.*`, computed here from the
stored rows as the shard is encoded). Padding is never stored. The header is written by
`activations.format` rather than by the safetensors library because numpy has no bfloat16 (ml_dtypes supplies it),
and the library's numpy API refuses it; the bytes are standard safetensors ("BF16").

The writer (`ShardWriter`, whose docstring counts the host copies) runs a collector thread that copies
activations to the host, puts samples back into slice order and encodes complete shards into one buffer each,
an encode pool that does those copies in parallel, and an uploader that stores up to `streams` shards at once
and appends their progress records in shard order. Bounded queues block the producer (backpressure); a failure
in any thread is re-raised in the main thread on its next call.

A sampled job (`token_sample`, `drop_first`: activations.sampling) stores only the positions its sampling keeps,
chosen from (seed, sample id, position) alone, and adds each stored token's position in its document (`positions`);
its records count the tokens processed beside those stored (`counters.processed_tokens`, `.stored_tokens`). Shards
are cut by stored tokens, so a shard of a sampled job holds as many bytes as one of an unsampled job.

Skipped bad rows hold their positions without a sample: a shard still covers its positions but holds
fewer samples (none, if every row was bad: the shard is then written with empty tensors, so that every
record names a shard). Its record counts them in `counters.skipped_rows` and lists them in `skipped`,
at most MAX_LISTED_SKIPPED per task.

Non-finite activations are never stored silently. The engine counts, per output and token, the values that are inf
or NaN in the output dtype (float16 overflows past 65504); a sample with any is a bad row, `non_finite`, whose
detail names the outputs (`layer_12`, `mlp_out_3`): skipped and counted (`counters.non_finite_rows`, also in
`skipped_rows`) under `on_bad_row: skip`, a `BadInput` (exit 65) under `fail`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

# The shard format is defined once, in activations.format; these names stay importable from here.
from activations.format import (  # noqa: F401 (re-exported)
    FORMAT,
    FP8,
    FORMAT_SAMPLED,
    POSITIONS,
    LayerStats,
    Output,
    ShardFormatError,
    crc32c_b64,
    decode_safetensors,
    encode_safetensors,
    layer_key,
    numpy_dtype,
    output_key,
    parse_header,
    quantize_per_token,
    safetensors_layout,
    scale_key,
    shard_name,
    sites_of,
    stats_keys,
)
from activations.sampling import TokenSampling
from extract.batching import Batch, ShardBounds, TokenizedSample
from extract.data import MAX_DETAIL_CHARS
from extract.errors import BadInput

log = logging.getLogger(__name__)

MAX_PROGRESS_LINE = 64 * 1024
#: Skipped rows listed (sample id, file, row, reason) per task, over all its attempts; the rest are only counted.
MAX_LISTED_SKIPPED = 100
#: The progress-record counter that counts a shard's skipped rows (summed into the done marker's metadata).
SKIPPED_ROWS = "skipped_rows"
#: The counters of a sampled job's records: tokens the forward pass ran on, and tokens stored.
PROCESSED_TOKENS, STORED_TOKENS = "processed_tokens", "stored_tokens"
#: The counter of those skipped because their activations are not finite in the output dtype.
NON_FINITE_ROWS = "non_finite_rows"


# -- progress records ---------------------------------------------------------------------------


class ProgressLog:
    """Appends one JSON line per durably stored shard to SPAWN_PROGRESS_FILE (if there is one)."""

    def __init__(self, path: str | os.PathLike[str] | None):
        self.path = path
        self._file = open(path, "a", encoding="utf-8") if path else None

    def append(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"))
        if len(line.encode()) >= MAX_PROGRESS_LINE:
            raise ValueError(f"progress record for {record.get('shard')} is {len(line)} bytes, over the 64 KiB limit")
        if self._file is None:
            return
        self._file.write(line + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


# -- the writer ---------------------------------------------------------------------------------


def default_upload_streams() -> int:
    """Parallel shard uploads: one per host core, at least 2 (an upload mostly waits on the network) and at
    most 16 (each in-flight shard holds up to `shard_bytes` of host memory)."""
    return max(2, min(16, os.cpu_count() or 1))


@dataclasses.dataclass
class _PendingSample:
    """A sample waiting for its shard: its rows stay in its batch's host array until the shard is encoded."""

    sample_id: int
    token_ids: np.ndarray
    host: Mapping[Output, np.ndarray] | None  # output -> [batch, T, width] host copy of the batch; None if empty
    row: int
    column: int = 0  # where the sample starts in its row (packed batches)
    kept: np.ndarray | None = None  # the positions stored (a sampled job); None: every position

    @property
    def processed(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def stored(self) -> int:
        return self.processed if self.kept is None else int(self.kept.shape[0])


@dataclasses.dataclass
class _SkippedRow:
    entry: dict[str, Any]  # Document.skipped_entry()


@dataclasses.dataclass
class _EncodedShard:
    name: str
    sample_start: int
    sample_end: int
    samples: int
    tokens: int
    buffer: np.ndarray  # uint8, the whole safetensors file; read-only once encoded
    final: bool
    base: np.ndarray | None = None  # the pooled allocation `buffer` is a view of
    processed_tokens: int | None = None  # a sampled shard's tokens before sampling
    skipped: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RunTotals:
    """What this attempt processed; becomes `stats` in the final record."""

    samples: int = 0
    tokens: int = 0
    flops: float = 0.0
    skipped_rows: int = 0
    stored_tokens: int | None = None  # a sampled job's; None when every token is stored

    def stats(self, seconds: float, peak_flops: float | None) -> dict[str, Any]:
        seconds = max(seconds, 1e-9)
        mfu = None if not peak_flops else self.flops / seconds / peak_flops
        return {
            "samples": self.samples,
            "tokens": self.tokens,
            **({} if self.stored_tokens is None else {STORED_TOKENS: self.stored_tokens}),
            "skipped_rows": self.skipped_rows,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(self.tokens / seconds, 3),
            "mfu": None if mfu is None else round(mfu, 6),
        }


_END = object()


class WriterFailed(RuntimeError):
    """Raised in the main thread when it tries to use a writer whose background thread died."""


class _BufferPool:
    """Shard buffers are reused rather than allocated per shard: the first write to fresh memory costs a page
    fault per 4 KiB, which made a copy into a new buffer about 4 times slower than into a reused one (measured
    here: 0.45 against 1.8 GB/s). At most `keep` idle buffers are kept, so memory stays bounded."""

    def __init__(self, keep: int):
        self._keep = keep
        self._idle: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 buffer of at least `nbytes` (its base may be larger)."""
        with self._lock:
            fitting = [i for i, b in enumerate(self._idle) if b.nbytes >= nbytes]
            if fitting:
                return self._idle.pop(min(fitting, key=lambda i: self._idle[i].nbytes))
        # A little headroom, so that the next, slightly larger shard reuses this buffer too.
        return np.empty(nbytes + nbytes // 8, dtype=np.uint8)

    def give(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._idle.append(buffer)
            if len(self._idle) > self._keep:
                self._idle.pop(min(range(len(self._idle)), key=lambda i: self._idle[i].nbytes))


def _stored_rows(sample: _PendingSample, layer: int) -> np.ndarray:
    """The sample's stored rows of one layer in its batch's host array: a view of its span, or (a sampled job)
    the kept positions gathered from it."""
    assert sample.host is not None
    span = sample.host[layer][sample.row, sample.column : sample.column + sample.processed]
    if sample.kept is None:
        return span
    if span.dtype.itemsize in (2, 4):  # gathered as raw integers: ml_dtypes' per-element path is far slower
        raw = np.uint16 if span.dtype.itemsize == 2 else np.uint32
        return np.take(span.view(raw), sample.kept, axis=0).view(span.dtype)
    return span[sample.kept]


def _copy_rows(target: np.ndarray, source: np.ndarray) -> None:
    """One copy; same-width dtypes are copied as raw integers so that numpy releases the GIL (bit-identical)."""
    if target.dtype == source.dtype and target.dtype.itemsize in (2, 4):
        raw = np.uint16 if target.dtype.itemsize == 2 else np.uint32
        np.copyto(target.view(raw), source.view(raw))
    else:
        np.copyto(target, source, casting="unsafe")  # what np.array(source, dtype=target.dtype) computes


class ShardWriter:
    """Collects batches for positions [start, end) of a task's slice and writes them as shards.

    Shards end at every multiple of `shard_size` positions and, with `shard_tokens`, before a sample that would
    take a shard past that many tokens (`extract.batching.ShardBounds`). Batches may hold positions before
    `start` (a run resumed inside a batching window recomputes the window); those samples are dropped.

    Host copies per output byte, from device memory to the bytes handed to the store: two.
      1. `jax.device_get` of a batch's output, [batch, T, hidden] per layer, into host memory (on the CPU
         backend this aliases the device buffer and copies nothing).
      2. `_copy_rows`: each sample's rows, from that host array straight to their final offset in one
         preallocated uint8 buffer that is the whole safetensors file (header included). Padding is never
         copied. The layers are copied in parallel on the encode pool.
    The store is handed a read-only view of that buffer (LocalStore writes it with one `write`; GCSStore streams
    it), and its CRC32C is computed over the same buffer by google-crc32c's C code: a read, not a copy.

    Threads: the collector (device_get, slice order, encoding), an encode pool of `streams` threads, and the
    uploader, which runs up to `streams` uploads at once and appends their progress records strictly in shard
    order, so the records always tile a prefix of the slice. Host memory is bounded: the open shard's batches,
    `depth` queued batches and encoded shards, and `streams` shards being uploaded, each shard at most about
    `shard_tokens` tokens (one longer document alone excepted).
    """

    def __init__(
        self,
        *,
        store: Any,
        layers: Sequence[Output],
        out_dtype: np.dtype,
        start: int,
        end: int,
        shard_size: int,
        metadata: Mapping[str, str],
        progress: ProgressLog,
        flops_per_token: Callable[[int], float] | None = None,
        peak_flops: float | None = None,
        on_samples: Callable[[int, int], None] | None = None,
        depth: int = 2,
        shard_tokens: int | None = None,
        streams: int | None = None,
        listed_skipped: int = 0,
        sampling: TokenSampling | None = None,
        widths: Mapping[Output, int] | None = None,
        on_bad_row: str = "skip",
    ):
        """`layers`: the outputs to store, hidden-state indices (int) and hook points (`HookPoint`), each
        `widths[output]` wide (default: the metadata's hidden_size). `listed_skipped`: skipped rows the task's
        earlier attempts already listed (their records' `skipped`). `sampling`: the job's storage sampling (every
        position is stored without one, or with an inactive one). `on_bad_row`: what a sample with non-finite
        activations does, "skip" or "fail" (as the job's)."""
        if not 0 <= start < end:
            raise ValueError(f"writer range [{start}, {end}) is empty")
        self._store = store
        self._layers = tuple(layers)
        self._widths = dict(widths or {})
        self._on_bad_row = on_bad_row
        self._out_dtype = np.dtype(out_dtype)
        self._end = end
        self._metadata = dict(metadata)
        if sites_of(self._layers):
            self._metadata.setdefault("sites", json.dumps(sites_of(self._layers)))
        self._progress = progress
        self._flops_per_token = flops_per_token
        self._peak_flops = peak_flops
        self._on_samples = on_samples
        self._streams = max(1, streams or default_upload_streams())
        self._sampling = sampling if sampling is not None and sampling.active else None
        self.totals = RunTotals(stored_tokens=None if self._sampling is None else 0)
        self.records: list[dict[str, Any]] = []
        self.started = time.monotonic()

        self._start = start  # batches may hold earlier positions (their window began before): those are dropped
        self._next = start  # next position to append to the open shard
        self._bounds = ShardBounds(start, shard_size, shard_tokens)
        self._shard_start = start
        self._shard_samples: list[_PendingSample] = []
        self._shard_skipped: list[dict[str, Any]] = []
        self._pending: dict[int, _PendingSample | _SkippedRow] = {}
        self._listed_skipped = listed_skipped

        self._batches: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._uploads: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._abort = threading.Event()
        self._failed = threading.Event()
        self._error: BaseException | None = None
        self._buffers = _BufferPool(keep=self._streams + 2 * max(1, depth) + 1)
        self._encode_pool = ThreadPoolExecutor(max_workers=self._streams, thread_name_prefix="encode")
        self._upload_pool = ThreadPoolExecutor(max_workers=self._streams, thread_name_prefix="upload")
        self._collector = threading.Thread(target=self._guard, args=(self._collect,), name="collector", daemon=True)
        self._uploader = threading.Thread(target=self._guard, args=(self._upload,), name="uploader", daemon=True)
        self._collector.start()
        self._uploader.start()

    # -- main-thread API ----------------------------------------------------------------------

    def submit(self, batch: Batch, hidden: Mapping[int, Any]) -> None:
        """Queue one dispatched batch; blocks while the queue is full; raises a background failure."""
        self._put(self._batches, (batch, hidden))

    def finish(self) -> list[dict[str, Any]]:
        """Wait until every queued batch is stored and recorded; return this attempt's records."""
        self._put(self._batches, _END)
        self._join()
        if self._next != self._end:
            raise WriterFailed(f"writer stopped at position {self._next}, before the slice's end {self._end}")
        return self.records

    def abort(self) -> list[dict[str, Any]]:
        """Stop now: drop queued batches and the open shard, finish storing shards already complete."""
        self._abort.set()
        with contextlib.suppress(queue.Full):  # a full queue is fine: the collector checks the flag
            self._batches.put_nowait(_END)
        self._join()
        return self.records

    # -- plumbing -----------------------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._failed.is_set():
            assert self._error is not None
            raise self._error

    def _put(self, target: queue.Queue, item: Any) -> None:
        while True:
            self._raise_if_failed()
            try:
                target.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _get(self, source: queue.Queue) -> Any:
        while True:
            if self._failed.is_set():
                return _END
            try:
                return source.get(timeout=0.1)
            except queue.Empty:
                continue

    def _join(self) -> None:
        for thread in (self._collector, self._uploader):
            while thread.is_alive():
                thread.join(timeout=0.1)
        self._encode_pool.shutdown(wait=True)
        self._upload_pool.shutdown(wait=True)
        self._raise_if_failed()

    def _guard(self, body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as exc:  # re-raised in the main thread by _raise_if_failed
            if self._error is None:
                self._error = exc
            self._failed.set()
            log.error("event=writer_failed thread=%s error=%r", threading.current_thread().name, exc)

    # -- collector thread ---------------------------------------------------------------------

    def _collect(self) -> None:
        import jax

        try:
            while True:
                item = self._get(self._batches)
                if item is _END or self._abort.is_set():
                    return
                batch, hidden = item
                # Copy 1: device -> host, the whole [batch, T, width] of each output (and the non-finite counts).
                host = jax.device_get({layer: hidden[layer] for layer in self._layers}) if batch.samples else {}
                counts = getattr(hidden, "nonfinite", None)
                self._accept(batch, host, None if counts is None or not batch.samples else np.asarray(counts))
                self._emit_complete_shards()
        finally:
            # The uploader drains what is queued (complete shards only), then stops.
            while not self._failed.is_set():
                try:
                    self._uploads.put(_END, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def _accept(self, batch: Batch, host: Mapping[Output, Any], nonfinite: np.ndarray | None = None) -> None:
        arrays = {layer: np.asarray(host[layer]) for layer in host}
        placements = batch.placements or [(row, 0) for row in range(len(batch.samples))]
        rows = 1 + max((row for row, _ in placements), default=-1)
        for layer, array in arrays.items():
            if array.shape[0] < rows or array.ndim != 3:
                raise ValueError(f"layer {layer}: activations of shape {array.shape} for {rows} rows of samples")
        tokens = 0
        flops = 0.0
        non_finite = []
        for sample, (row, column) in zip(batch.samples, placements):
            if sample.position < self._start:
                continue
            n = sample.n_tokens
            if arrays and arrays[self._layers[0]].shape[1] < column + n:
                raise ValueError(f"sample {sample.sample_id}: {n} tokens but the batch's activations hold fewer")
            if nonfinite is not None and nonfinite[row, column : column + n].any():
                non_finite.append(self._non_finite_row(sample, nonfinite[row, column : column + n].sum(axis=0)))
                continue
            kept = None if self._sampling is None else self._sampling.kept(sample.sample_id, n)
            self._pending[sample.position] = _PendingSample(sample.sample_id, sample.token_ids, arrays, row, column, kept)
            tokens += n
            if self.totals.stored_tokens is not None:
                self.totals.stored_tokens += 0 if kept is None else len(kept)
            if self._flops_per_token is not None:
                flops += n * self._flops_per_token(n)
        for sample in batch.empty:
            if sample.position >= self._start:
                kept = None if self._sampling is None else np.zeros(0, np.int64)
                self._pending[sample.position] = _PendingSample(sample.sample_id, sample.token_ids, None, 0, 0, kept)
        skipped = [doc for doc in batch.skipped if doc.position >= self._start]
        for doc in skipped:
            self._pending[doc.position] = _SkippedRow(doc.skipped_entry())
        for position, entry in non_finite:
            self._pending[position] = _SkippedRow(entry)
        n_samples = sum(s.position >= self._start for s in batch.samples + batch.empty) - len(non_finite)
        self.totals.samples += n_samples
        self.totals.tokens += tokens
        self.totals.flops += flops
        self.totals.skipped_rows += len(skipped) + len(non_finite)
        if self._on_samples is not None:
            self._on_samples(n_samples + len(skipped) + len(non_finite), tokens)  # positions done, for the display

    def _non_finite_row(self, sample: TokenizedSample, counts: np.ndarray) -> tuple[int, dict[str, Any]]:
        """A sample whose activations are not finite in the output dtype: its skipped-row entry (position first),
        or, under `on_bad_row: fail`, the BadInput naming its outputs."""
        where = ", ".join(f"{output_key(o)} ({int(c)} values)" for o, c in zip(self._layers, counts) if c)
        detail = f"not finite in {self._out_dtype.name}: {where}"
        log.warning("event=non_finite sample_id=%d outputs=%r dtype=%s", sample.sample_id, where, self._out_dtype.name)
        if self._on_bad_row == "fail":
            largest = f" (its largest value is {float(np.finfo(self._out_dtype).max):g})" if self._out_dtype.kind == "f" else ""
            raise BadInput(
                f"sample {sample.sample_id} (data file {sample.url}, row {sample.row}): its activations are {detail}"
                f"{largest}; use \"dtype\": \"bf16\" or \"fp32\" in the job, or \"on_bad_row\": \"skip\" to record "
                "such rows and extract the others"
            )
        entry = {"sample_id": sample.sample_id, "file": sample.url, "row": sample.row, "reason": "non_finite",
                 "detail": detail[:MAX_DETAIL_CHARS]}  # fmt: skip
        return sample.position, entry

    def _width(self, layer: Output) -> int:
        return self._widths.get(layer) or int(self._metadata["hidden_size"])

    def _emit_complete_shards(self) -> None:
        while self._next in self._pending:
            result = self._pending.pop(self._next)
            if isinstance(result, _SkippedRow):
                self._shard_skipped.append(result.entry)
            else:
                if self._bounds.starts_shard(self._next, result.stored) and self._shard_samples:
                    self._emit(self._next)
                self._shard_samples.append(result)
            self._next += 1
            # A shard that ends at a multiple of shard_size is stored at once (a stop keeps it); one cut by size
            # is known complete only when the next sample arrives, above.
            if self._next == self._end or self._next % self._bounds.shard_size == 0:
                self._emit(self._next)

    def _emit(self, end: int) -> None:
        shard = self._encode(self._shard_start, end, self._shard_samples)
        shard.skipped = self._shard_skipped
        self._shard_samples, self._shard_skipped = [], []
        self._shard_start = end
        self._put(self._uploads, shard)

    def _encode(self, start: int, end: int, samples: list[_PendingSample]) -> _EncodedShard:
        lengths = np.array([s.stored for s in samples], dtype=np.int64)
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        n_tokens = int(offsets[-1])
        host = next((s.host for s in samples if s.host), None)
        widths = {layer: host[layer].shape[-1] if host else self._width(layer) for layer in self._layers}
        metadata = {
            **self._metadata,
            "sample_start": str(start),
            "sample_end": str(end),
            "samples": str(len(samples)),
            "tokens": str(n_tokens),
        }
        if self._sampling is not None:
            metadata.update(format=FORMAT_SAMPLED, sampling=self._sampling.to_json())
        # Statistics first, so a reader fetches all of them with one ranged read (activations.format).
        specs = [
            (name, np.dtype(np.float64), shape)
            for layer in self._layers
            for name, shape in zip(stats_keys(layer), [(widths[layer],), (widths[layer],), ()])
        ]
        specs += [(output_key(layer), self._out_dtype, (n_tokens, widths[layer])) for layer in self._layers]
        if self._out_dtype == FP8:
            specs += [(scale_key(layer), np.dtype(np.float32), (n_tokens,)) for layer in self._layers]
        specs += [
            ("token_ids", np.dtype(np.int32), (n_tokens,)),
            ("sample_ids", np.dtype(np.int64), (len(samples),)),
            ("offsets", np.dtype(np.int64), (len(samples) + 1,)),
        ]
        if self._sampling is not None:
            specs.append((POSITIONS, np.dtype(np.int32), (n_tokens,)))
        head, starts, total = safetensors_layout(specs, metadata)
        base = self._buffers.take(total)
        buffer = base[:total]
        buffer[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        views = {
            name: buffer[position : position + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
            for (name, dtype, shape), position in zip(specs, starts)
        }

        def copy_layer(layer: Output) -> None:
            # Copy 2: each sample's rows to their final place in the shard file.
            target = views[output_key(layer)]
            scale = views.get(scale_key(layer))
            for sample, lo, hi in zip(samples, offsets[:-1], offsets[1:]):
                if hi > lo and scale is not None:  # fp8: quantised per token on the way in
                    target[lo:hi], scale[lo:hi] = quantize_per_token(_stored_rows(sample, layer))
                elif hi > lo:
                    _copy_rows(target[lo:hi], _stored_rows(sample, layer))
            # Normalisation statistics of the stored values, read back from the shard buffer while it is in cache.
            for name, value in LayerStats.of(target, scale).tensors(layer).items():
                views[name][...] = value

        copies = [self._encode_pool.submit(copy_layer, layer) for layer in self._layers]
        if n_tokens and self._sampling is not None:
            np.concatenate([s.token_ids[s.kept] for s in samples], out=views["token_ids"], casting="unsafe")
            np.concatenate([s.kept for s in samples], out=views[POSITIONS], casting="unsafe")
        elif n_tokens:
            np.concatenate([s.token_ids for s in samples], out=views["token_ids"], casting="unsafe")
        views["sample_ids"][:] = [s.sample_id for s in samples]
        views["offsets"][:] = offsets
        for copy in copies:
            copy.result()
        buffer.setflags(write=False)  # this view only: the pooled base is written again once the shard is stored
        return _EncodedShard(
            name=shard_name(start, end),
            sample_start=start,
            sample_end=end,
            samples=len(samples),
            tokens=n_tokens,
            buffer=buffer,
            final=end == self._end,
            base=base,
            processed_tokens=None if self._sampling is None else sum(s.processed for s in samples),
        )

    # -- uploader thread ----------------------------------------------------------------------

    def _listable(self, skipped: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The first skipped rows that fit the task's MAX_LISTED_SKIPPED and half a progress line."""
        listed: list[dict[str, Any]] = []
        size = 0
        for entry in skipped[: max(MAX_LISTED_SKIPPED - self._listed_skipped, 0)]:
            size += len(json.dumps(entry)) + 1
            if size > MAX_PROGRESS_LINE // 2:  # long gs:// paths: the record must stay a valid progress line
                break
            listed.append(entry)
        return listed

    def _store_shard(self, shard: _EncodedShard) -> str:
        """Upload one shard (on the upload pool); return its CRC32C."""
        self._store.put(shard.name, memoryview(shard.buffer))
        return crc32c_b64(shard.buffer)

    def _upload(self) -> None:
        inflight: collections.deque[tuple[_EncodedShard, Future[str]]] = collections.deque()
        try:
            while True:
                shard = self._get(self._uploads)
                if shard is _END:
                    break
                inflight.append((shard, self._upload_pool.submit(self._store_shard, shard)))
                while len(inflight) >= self._streams:
                    self._commit(*inflight.popleft())
            while inflight:
                self._commit(*inflight.popleft())
        finally:
            for _, future in inflight:
                future.cancel()

    def _commit(self, shard: _EncodedShard, upload: Future[str]) -> None:
        """Append the shard's record once it is stored; called in shard order."""
        crc = upload.result()
        record: dict[str, Any] = {
            "shard": self._store.url(shard.name),
            "bytes": int(shard.buffer.nbytes),
            "crc32c": crc,
            "sample_start": shard.sample_start,
            "sample_end": shard.sample_end,
            "samples": shard.samples,
            "tokens": shard.tokens,
            "activations": [output_key(layer) for layer in self._layers],
        }
        if shard.processed_tokens is not None:
            record["counters"] = {PROCESSED_TOKENS: shard.processed_tokens, STORED_TOKENS: shard.tokens}
        if shard.skipped:
            record["counters"] = {**record.get("counters", {}), SKIPPED_ROWS: len(shard.skipped)}
            non_finite = sum(entry["reason"] == "non_finite" for entry in shard.skipped)
            if non_finite:
                record["counters"][NON_FINITE_ROWS] = non_finite
            record["skipped"] = self._listable(shard.skipped)
            self._listed_skipped += len(record["skipped"])
            for entry in record["skipped"]:
                log.warning(
                    "event=row_skipped sample_id=%d file=%s row=%d reason=%s detail=%r",
                    entry["sample_id"], entry["file"], entry["row"], entry["reason"], entry["detail"],
                )  # fmt: skip
        if shard.final:
            record["final"] = True
            record["stats"] = self.totals.stats(time.monotonic() - self.started, self._peak_flops)
        self._progress.append(record)
        self.records.append(record)
        if shard.base is not None:
            self._buffers.give(shard.base)
        log.info(
            "event=shard_written shard=%s samples=%d skipped_rows=%d tokens=%d bytes=%d final=%s",
            record["shard"], shard.samples, len(shard.skipped), shard.tokens, shard.buffer.nbytes, shard.final,
        )  # fmt: skip

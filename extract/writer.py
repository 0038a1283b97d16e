"""Activation shards: the safetensors encoding, and the background writer that turns device batches into shards.

Shard format (docs/EXTRACTION.md): one safetensors file per run of `shard_size` consecutive
slice positions, holding `layer_<L>` [n_tokens, hidden] in the output dtype, `token_ids` int32
[n_tokens], `sample_ids` int64 [n_samples] and `offsets` int64 [n_samples + 1]; sample k's tokens
are rows offsets[k]:offsets[k+1]. Padding is never stored. The header is written here rather than
by the safetensors library because numpy has no bfloat16 (ml_dtypes supplies it), and the
library's numpy API refuses it; the bytes are standard safetensors ("BF16").

The writer runs two threads behind bounded queues, so the device never waits for storage:
the collector copies activations to the host, puts samples back into slice order and encodes
complete shards; the uploader stores each shard and only then appends its progress record. A
full queue blocks the producer (backpressure); a failure in either thread is re-raised in the
main thread on its next call.

Skipped bad rows hold their positions without a sample: a shard still covers `shard_size`
positions but holds fewer samples (none, if every row was bad: the shard is then written with
empty tensors, so that every record names a shard). Its record counts them in
`counters.skipped_rows` and lists them in `skipped`, at most MAX_LISTED_SKIPPED per task.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from extract.batching import Batch

log = logging.getLogger(__name__)

FORMAT = "activations/v1"

#: safetensors dtype codes <-> numpy dtypes (bfloat16 from ml_dtypes).
_CODES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "U8": np.dtype(np.uint8),
}
_CODE_OF = {dtype: code for code, dtype in _CODES.items()}
_ALIGN = 8
MAX_PROGRESS_LINE = 64 * 1024
#: Skipped rows listed (sample id, file, row, reason) per task, over all its attempts; the rest are only counted.
MAX_LISTED_SKIPPED = 100
#: The progress-record counter that counts a shard's skipped rows (summed into the done marker's metadata).
SKIPPED_ROWS = "skipped_rows"


class ShardFormatError(ValueError):
    """Bytes that are not a well-formed safetensors file."""


def numpy_dtype(name: str) -> np.dtype:
    """'bfloat16' | 'float16' | 'float32' -> numpy dtype (bfloat16 via ml_dtypes)."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def layer_key(layer: int) -> str:
    return f"layer_{layer}"


# -- safetensors encoding -----------------------------------------------------------------------


def encode_safetensors(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    """Standard safetensors bytes: u64 header length, JSON header padded to 8 bytes, tensor data."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    arrays = []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        if array.dtype not in _CODE_OF:
            raise ShardFormatError(f"tensor {name}: dtype {array.dtype} has no safetensors code")
        header[name] = {
            "dtype": _CODE_OF[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        arrays.append(array)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % _ALIGN)
    out = np.empty(8 + len(header_bytes) + offset, dtype=np.uint8)
    out[:8] = np.frombuffer(len(header_bytes).to_bytes(8, "little"), dtype=np.uint8)
    out[8 : 8 + len(header_bytes)] = np.frombuffer(header_bytes, dtype=np.uint8)
    position = 8 + len(header_bytes)
    for array in arrays:
        out[position : position + array.nbytes] = array.reshape(-1).view(np.uint8)
        position += array.nbytes
    return out.tobytes()


def parse_header(head: bytes) -> tuple[dict[str, Any], int]:
    """(header dict, offset of the data section) from the first bytes of a safetensors file."""
    if len(head) < 8:
        raise ShardFormatError("shorter than a safetensors header")
    size = int.from_bytes(head[:8], "little")
    if size > 100 * 1024 * 1024:
        raise ShardFormatError(f"header length {size} is implausible")
    if len(head) < 8 + size:
        raise ShardFormatError(f"header needs {8 + size} bytes, got {len(head)}")
    try:
        header = json.loads(head[8 : 8 + size])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ShardFormatError(f"header is not JSON: {exc}") from exc
    return header, 8 + size


def decode_safetensors(buffer: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors (read-only views of `buffer`) and the string metadata."""
    header, data_start = parse_header(buffer)
    metadata = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, spec in header.items():
        if spec["dtype"] not in _CODES:
            raise ShardFormatError(f"tensor {name}: dtype {spec['dtype']} is not supported here")
        dtype = _CODES[spec["dtype"]]
        begin, end = spec["data_offsets"]
        count = int(np.prod(spec["shape"], dtype=np.int64))
        if end - begin != count * dtype.itemsize or data_start + end > len(buffer):
            raise ShardFormatError(f"tensor {name}: data_offsets {begin}:{end} do not match shape {spec['shape']}")
        array = np.frombuffer(buffer, dtype=dtype, count=count, offset=data_start + begin)
        tensors[name] = array.reshape(spec["shape"])
    return tensors, metadata


def crc32c_b64(data: bytes) -> str:
    """CRC32C as GCS reports it: the 4 big-endian bytes, base64-encoded."""
    import google_crc32c

    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def shard_name(sample_start: int, sample_end: int) -> str:
    """Positions in the name make a prefix listing sort in slice order."""
    return f"shard-{sample_start:09d}-{sample_end:09d}.safetensors"


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


@dataclasses.dataclass
class _SampleResult:
    sample_id: int
    token_ids: np.ndarray
    layers: dict[int, np.ndarray]


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
    payload: bytes
    final: bool
    skipped: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RunTotals:
    """What this attempt processed; becomes `stats` in the final record."""

    samples: int = 0
    tokens: int = 0
    flops: float = 0.0
    skipped_rows: int = 0

    def stats(self, seconds: float, peak_flops: float | None) -> dict[str, Any]:
        seconds = max(seconds, 1e-9)
        mfu = None if not peak_flops else self.flops / seconds / peak_flops
        return {
            "samples": self.samples,
            "skipped_rows": self.skipped_rows,
            "tokens": self.tokens,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(self.tokens / seconds, 3),
            "mfu": None if mfu is None else round(mfu, 6),
        }


_END = object()


class WriterFailed(RuntimeError):
    """Raised in the main thread when it tries to use a writer whose background thread died."""


class ShardWriter:
    """Collects batches for positions [start, end) of a task's slice and writes them as shards."""

    def __init__(
        self,
        *,
        store: Any,
        layers: Sequence[int],
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
        listed_skipped: int = 0,
    ):
        """`listed_skipped`: skipped rows the task's earlier attempts already listed (their records' `skipped`)."""
        if not 0 <= start < end:
            raise ValueError(f"writer range [{start}, {end}) is empty")
        self._store = store
        self._layers = tuple(layers)
        self._out_dtype = np.dtype(out_dtype)
        self._end = end
        self._shard_size = shard_size
        self._metadata = dict(metadata)
        self._progress = progress
        self._flops_per_token = flops_per_token
        self._peak_flops = peak_flops
        self._on_samples = on_samples
        self.totals = RunTotals()
        self.records: list[dict[str, Any]] = []
        self.started = time.monotonic()

        self._next = start  # next position to append to the open shard
        self._shard_start = start
        self._shard_samples: list[_SampleResult] = []
        self._shard_skipped: list[dict[str, Any]] = []
        self._pending: dict[int, _SampleResult | _SkippedRow] = {}
        self._listed_skipped = listed_skipped

        self._batches: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._uploads: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._abort = threading.Event()
        self._failed = threading.Event()
        self._error: BaseException | None = None
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
                host = jax.device_get({layer: hidden[layer] for layer in self._layers}) if batch.samples else {}
                self._accept(batch, host)
                self._emit_complete_shards()
        finally:
            # The uploader drains what is queued (complete shards only), then stops.
            while not self._failed.is_set():
                try:
                    self._uploads.put(_END, timeout=0.1)
                    break
                except queue.Full:
                    continue

    def _accept(self, batch: Batch, host: Mapping[int, Any]) -> None:
        arrays = {layer: np.asarray(host[layer]) for layer in host}
        for layer, array in arrays.items():
            if array.shape[0] < len(batch.samples) or array.ndim != 3:
                raise ValueError(f"layer {layer}: activations of shape {array.shape} for {len(batch.samples)} samples")
        tokens = 0
        flops = 0.0
        for row, sample in enumerate(batch.samples):
            n = sample.n_tokens
            layers = {layer: np.array(arrays[layer][row, :n], dtype=self._out_dtype) for layer in self._layers}
            self._pending[sample.position] = _SampleResult(sample.sample_id, sample.token_ids, layers)
            tokens += n
            if self._flops_per_token is not None:
                flops += n * self._flops_per_token(n)
        for sample in batch.empty:
            hidden = arrays[self._layers[0]].shape[-1] if arrays else self._hidden_size()
            layers = {layer: np.zeros((0, hidden), dtype=self._out_dtype) for layer in self._layers}
            self._pending[sample.position] = _SampleResult(sample.sample_id, sample.token_ids, layers)
        for doc in batch.skipped:
            self._pending[doc.position] = _SkippedRow(doc.skipped_entry())
        self.totals.skipped_rows += len(batch.skipped)
        n_samples = len(batch.samples) + len(batch.empty)
        self.totals.samples += n_samples
        self.totals.tokens += tokens
        self.totals.flops += flops
        if self._on_samples is not None:
            self._on_samples(n_samples + len(batch.skipped), tokens)  # positions done, for the progress display

    def _hidden_size(self) -> int:
        return int(self._metadata["hidden_size"])

    def _emit_complete_shards(self) -> None:
        while self._next in self._pending:
            result = self._pending.pop(self._next)
            if isinstance(result, _SkippedRow):
                self._shard_skipped.append(result.entry)
            else:
                self._shard_samples.append(result)
            self._next += 1
            boundary = min((self._shard_start // self._shard_size + 1) * self._shard_size, self._end)
            if self._next == boundary:
                shard = self._encode(self._shard_start, self._next, self._shard_samples)
                shard.skipped = self._shard_skipped
                self._shard_samples, self._shard_skipped = [], []
                self._shard_start = self._next
                self._put(self._uploads, shard)

    def _encode(self, start: int, end: int, samples: list[_SampleResult]) -> _EncodedShard:
        lengths = np.array([s.token_ids.shape[0] for s in samples], dtype=np.int64)
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tensors: dict[str, np.ndarray] = {}
        for layer in self._layers:
            tensors[layer_key(layer)] = (
                np.concatenate([s.layers[layer] for s in samples], axis=0)
                if samples  # else every row of the shard was skipped: empty tensors keep it a readable shard
                else np.zeros((0, self._hidden_size()), dtype=self._out_dtype)
            )
        tensors["token_ids"] = np.concatenate([s.token_ids for s in samples] or [np.zeros(0, np.int32)]).astype(
            np.int32, copy=False
        )
        tensors["sample_ids"] = np.array([s.sample_id for s in samples], dtype=np.int64)
        tensors["offsets"] = offsets
        metadata = {
            **self._metadata,
            "sample_start": str(start),
            "sample_end": str(end),
            "samples": str(len(samples)),
            "tokens": str(int(offsets[-1])),
        }
        return _EncodedShard(
            name=shard_name(start, end),
            sample_start=start,
            sample_end=end,
            samples=len(samples),
            tokens=int(offsets[-1]),
            payload=encode_safetensors(tensors, metadata),
            final=end == self._end,
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

    def _upload(self) -> None:
        while True:
            shard = self._get(self._uploads)
            if shard is _END:
                return
            self._store.put(shard.name, shard.payload)
            record: dict[str, Any] = {
                "shard": self._store.url(shard.name),
                "bytes": len(shard.payload),
                "crc32c": crc32c_b64(shard.payload),
                "sample_start": shard.sample_start,
                "sample_end": shard.sample_end,
                "samples": shard.samples,
                "tokens": shard.tokens,
            }
            if shard.skipped:
                record["counters"] = {SKIPPED_ROWS: len(shard.skipped)}
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
            log.info(
                "event=shard_written shard=%s samples=%d skipped_rows=%d tokens=%d bytes=%d final=%s",
                record["shard"], shard.samples, len(shard.skipped), shard.tokens, len(shard.payload), shard.final,
            )  # fmt: skip


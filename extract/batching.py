"""Tokenisation and fixed-shape batches: documents in, `[batch_size, bucket]` int32 arrays out.

XLA compiles one program per input shape, so every batch has the job's batch size and one of a
few bucket lengths; a batch takes the smallest bucket that holds its longest sample. To keep
padding low, samples are sorted by length within a window of `WINDOW_BATCHES * batch_size`
samples before being cut into batches; the writer puts them back in slice order.

Windows never straddle a shard boundary and are aligned to absolute slice positions. A run
resumed at a shard boundary therefore forms exactly the same batches as an uninterrupted run,
which makes its activations bit-identical on a deterministic backend.

Tokenisation: the checkpoint's own tokenizer, `add_special_tokens=False` (Qwen adds no BOS
anyway, and no EOS is appended), truncated to `max_seq_len`. Text that spells a special token
(`<|endoftext|>`) is encoded as ordinary text (`split_special_tokens=True`): web documents are
data, not control sequences. An empty text has zero tokens; it is stored with an empty span and
never occupies a batch row.

Bad rows (see `extract.data.BadRow`), including text the tokenizer refuses, never reach a batch
row either: with `on_bad_row="skip"` they ride along in `Batch.skipped` so that the writer can
record them and still close their shard; with `"fail"` the first one raises `BadInput`.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from extract.data import BadRow, Document

log = logging.getLogger(__name__)

#: Samples sorted together, in batches: larger means less padding but more reordering in the writer.
WINDOW_BATCHES = 8
#: Documents packed together (`pack_window`), in batches of `batch_size` documents. The last batch of a window has
#: empty rows; 4 times the unpacked window keeps that under 5% on FineWeb-Edu-like lengths (bench/host_bench.py:
#: 96.7% real at max_seq_len 512, 96.2% at 2048, against 92.7% and 84.9% with WINDOW_BATCHES). The writer holds
#: up to a window's activations while it restores slice order.
PACKED_WINDOW_BATCHES = 4 * WINDOW_BATCHES

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class TokenizedSample:
    position: int  # within the task's slice
    sample_id: int  # global, see extract.job
    token_ids: np.ndarray  # int32 [n_tokens], no padding
    url: str = ""  # where the row came from (a skipped row's record names it)
    row: int = -1

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclasses.dataclass(frozen=True)
class Batch:
    """Row r of `token_ids` holds `samples[r]` right-padded; rows past len(samples) are all padding.

    `empty` carries zero-token samples of the same window to the writer without a device row, and
    `skipped` the window's bad rows (documents with `bad` set), which the writer records and omits.
    `token_ids` is None when a window held only empty samples and bad rows.
    """

    samples: tuple[TokenizedSample, ...]
    token_ids: np.ndarray | None
    empty: tuple[TokenizedSample, ...] = ()
    skipped: tuple[Document, ...] = ()
    # Packed batches only (`pack_window`): each token's document number in its row (0 = padding), its position
    # within that document, and where each of `samples` starts: (row, column).
    segment_ids: np.ndarray | None = None
    positions: np.ndarray | None = None
    placements: tuple[tuple[int, int], ...] | None = None

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.samples)

    @property
    def bucket(self) -> int:
        return 0 if self.token_ids is None else int(self.token_ids.shape[1])


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= length; `buckets` is sorted and ends at max_seq_len."""
    index = bisect.bisect_left(buckets, length)
    if index == len(buckets):
        raise ValueError(f"length {length} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]


def window_size(batch_size: int, packing: bool = False) -> int:
    """Documents per batching window."""
    return (PACKED_WINDOW_BATCHES if packing else WINDOW_BATCHES) * batch_size


def window_start(position: int, batch_size: int, shard_size: int, packing: bool = False) -> int:
    """The first position of the batching window that holds `position`: batches for a run starting at `position`
    are formed from there, so that they are the batches an uninterrupted run formed."""
    window = window_size(batch_size, packing)
    return max(position // window * window, position // shard_size * shard_size)


def window_bounds(start: int, end: int, window: int, shard_size: int) -> Iterator[tuple[int, int]]:
    """Windows covering [start, end), cut at every multiple of `window` and of `shard_size`."""
    position = start
    while position < end:
        stop = min((position // window + 1) * window, (position // shard_size + 1) * shard_size, end)
        yield position, stop
        position = stop


class ShardBounds:
    """Where shards end: at every multiple of `shard_size` (absolute positions), and before a sample whose tokens
    would take the open shard past `shard_tokens` (a shard holds at least one sample, so one long document may
    exceed it alone).

    A byte cut depends only on the token counts since the shard's start, and every shard starts at a cut, so a
    run resumed at a committed shard's end finds the same later cuts. Batching windows are not cut at byte cuts
    (a 7B model's full batch is larger than a sensible shard, so batches must be able to straddle shards): a run
    resumed at one reads from the start of its window (`window_start`) and drops what is already committed.
    """

    def __init__(self, start: int, shard_size: int, shard_tokens: int | None = None):
        self.shard_size = shard_size
        self.shard_tokens = shard_tokens
        self.shard_start = start
        self._samples = 0
        self._tokens = 0

    def next_multiple(self, position: int) -> int:
        return (position // self.shard_size + 1) * self.shard_size

    def starts_shard(self, position: int, n_tokens: int) -> bool:
        """Account sample `position` (the next in order); True when it opens a new shard (its first sample)."""
        cut = position == self.shard_start or position % self.shard_size == 0
        if not cut and self.shard_tokens is not None:
            cut = self._samples > 0 and self._tokens + n_tokens > self.shard_tokens
        if cut:
            self.shard_start, self._samples, self._tokens = position, 0, 0
        self._samples += 1
        self._tokens += n_tokens
        return cut


def shard_token_limit(shard_bytes: int | None, bytes_per_token: int) -> int | None:
    """Tokens per shard that keep its tensors within `shard_bytes` (None: no byte limit)."""
    return None if shard_bytes is None else max(1, shard_bytes // max(1, bytes_per_token))


class Tokenizer:
    """The checkpoint's tokenizer with the pipeline's fixed settings."""

    def __init__(self, model_dir: Any, max_seq_len: int):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        self.max_seq_len = max_seq_len
        pad = self.hf.pad_token_id if self.hf.pad_token_id is not None else self.hf.eos_token_id
        # Padding is never read back (attention is causal and padding sits on the right), so any id works.
        self.pad_id = int(pad) if pad is not None else 0
        self.name = getattr(self.hf, "name_or_path", str(model_dir))

    @property
    def single_id_strings(self) -> tuple[str, ...]:
        """The strings that become one id wherever a document holds them, in id order: the tokenizer's added tokens
        that are not marked special (`split_special_tokens` splits only special ones into plain text). For Qwen2.5:
        `<tool_call>`, `</tool_call>`, the `<|fim_…|>` tokens, `<|repo_name|>`, `<|file_sep|>` (docs/EXTRACTION.md)."""
        added = self.hf.added_tokens_decoder
        return tuple(added[i].content for i in sorted(added) if not added[i].special)

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        if not texts:
            return []
        encoded = self.hf(
            list(texts),
            add_special_tokens=False,
            split_special_tokens=True,
            truncation=True,
            max_length=self.max_seq_len,
            return_attention_mask=False,
        )["input_ids"]
        return [np.asarray(ids, dtype=np.int32) for ids in encoded]

    def encode_each(self, texts: Sequence[str]) -> list[np.ndarray | BadRow]:
        """`encode`, but a text the tokenizer refuses becomes a BadRow instead of failing its neighbours.

        The texts go to the tokenizer in one call, as in `encode`; only if that call fails are they
        split in halves, recursively, to find the ones at fault: k bad texts among n cost about
        2k·log2(n) extra calls, not n. The tokenizers library does not document what it raises for
        input it cannot encode (a lone surrogate gives TypeError today), hence the broad catch; the
        exception is kept in the row's detail, never dropped.
        """
        if not texts:
            return []
        try:
            return list(self.encode(texts))
        except Exception as exc:  # undocumented tokenizer errors: narrowed down below, kept in the BadRow
            if len(texts) == 1:
                return [_tokenizer_refusal(texts[0], exc)]
        half = len(texts) // 2
        return self.encode_each(texts[:half]) + self.encode_each(texts[half:])


def _tokenizer_refusal(text: str, exc: Exception) -> BadRow:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as bad:
        # Python strings may hold lone surrogates (JSON "\ud800"); UTF-8, and so the tokenizer, cannot.
        return BadRow("lone_surrogate", f"lone surrogate {text[bad.start]!r} at character {bad.start}")
    return BadRow("untokenizable", f"the tokenizer raised {type(exc).__name__}: {exc}")


def _split_window(
    window: Sequence[TokenizedSample], skipped: Sequence[Document]
) -> tuple[tuple[TokenizedSample, ...], tuple[Document, ...], list[TokenizedSample]]:
    """(empty samples, skipped rows, the rest longest first with ties by position): how both batchers start."""
    empty = tuple(s for s in window if s.n_tokens == 0)
    ordered = sorted((s for s in window if s.n_tokens > 0), key=lambda s: (-s.n_tokens, s.position))
    return empty, tuple(skipped), ordered


def make_batches(
    window: Sequence[TokenizedSample],
    batch_size: int,
    buckets: Sequence[int],
    pad_id: int,
    skipped: Sequence[Document] = (),
) -> list[Batch]:
    """Sort one window by length (longest first, ties by position) and cut it into padded batches.

    Empty samples and the window's `skipped` bad rows ride with the first batch.
    """
    empty, skipped, ordered = _split_window(window, skipped)
    if not ordered:
        return [Batch(samples=(), token_ids=None, empty=empty, skipped=skipped)] if empty or skipped else []
    batches = []
    for first in range(0, len(ordered), batch_size):
        rows = ordered[first : first + batch_size]
        length = bucket_for(rows[0].n_tokens, buckets)
        token_ids = np.full((batch_size, length), pad_id, dtype=np.int32)
        for r, sample in enumerate(rows):
            token_ids[r, : sample.n_tokens] = sample.token_ids
        first_batch = first == 0
        batches.append(
            Batch(
                samples=tuple(rows),
                token_ids=token_ids,
                empty=empty if first_batch else (),
                skipped=skipped if first_batch else (),
            )
        )
    return batches


def pack_window(
    window: Sequence[TokenizedSample],
    batch_size: int,
    buckets: Sequence[int],
    pad_id: int,
    skipped: Sequence[Document] = (),
) -> list[Batch]:
    """Sequence packing: several documents per row, so rows are full instead of padded to a bucket.

    Documents (longest first, ties by position) go to the first row with room (first-fit decreasing, rows of
    `buckets[-1]` = max_seq_len tokens); rows are cut into batches of `batch_size`, each padded to the smallest
    bucket that holds its fullest row. Each document keeps its own positions (0..n-1) and sees only itself
    (`segment_ids`), so its activations are those of an unpacked run up to floating-point summation order.
    Deterministic for a given window, so resumed runs pack identically. Empty samples and the window's
    `skipped` bad rows ride with the first batch, as in `make_batches`.
    """
    empty, skipped, ordered = _split_window(window, skipped)
    if not ordered:
        return [Batch(samples=(), token_ids=None, empty=empty, skipped=skipped)] if empty or skipped else []
    capacity = buckets[-1]
    rows: list[list[TokenizedSample]] = []
    fill: list[int] = []
    for sample in ordered:
        for r, used in enumerate(fill):
            if used + sample.n_tokens <= capacity:
                rows[r].append(sample)
                fill[r] += sample.n_tokens
                break
        else:
            rows.append([sample])
            fill.append(sample.n_tokens)
    batches = []
    for first in range(0, len(rows), batch_size):
        length = bucket_for(max(fill[first : first + batch_size]), buckets)
        token_ids = np.full((batch_size, length), pad_id, dtype=np.int32)
        segment_ids = np.zeros((batch_size, length), dtype=np.int32)
        positions = np.zeros((batch_size, length), dtype=np.int32)
        samples, placements = [], []
        for r, row in enumerate(rows[first : first + batch_size]):
            column = 0
            for document, sample in enumerate(row, start=1):
                span = slice(column, column + sample.n_tokens)
                token_ids[r, span] = sample.token_ids
                segment_ids[r, span] = document
                positions[r, span] = np.arange(sample.n_tokens, dtype=np.int32)
                samples.append(sample)
                placements.append((r, column))
                column += sample.n_tokens
        batches.append(
            Batch(
                samples=tuple(samples), token_ids=token_ids, empty=empty if first == 0 else (),
                skipped=skipped if first == 0 else (), segment_ids=segment_ids, positions=positions, placements=tuple(placements),
            )  # fmt: skip
        )
    return batches


def batches_for_slice(
    documents: Iterable[Document],
    tokenizer: Tokenizer,
    *,
    start: int,
    end: int,
    batch_size: int,
    shard_size: int,
    buckets: Sequence[int],
    packing: bool = False,
    on_bad_row: str = "skip",
) -> Iterator[Batch]:
    """Batches for positions [window_start(start), end) of the slice; `documents` must start at that position.

    Starting at the window's start, not at `start`, forms the same batches as an uninterrupted run; the caller
    drops the samples before `start` (they were committed by an earlier attempt). For a fresh run, or one resumed
    at a multiple of `shard_size`, the window starts at `start` itself. `packing` puts several documents in a
    row (`pack_window`).

    A bad row (from the data, or refused by the tokenizer) is carried in `Batch.skipped` when
    `on_bad_row` is "skip"; with "fail" the first one in slice order raises its `BadInput`.
    """
    if buckets[-1] < tokenizer.max_seq_len:
        raise ValueError(f"largest bucket {buckets[-1]} is below max_seq_len {tokenizer.max_seq_len}")
    docs = iter(documents)
    window = window_size(batch_size, packing)
    for lo, hi in window_bounds(window_start(start, batch_size, shard_size, packing), end, window, shard_size):
        window_docs = []
        for expected in range(lo, hi):
            doc = next(docs, None)
            if doc is None:
                raise ValueError(f"the data ended at position {expected}, before the slice's end {end}")
            if doc.position != expected:
                raise ValueError(f"document at position {doc.position} arrived where {expected} was expected")
            window_docs.append(doc)
        readable = [d for d in window_docs if d.bad is None]
        samples, skipped = [], []
        for doc, ids in zip(readable, tokenizer.encode_each([d.text for d in readable])):
            if isinstance(ids, BadRow):
                skipped.append(dataclasses.replace(doc, bad=ids))
            else:
                samples.append(TokenizedSample(doc.position, doc.sample_id, ids, doc.url, doc.row))
        skipped += [d for d in window_docs if d.bad is not None]
        skipped.sort(key=lambda d: d.position)
        if skipped and on_bad_row == "fail":
            raise skipped[0].bad_row_error()
        if packing:
            yield from pack_window(samples, batch_size, buckets, tokenizer.pad_id, skipped)
        else:
            yield from make_batches(samples, batch_size, buckets, tokenizer.pad_id, skipped)
    # Run the reader past the slice's last row: its checks on the slice as a whole (a JSON slice in which no row has
    # the text field) run when it ends, and with the task's last file nothing else would make it end.
    extra = next(docs, None)
    if extra is not None:
        raise ValueError(f"the data holds position {extra.position} past the slice's end {end}")


class _End:
    pass


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher(Generic[T]):
    """Runs an iterator on a background thread, `depth` items ahead of the consumer.

    Host work (reading parquet, tokenising) then overlaps the device. An exception raised by the
    iterator is re-raised in the consuming thread at the point it would have occurred.
    """

    def __init__(self, source: Iterable[T], depth: int, name: str = "prefetch", cancel: threading.Event | None = None):
        self._source = source
        self._cancel = cancel  # lets a waiting consumer give up (on SIGTERM) while the producer is busy
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self._source:
                if not self._put(item):
                    return
        except BaseException as exc:  # handed to the consuming thread, which re-raises it
            self._put(_Failed(exc))
            return
        self._put(_End())

    def __iter__(self) -> Iterator[T]:
        while True:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._cancel is not None and self._cancel.is_set():
                    return
                continue
            if isinstance(item, _End):
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item

    def close(self) -> None:
        """Stop producing; the thread exits at its next hand-off."""
        self._stop.set()
        self._thread.join(timeout=1)  # a daemon: a producer stuck in I/O must not delay a stop

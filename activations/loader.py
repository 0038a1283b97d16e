"""A streaming, shuffled loader of activation shards: a queue, bucket or directory in, `[batch, d]` batches out.

    from activations.loader import ActivationLoader

    loader = ActivationLoader("gs://B/jobs/J", layers=16, batch_size=4096, shuffle_tokens=1 << 17, seed=0,
                              drop_token_ids=[151643], output="torch", dtype="float32", normalize="mean_norm")
    for batch in loader:             # torch.float32 [4096, 3584]
        ...
    ActivationLoader("gs://B/jobs/J", site="mlp_out", layers=[3, 7])   # a hook site: [batch, 2, d]
    state = loader.state_dict()      # JSON-able; load_state_dict(state) resumes to exactly the same stream

What it does, in order:
1. **Shards.** `activations.reader.resolve_shards` (a queue's `index.json` or done markers, a prefix, a list).
2. **Epoch order.** Each epoch visits the shards in a permutation seeded by (seed, epoch) (in order when
   `shuffle=False`). Every rank uses the same permutation and reads rows [n·r/W, n·(r+1)/W) of every shard's n
   tokens, so each token is read by exactly one rank per epoch and ranks' token counts differ by under one per
   shard (before token filters).
   What is read: `layers`, hidden-state indices (as the job's `layers`), or with `site=` that site's decoder layers
   (as the job's `sites`); or hook points (`HookPoint`) and indices mixed in `layers`, e.g. a transcoder's
   `[HookPoint("mlp_in", 3), HookPoint("mlp_out", 3)]`: each row then holds them all, of one token.
3. **Ranged reads.** Per shard: the header (one ranged read), then only the selected outputs' rows of this rank (and
   `token_ids`/`offsets` when a filter or `return_token_ids` needs them). gs://: cut into parts of `part_bytes`
   read in parallel by `threads` I/O threads, the object store's ranged GETs, each part copied once from the
   response into the shard's array. Local files: the rows' byte range is mapped (mmap, populated by the fetching
   thread), so rows are copied once, from the page cache into the buffer or the batch. `readahead` shards are
   fetched ahead of the one being consumed, across epoch boundaries. With `cache_dir`, fetched gs:// ranges are kept on local disk
   (least recently used ranges deleted beyond `cache_bytes`).
4. **Token filters.** `drop_token_ids`, `drop_first` (the first k positions of every document) and `positions`
   (keep positions lo <= p < hi of every document) select the rows that enter the stream.
5. **Shuffle buffer.** With `shuffle_tokens=C`, the first C rows of the stream fill a buffer; then each step takes
   the next `batch_size` rows of the stream, puts them into C distinct slots drawn uniformly at random, and emits the
   rows those slots held, as the batch. At the end of an epoch's stream the buffer drains in random order. See
   docs/TRAINING.md ("Mixing") for what this gives: a row stays in the buffer a geometric number of steps with mean
   C / batch_size, so two tokens of one document, which enter together, leave on average about C rows apart.
6. **Output.** numpy, torch or JAX arrays in `dtype`, optionally normalised with the statistics the writer stored
   (`normalize="mean_norm"`: x · sqrt(d) / E‖x‖ as SAELens's `expected_average_only_in` does it; `"standardize"`:
   (x - mean) / std per dimension), with no estimation pass.

Memory bound (`memory_bound_bytes`): (readahead + 1) shards' selected rows for this rank, the shuffle buffer
(C × layers × d in the stored dtype), and two output batches. A shard's rows are held once: parts are read into
its array (or its file's pages are mapped), rows are copied from it into the buffer or the batch, and it is dropped
when consumed. A local shard's mapped rows are the page cache's pages, which the kernel may reclaim, not the
process's own memory.

Batches are assembled in the caller's thread (numpy's gathers release the GIL), so `state_dict()` always describes
the position after the last batch returned.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from activations.format import HIDDEN, HookPoint, LayerStats, Output, ShardHeader, as_float32, numpy_dtype, output_key
from activations.io import ActivationsError, ByteReader, RangeCache, is_remote
from activations.reader import ShardRef, as_output, queue_index_url, read_header, read_index, resolve_shards, sum_stats

STATE_FORMAT = "activations-loader/v1"
NORMALIZATIONS = (None, "mean_norm", "standardize")
OUTPUTS = ("numpy", "torch", "jax")


class LoaderConfigError(ActivationsError, ValueError):
    """A loader argument that cannot work; the message names it and says what to pass instead."""


@dataclasses.dataclass(frozen=True)
class TokenFilter:
    """Which stored tokens enter the stream: every filter must keep a token."""

    drop_token_ids: frozenset[int] = frozenset()
    drop_first: int = 0
    positions: tuple[int, int | None] = (0, None)

    @property
    def needs_token_ids(self) -> bool:
        return bool(self.drop_token_ids)

    @property
    def needs_offsets(self) -> bool:
        return self.drop_first > 0 or self.positions != (0, None)

    def kept(self, lo: int, hi: int, token_ids: np.ndarray | None, offsets: np.ndarray | None) -> np.ndarray:
        """Indices (relative to `lo`) of the rows [lo, hi) of a shard that are kept."""
        keep = np.ones(hi - lo, dtype=bool)
        if self.drop_token_ids:
            keep &= ~np.isin(token_ids, np.fromiter(self.drop_token_ids, dtype=np.int64))
        if self.needs_offsets:
            rows = np.arange(lo, hi, dtype=np.int64)
            document = np.searchsorted(offsets, rows, side="right") - 1
            position = rows - offsets[document]
            first, last = self.positions
            keep &= position >= max(first, self.drop_first)
            if last is not None:
                keep &= position < last
        return np.flatnonzero(keep)


@dataclasses.dataclass
class _ShardRows:
    """This rank's rows of one shard, read once."""

    shard: int  # index into the loader's shard list
    lo: int  # first absolute row of this rank's slice
    data: list[np.ndarray]  # per layer [hi - lo, d], the stored bits as unsigned integers of the stored width
    # (a local shard's are mappings of its file: the page cache's pages, not a copy)
    token_ids: np.ndarray | None  # [hi - lo]
    kept: np.ndarray  # int64 indices into the slice, in order


class ActivationLoader:
    """Shuffled `[batch, d]` (or `[batch, layers, d]` for several layers) batches from activation shards.

    See the module docstring for the pipeline, the memory bound and the resume contract."""

    def __init__(
        self,
        source: str | Sequence[str],
        *,
        layers: int | Output | Sequence[Output] | None = None,
        site: str = HIDDEN,
        batch_size: int = 4096,
        shuffle: bool = True,
        shuffle_tokens: int = 1 << 16,
        seed: int = 0,
        epochs: int | None = 1,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        drop_token_ids: Iterable[int] = (),
        drop_first: int = 0,
        positions: tuple[int, int | None] = (0, None),
        output: str = "numpy",
        dtype: str = "float32",
        device: Any = None,
        normalize: str | None = None,
        stats: dict[int, LayerStats] | None = None,
        return_token_ids: bool = False,
        threads: int = 8,
        readahead: int = 4,
        part_bytes: int = 8 << 20,
        cache_dir: str | None = None,
        cache_bytes: int | None = None,
        client: Any = None,
    ):
        if batch_size < 1:
            raise LoaderConfigError(f"batch_size must be at least 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise LoaderConfigError(f"rank {rank} is not in [0, world_size={world_size})")
        if normalize not in NORMALIZATIONS:
            raise LoaderConfigError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
        if output not in OUTPUTS:
            raise LoaderConfigError(f"output must be one of {OUTPUTS}, got {output!r}")
        if shuffle and shuffle_tokens < batch_size:
            raise LoaderConfigError(f"shuffle_tokens ({shuffle_tokens}) must be at least batch_size ({batch_size}); "
                                    "or pass shuffle=False")  # fmt: skip
        if epochs is not None and epochs < 1:
            raise LoaderConfigError(f"epochs must be at least 1 (or None for no end), got {epochs}")
        self.source = source
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.capacity = shuffle_tokens if shuffle else 0
        self.seed = seed
        self.epochs = epochs
        self.drop_last = drop_last
        self.rank, self.world_size = rank, world_size
        self.filter = TokenFilter(frozenset(int(t) for t in drop_token_ids), int(drop_first), tuple(positions))
        self.output, self.device = output, device
        self.dtype = numpy_dtype(dtype)
        self.normalize = normalize
        self.return_token_ids = return_token_ids
        self.readahead = max(0, readahead)
        self.part_bytes = max(1 << 16, part_bytes)
        self._client = client
        self._reader = ByteReader(client, RangeCache(cache_dir, cache_bytes) if cache_dir else None)

        self.shards: list[ShardRef] = resolve_shards(source, client)
        if not self.shards:
            raise ActivationsError(f"{source}: no shards found")
        first = read_header(self.shards[0].url, self._reader)
        self.outputs = _selected(first, layers, site)
        # The selection's layer numbers (hidden-state indices, or the hook points' decoder layers).
        self.layers = tuple(o.layer if isinstance(o, HookPoint) else o for o in self.outputs)
        widths = {first.output(o).shape[1] for o in self.outputs}
        if len(widths) > 1:
            raise LoaderConfigError(f"layers {[output_key(o) for o in self.outputs]} differ in width ({sorted(widths)}); "
                                    "a batch row holds outputs of one width: load them separately")  # fmt: skip
        self.hidden_size = widths.pop()  # d of a batch row: hidden_size, or intermediate_size for mlp_hidden
        self.stored_dtype = first.output(self.outputs[0]).dtype
        # Rows are moved as raw unsigned integers of the same width: numpy copies those at memory speed, while a
        # fancy-index assignment of ml_dtypes' bfloat16 takes a per-element path about 20 times slower.
        self._raw = np.dtype(f"u{self.stored_dtype.itemsize}")
        self._row_shape = (len(self.outputs), self.hidden_size)
        self._first_tokens = first.num_tokens
        self._norm = self._normalisation(stats) if normalize else None

        self._io = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="loader-io")
        self._fetcher = ThreadPoolExecutor(max_workers=max(1, self.readahead), thread_name_prefix="loader-shard")
        self._futures: dict[tuple[int, int], Future[_ShardRows]] = {}
        self._orders: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self._reset(epoch=0)

    # -- public API ---------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        rows = self._next_rows()
        if rows is None:
            raise StopIteration
        return self._convert(*rows)

    def __enter__(self) -> "ActivationLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._futures.clear()
        self._fetcher.shutdown(wait=True)
        self._io.shutdown(wait=True)

    def memory_bound_bytes(self) -> int:
        """Bytes the loader holds at most (see the module docstring); the largest shard is taken from the source's
        records (index or done markers) when they give token counts, else from the first shard."""
        known = [ref.tokens for ref in self.shards if ref.tokens is not None]
        tokens = max(known) if known else self._first_tokens
        row = len(self.layers) * self.hidden_size * self.stored_dtype.itemsize
        shard = (tokens // self.world_size + 1) * (row + 4)
        batch = self.batch_size * len(self.layers) * self.hidden_size * self.dtype.itemsize
        return (self.readahead + 1) * shard + self.capacity * (row + 12) + 2 * (batch + self.batch_size * row)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch returned, JSON-able: epoch, stream position, the shuffle buffer's
        random state and, for each of its rows, where it came from (shard, row), so that it can be read back.
        While the buffer drains at an epoch's end, its rows are listed in the order they will leave."""
        live = self._live_slots()
        return {
            "format": STATE_FORMAT,
            "fingerprint": self._fingerprint(),
            "epoch": self._epoch,
            "position": [self._k, self._j],
            "emitted": self._emitted,
            "rng": self._rng.bit_generator.state,
            "filled": len(live),
            "draining": self._drain is not None,
            "buffer_shard": self._src_shard[live].tolist(),
            "buffer_row": self._src_row[live].tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume exactly where `state_dict()` was taken (same source, seed, rank, filters and buffer size): the
        buffer's rows are read again from their shards (whole rank slices of the shards they came from)."""
        if state.get("format") != STATE_FORMAT:
            raise LoaderConfigError(f"state format {state.get('format')!r} is not {STATE_FORMAT!r}")
        if state.get("fingerprint") != self._fingerprint():
            raise LoaderConfigError("state was taken from a loader with another source, seed, rank, layers, filters "
                                    "or buffer size; build the loader with the same arguments")  # fmt: skip
        for future in self._futures.values():
            future.cancel()
        self._futures.clear()
        self._reset(int(state["epoch"]))
        self._k, self._j = (int(x) for x in state["position"])
        self._emitted = int(state["emitted"])
        self._rng.bit_generator.state = state["rng"]
        self._current = None
        shards = np.asarray(state["buffer_shard"], dtype=np.int32)
        rows = np.asarray(state["buffer_row"], dtype=np.int64)
        self._filled = len(shards)
        if state.get("draining"):
            self._drain = np.arange(self._filled)
        self._src_shard[: self._filled] = shards
        self._src_row[: self._filled] = rows
        for shard in np.unique(shards):
            slots = np.flatnonzero(shards == shard)
            fetched = self._fetch(int(shard))
            local = rows[slots] - fetched.lo
            _put_rows(self._buffer, slots, _layer_rows(fetched.data, local))
            if self._tokens is not None:
                self._tokens[slots] = fetched.token_ids[local]

    # -- epochs and the stream ----------------------------------------------------------------------------------

    def _fingerprint(self) -> str:
        described = repr((self.seed, self.rank, self.world_size, self.outputs, self.capacity, self.shuffle,
                          self.batch_size, self.filter, [ref.url for ref in self.shards]))  # fmt: skip
        return hashlib.sha256(described.encode()).hexdigest()[:16]

    def _reset(self, epoch: int) -> None:
        self._epoch = epoch
        self._k = 0  # position in this epoch's shard order
        self._j = 0  # kept rows of that shard already taken
        self._emitted = 0
        self._current: _ShardRows | None = None
        self._rng = np.random.default_rng([self.seed, epoch, self.rank, 1])
        if not hasattr(self, "_buffer"):
            self._buffer = np.empty((self.capacity, *self._row_shape), dtype=self._raw)
            self._src_shard = np.zeros(self.capacity, dtype=np.int32)
            self._src_row = np.zeros(self.capacity, dtype=np.int64)
            self._tokens = np.zeros(self.capacity, dtype=np.int32) if self.return_token_ids else None
        self._filled = 0
        # At the epoch's end the buffer leaves in one random permutation of its slots, `_drained` of them gone.
        self._drain: np.ndarray | None = None
        self._drained = 0

    def _live_slots(self) -> np.ndarray:
        """The buffer's slots that hold rows not yet emitted: in leaving order while it drains."""
        if self._drain is not None:
            return self._drain[self._drained :]
        return np.arange(self._filled)

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            n = len(self.shards)
            order = np.random.default_rng([self.seed, epoch, 0]).permutation(n) if self.shuffle else np.arange(n)
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = order
        return self._orders[epoch]

    def _stream_ended(self) -> bool:
        return self._k >= len(self.shards)

    def _upcoming(self) -> Iterator[tuple[int, int]]:
        """(epoch, k) of the shards after the current one, as far as `readahead` reaches."""
        epoch, k = self._epoch, self._k
        for _ in range(self.readahead):
            k += 1
            if k >= len(self.shards):
                epoch, k = epoch + 1, 0
                if self.epochs is not None and epoch >= self.epochs:
                    return
            yield epoch, k

    def _shard_rows(self) -> _ShardRows:
        """The shard at the current position, fetched (or taken from the read-ahead), with read-ahead topped up."""
        if self._current is None:
            key = (self._epoch, self._k)
            future = self._futures.pop(key, None)
            if future is None:
                future = self._fetcher.submit(self._fetch, int(self._order(self._epoch)[self._k]))
            self._current = future.result()
        for key in self._upcoming():
            if key not in self._futures:
                self._futures[key] = self._fetcher.submit(self._fetch, int(self._order(key[0])[key[1]]))
        return self._current

    def _take(self, limit: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray | None] | None:
        """Up to `limit` next rows of the stream from one shard: (each layer's rows [m, d], shard ids, rows in
        shard, token ids); None once the epoch's stream has ended."""
        while not self._stream_ended():
            current = self._shard_rows()
            if self._j < len(current.kept):
                picked = current.kept[self._j : self._j + limit]
                self._j += len(picked)
                rows = _layer_rows(current.data, picked)
                tokens = current.token_ids[picked] if self.return_token_ids else None
                return rows, np.full(len(picked), current.shard, np.int32), current.lo + picked, tokens
            self._k, self._j, self._current = self._k + 1, 0, None
        return None

    # -- reading one shard --------------------------------------------------------------------------------------

    def _fetch(self, shard: int, every_rank: bool = False) -> _ShardRows:
        """This rank's rows (or every rank's) of the selected layers of one shard, and the rows the filters keep."""
        ref = self.shards[shard]
        header = read_header(ref.url, self._reader)
        self._check_matches(ref, header)
        n = header.num_tokens
        lo, hi = (0, n) if every_rank else (n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size)
        data: list[np.ndarray] = []
        reads: list[Future[None]] = []
        for output in self.outputs:
            start, end = header.output(output).rows(lo, hi)
            if is_remote(ref.url):
                data.append(np.empty((hi - lo, self.hidden_size), dtype=self._raw))
                reads += self._read_rows(ref.url, start, data[-1])
            else:
                data.append(self._reader.map_local(ref.url, start, end - start).view(self._raw).reshape(hi - lo, self.hidden_size))
        token_ids = offsets = None
        if self.filter.needs_token_ids or self.return_token_ids:
            token_ids = np.empty(hi - lo, dtype=np.int32)
            reads += self._read_rows(ref.url, header.tensor("token_ids").rows(lo, hi)[0], token_ids)
        if self.filter.needs_offsets:
            spec = header.tensor("offsets")
            offsets = np.empty(spec.shape, dtype=np.int64)
            reads += self._read_rows(ref.url, spec.start, offsets)
        for read in reads:
            read.result()
        return _ShardRows(shard, lo, data, token_ids, self.filter.kept(lo, hi, token_ids, offsets))

    def _read_rows(self, url: str, start: int, out: np.ndarray) -> list[Future[None]]:
        """Parallel ranged reads of `out.nbytes` bytes at `start` into `out`, in parts of about `part_bytes`."""
        flat = out.reshape(-1).view(np.uint8)
        step = max(out.itemsize * (out.shape[-1] if out.ndim > 1 else 1), self.part_bytes)
        step -= step % (out.itemsize * (out.shape[-1] if out.ndim > 1 else 1))
        return [
            self._io.submit(self._reader.read_into, url, start + offset, flat[offset : offset + step])
            for offset in range(0, len(flat), step)
        ]

    def _check_matches(self, ref: ShardRef, header: ShardHeader) -> None:
        for output in self.outputs:
            spec = header.output(output)
            if spec.shape[1:] != (self.hidden_size,) or spec.dtype != self.stored_dtype:
                raise ActivationsError(f"shard {ref.url}: {output_key(output)} is {spec.dtype} {list(spec.shape)}, unlike "
                                       f"the first shard's {self.stored_dtype} [n, {self.hidden_size}]; read shards of "
                                       "one job together")  # fmt: skip

    # -- batches ------------------------------------------------------------------------------------------------

    def _next_rows(self) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The next batch as stored bits, [m, layers, d], with its token ids; None when the last epoch ends."""
        while self.epochs is None or self._epoch < self.epochs:
            parts, tokens = self._fill_batch()
            if parts and (not self.drop_last or sum(len(p) for p in parts) == self.batch_size):
                self._emitted += 1
                rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
                if tokens is not None:
                    tokens = tokens[0] if len(tokens) == 1 else np.concatenate(tokens)
                return rows, tokens
            self._reset(self._epoch + 1)  # this epoch's stream and buffer are used up
        return None

    def _fill_batch(self) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        parts: list[np.ndarray] = []
        tokens: list[np.ndarray] | None = [] if self.return_token_ids else None
        need = self.batch_size
        while need > 0:
            if not self.shuffle:
                piece = self._take(need)
                if piece is None:
                    break
                batch = np.empty((len(piece[1]), *self._row_shape), dtype=self._raw)
                _put_rows(batch, slice(None), piece[0])  # a copy: a batch never pins its shard in memory
                parts.append(batch)
                if tokens is not None:
                    tokens.append(piece[3])
                need -= len(batch)
                continue
            if not self._stream_ended() and self._filled < self.capacity:
                piece = self._take(self.capacity - self._filled)
                if piece is not None:
                    self._place(np.arange(self._filled, self._filled + len(piece[1])), piece)
                    self._filled += len(piece[1])
                continue
            if not self._stream_ended():
                piece = self._take(need)
                if piece is None:
                    continue
                slots = self._rng.choice(self.capacity, len(piece[1]), replace=False)
                self._emit(slots, parts, tokens)
                self._place(slots, piece)
                need -= len(slots)
                continue
            # The epoch's stream has ended: the buffer leaves in one random order, each row read once, none moved.
            if self._drain is None:
                self._drain = self._rng.permutation(self._filled)
            if self._drained == len(self._drain):
                break
            slots = self._drain[self._drained : self._drained + need]
            self._emit(slots, parts, tokens)
            self._drained += len(slots)
            need -= len(slots)
        return parts, tokens

    def _place(self, slots: np.ndarray, piece: tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray | None]) -> None:
        layer_rows, shards, source_rows, tokens = piece
        _put_rows(self._buffer, slots, layer_rows)
        self._src_shard[slots] = shards
        self._src_row[slots] = source_rows
        if self._tokens is not None:
            self._tokens[slots] = tokens

    def _emit(self, slots: np.ndarray, parts: list[np.ndarray], tokens: list[np.ndarray] | None) -> None:
        parts.append(self._buffer[slots])
        if tokens is not None:
            tokens.append(self._tokens[slots])

    # -- output -------------------------------------------------------------------------------------------------

    def _normalisation(self, stats: dict[Output, LayerStats] | None) -> tuple[np.ndarray, np.ndarray]:
        """(shift [outputs, d], scale [outputs, d]) such that the output is (x - shift) * scale."""
        stats = stats or self.stats()
        missing = [output_key(o) for o in self.outputs if o not in stats]
        if missing:
            raise LoaderConfigError(f"normalize={self.normalize!r}: no statistics for {missing}")
        shift = np.zeros((len(self.outputs), self.hidden_size), np.float32)
        scale = np.ones((len(self.outputs), self.hidden_size), np.float32)
        for i, output in enumerate(self.outputs):
            layer_stats = stats[output]
            if self.normalize == "mean_norm":
                scale[i] = math.sqrt(self.hidden_size) / max(layer_stats.mean_norm, 1e-12)
            else:
                shift[i] = layer_stats.mean
                scale[i] = 1.0 / np.maximum(layer_stats.std, 1e-6)
        return shift, scale

    def stats(self) -> dict[Output, LayerStats]:
        """Statistics of every stored token of each selected output (keyed by hidden-state index or hook point): the
        job index's when tools/merge.py wrote them (a queue source), else summed from the shards' own (two small
        ranged reads per shard)."""
        source = self.source if isinstance(self.source, str) else None
        index_url = queue_index_url(source, self._client) if source else None
        if index_url is not None:
            recorded = read_index(index_url, self._client).get("stats") or {}
            if all(output_key(o) in recorded for o in self.outputs):
                return {o: LayerStats.from_json(recorded[output_key(o)], f"index {index_url} stats")
                        for o in self.outputs}  # fmt: skip
        return sum_stats(self.shards, self._reader)

    def kept_stats(self, shards: int | None = None) -> dict[Output, LayerStats]:
        """Statistics of the rows the token filters keep, to pass as `stats=` to a loader with the same filters.

        The stored statistics cover every token. A filter that drops tokens unlike the rest changes the mean norm:
        a document's first position holds an attention sink whose norm is many times the others'. This reads the
        selected layers of every shard once (every rank's rows, so that all ranks normalise alike); `shards=N`
        reads N shards spread evenly over the job instead, an estimate at N shards' cost."""
        count = len(self.shards)
        if shards is None or shards >= count:
            picks = list(range(count))
        else:
            picks = sorted({round(x) for x in np.linspace(0, count - 1, max(1, shards))})
        totals = {output: LayerStats.zeros(self.hidden_size) for output in self.outputs}
        ahead = self.readahead + 1  # shards read at once, as the stream reads them
        pending = collections.deque(self._fetcher.submit(self._fetch, shard, True) for shard in picks[:ahead])
        for following in picks[ahead:] + [None] * len(pending):
            rows = pending.popleft().result()
            if following is not None:
                pending.append(self._fetcher.submit(self._fetch, following, True))
            for i, output in enumerate(self.outputs):
                totals[output].add(LayerStats.of(rows.data[i][rows.kept].view(self.stored_dtype)))
        return totals

    def _convert(self, rows: np.ndarray, tokens: np.ndarray | None) -> Any:
        rows = rows.view(self.stored_dtype)
        if self._norm is not None or rows.dtype != self.dtype:
            wide = as_float32(rows)
            if self._norm is not None:
                shift, scale = self._norm
                if self.normalize == "standardize":
                    wide = wide - shift
                wide = wide * scale
            rows = wide.astype(self.dtype, copy=False)
        if len(self.outputs) == 1:
            rows = rows[:, 0]
        out = _to_framework(rows, self.output, self.device)
        if not self.return_token_ids:
            return out
        return out, _to_framework(tokens, self.output, self.device)


def _selected(header: ShardHeader, layers: int | Output | Sequence[Output] | None, site: str) -> tuple[Output, ...]:
    """The outputs `layers` and `site` select (every one of `site` when `layers` is None), each checked to be in the
    shards."""
    if layers is None:
        chosen = [o for o in header.outputs if (isinstance(o, int) if site == HIDDEN else getattr(o, "site", "") == site)]
    else:
        given = [layers] if isinstance(layers, (int, HookPoint)) else list(layers)
        chosen = [o if isinstance(o, HookPoint) else as_output(o, site) for o in given]
    missing = [output_key(o) for o in chosen if o not in header.outputs]
    if missing or not chosen:
        held = ", ".join(map(output_key, header.outputs))
        raise LoaderConfigError(f"layers {[output_key(o) for o in chosen]} at site={site!r}: {missing or 'none'} not "
                                f"in the shards, which hold {held}")  # fmt: skip
    return tuple(chosen)


def _layer_rows(data: list[np.ndarray], picked: np.ndarray) -> list[np.ndarray]:
    """Rows `picked` (sorted) of each of a shard's layers: views when they are consecutive (the caller's copy
    into the buffer or the batch is then the only one), else one gathered copy per layer."""
    if picked[-1] - picked[0] == len(picked) - 1:
        return [layer[picked[0] : picked[-1] + 1] for layer in data]
    return [np.take(layer, picked, axis=0) for layer in data]


def _put_rows(target: np.ndarray, slots: Any, layer_rows: list[np.ndarray]) -> None:
    """target[slots] = the rows, as [m, layers, d]: layer by layer, so that several layers are not stacked into
    a copy first (2.5 times faster for two layers than assigning a stacked array)."""
    if len(layer_rows) == 1:
        target[slots] = layer_rows[0][:, None, :]
        return
    for i, rows in enumerate(layer_rows):
        target[slots, i] = rows


def _to_framework(array: np.ndarray, output: str, device: Any) -> Any:
    if output == "numpy":
        return array
    if output == "torch":
        import torch

        if array.dtype == numpy_dtype("bfloat16"):  # torch reads no ml_dtypes array: reinterpret the bits
            tensor = torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor if device is None else tensor.to(device, non_blocking=True)
    import jax

    return jax.device_put(array, device)

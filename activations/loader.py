"""A streaming, shuffled loader of activation shards: a queue, bucket or directory in, `[batch, d]` batches out.

This module holds the epochs and the stream; fetching and decoding a shard's rows is activations/fetch.py's, the
shuffle buffer's slots activations/slots.py's, its one-copy row moves activations/shuffle.py's, and normalisation
activations/normalise.py's.

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
   `token_ids`, `positions` or `offsets` when a filter or `return_token_ids`/`return_positions` needs them). gs://:
   cut into parts of `part_bytes` read in parallel by `threads` I/O threads, the object store's ranged GETs, each
   part copied once from the response into the shard's array. Local files: the rows' byte range is mapped (mmap,
   faulted in by the fetching thread), so rows are copied once, from the page cache into the batch. `readahead`
   shards are fetched ahead of the one being consumed, across epoch boundaries. With `cache_dir`, fetched gs://
   ranges are kept on local disk (least recently used ranges deleted beyond `cache_bytes`).
4. **Token filters.** `drop_token_ids`, `drop_first` (the first k positions of every document) and `positions`
   (keep positions lo <= p < hi of every document) select the rows that enter the stream. A position is the token's
   place in its document: a sampled shard (a job with `token_sample`/`drop_first`) stores it (`positions`, read for
   these filters in place of `offsets`), so the filters mean the same on sampled and unsampled shards. A shard whose
   metadata records sampling but holds no `positions` is refused, naming it (activations.format.check_sampled).
5. **Shuffle buffer.** With `shuffle_tokens=C`, the first C rows of the stream fill a buffer; then each step takes
   the next `batch_size` rows of the stream, puts them into C distinct slots drawn uniformly at random, and emits the
   rows those slots held, as the batch. At the end of an epoch's stream the buffer drains in random order. Within a
   batch, rows are grouped by the shard they came from (shards in the epoch's order, a shard's rows in the order
   their slots were drawn): see "Rows stay in their shards" below. See docs/TRAINING.md ("Mixing") for what this
   gives: a row stays in the buffer a geometric number of steps with mean C / batch_size, so two tokens of one
   document, which enter together, leave on average about C rows apart.
6. **Output.** numpy, torch or JAX arrays in `dtype`, optionally normalised with the statistics the writer stored
   (`normalize="mean_norm"`: x · sqrt(d) / E‖x‖ as SAELens's `expected_average_only_in` does it; `"standardize"`:
   (x - mean) / std per dimension), with no estimation pass. `return_token_ids=True` adds each row's token id;
   `return_positions=True` adds its token id and its position in its document (the shard's `positions` for a
   sampled job, its offset in its document otherwise).

Rows stay in their shards. A buffer slot holds where its row is, not a copy of it: the shard's rows, as read (a local
shard's mapped pages, a remote one's array), stay held while their rows may still be in the buffer, and each batch
is gathered straight from them, one `np.take` per shard. So a row is copied once, from where it was read into the
batch: a buffer of copies would copy it twice (into its slot, then into the batch), and on one core those two copies
are most of the loader's CPU (docs/TRAINING.md, "Speed"). A shard is held until `hold` x C rows have been emitted
after its last one entered the buffer; the rows of it still in the buffer then (a fraction of about e^-hold) are
copied into their slots of a buffer of copies (the spill), and the shard is dropped. Emitting each shard's rows with
one gather is why a batch's rows come grouped by shard: in draw order, they would have to be gathered first and
copied again. The batch is the same set of rows either way (the same slots, drawn with the same random state), and
which rows are in the spill changes nothing emitted: rows are grouped by the shard they came from, wherever they are.

Memory bound (`memory_bound_bytes`): the shards' rows held for the buffer (about `hold` x C rows, and the shard that
straddles that boundary) and `readahead + 1` shards' selected rows for this rank, the spill (C × layers × d in the
stored dtype), and two output batches. A local shard's held rows are mappings of its file, the page cache's pages,
which the kernel may reclaim (and read again when they are gathered), not the process's own memory.

Batches are assembled in the caller's thread (numpy's gathers release the GIL), so `state_dict()` always describes
the position after the last batch returned. A batch is assembled in place: each row is copied once into it (from
its shard or the spill), rows move as opaque records (one memcpy each), and the array is one an earlier batch used
once nothing holds that batch any more (`shuffle.ReusedArrays`), so the kernel does not zero fresh pages for every batch;
float32 output is widened into reused arrays the same way.

Resume: a `state_dict()` lists, for every row in the buffer, the shard and row it came from; `load_state_dict()`
reads those shards back (`readahead + 1` at a time) and copies each row into its slot of the spill. The rows of one
shard come in slot order, not row order, so nothing here assumes a shard's picked rows are sorted: `shuffle.copy_rows`
checks for a run of consecutive rows before it copies one (tests/activations/test_loader_resume.py resumes from every
checkpoint).
"""

from __future__ import annotations

import collections
import hashlib
import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from activations import shuffle as row_moves
from activations.fetch import ShardFetcher, ShardRows, TokenFilter, naming, selected
from activations.format import HIDDEN, HookPoint, LayerStats, Output, numpy_dtype, output_key
from activations.io import ActivationsError, ByteReader, LoaderConfigError, RangeCache
from activations.normalise import NORMALIZATIONS, normalisation, normalise, stored_stats
from activations.reader import ShardRef, read_header, resolve_shards
from activations.shuffle import ReusedArrays, copy_rows, records, run_of, stable_order
from activations.slots import Slots

__all__ = ["ActivationLoader", "LoaderConfigError", "NORMALIZATIONS", "OUTPUTS", "STATE_FORMAT", "TokenFilter"]

STATE_FORMAT = "activations-loader/v1"
OUTPUTS = ("numpy", "torch", "jax")


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
        return_positions: bool = False,
        hold: float = 3.0,
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
        if not hold >= 0:
            raise LoaderConfigError(f"hold must be at least 0 (buffers of rows a shard is held for), got {hold}")
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
        self.return_positions = return_positions
        self._labels = return_token_ids or return_positions  # token ids travel with the rows
        self.hold = float(hold)
        self.readahead = max(0, readahead)
        self.part_bytes = max(1 << 16, part_bytes)
        self._client = client
        self._reader = ByteReader(client, RangeCache(cache_dir, cache_bytes) if cache_dir else None)

        self.shards: list[ShardRef] = resolve_shards(source, client)
        if not self.shards:
            raise ActivationsError(f"{source}: no shards found")
        first = read_header(self.shards[0].url, self._reader)
        with naming(self.shards[0].url):
            self.outputs = selected(first, layers, site)
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
        # fp8 shards: a row travels as its d bytes of e4m3 followed by the 4 bytes of its float32 scale
        # (`ShardFetcher._fp8_rows`), so that the buffer moves it like any other row; `ShardFetcher.decode` multiplies
        # them out.
        self._scaled = first.scale(self.outputs[0]) is not None
        if self._scaled:
            self._row_shape = (len(self.outputs), self.hidden_size + 4)
        self._first_tokens = first.num_tokens
        self._norm = normalisation(normalize, self.outputs, self.hidden_size, stats or self.stats()) if normalize else None

        self._fetching = ShardFetcher(self.shards, self._reader, self.outputs, self.hidden_size, self.stored_dtype,
                                      self._scaled, self.filter, rank, world_size, self._labels, return_positions,
                                      self.part_bytes, threads)  # fmt: skip
        self._fetcher = ThreadPoolExecutor(max_workers=max(1, self.readahead), thread_name_prefix="loader-shard")
        self._futures: dict[tuple[int, int], Future[ShardRows]] = {}
        self._orders: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self._batches = ReusedArrays((batch_size, *self._row_shape), self._raw)
        self._widened = ReusedArrays((batch_size, len(self.outputs), self.hidden_size), np.dtype(np.float32))
        # float32 batches of one output are widened as they are gathered, a chunk of rows at a time (`_put`).
        self._fused = (len(self.outputs) == 1 and not self._scaled and self.dtype == np.float32
                       and self.stored_dtype in (numpy_dtype("bfloat16"), np.dtype(np.float16)))  # fmt: skip
        layer_bytes = self._row_shape[1] * self._raw.itemsize
        self._chunk = np.empty(max(1, row_moves.CHUNK_BYTES // layer_bytes), dtype=np.dtype((np.void, layer_bytes)))
        # The same bytes as stored values [rows, 1, d], what `_put` widens from.
        self._chunk_values = self._chunk.view(self._raw).reshape(len(self._chunk), 1, -1).view(self.stored_dtype)
        self._reset(epoch=0)

    # -- public API ---------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        batch = self._next_rows()
        if batch is None:
            raise StopIteration
        return self._convert(*batch)

    def __enter__(self) -> "ActivationLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for future in self._futures.values():
            future.cancel()
        self._futures.clear()
        self._fetcher.shutdown(wait=True)
        self._fetching.close()

    def memory_bound_bytes(self) -> int:
        """Bytes the loader holds at most (see the module docstring); the largest shard is taken from the source's
        records (index or done markers) when they give token counts, else from the first shard. A local shard's
        held rows are counted although they are the page cache's (mapped), not the process's own."""
        known = [ref.tokens for ref in self.shards if ref.tokens is not None]
        tokens = max(known) if known else self._first_tokens
        row = len(self.layers) * self._row_shape[1] * self._raw.itemsize
        shard = (tokens // self.world_size + 1) * (row + 8)
        held = math.ceil(self.hold * self.capacity) * (row + 8) + shard if self.capacity else 0
        per_slot = row + 4 + 8 + 4 + 8 + 4 + 4  # the spill's row; group, row, source, where; token id, position
        batch = self.batch_size * len(self.layers) * self.hidden_size * max(self.dtype.itemsize, 4)
        return (self.readahead + 1) * shard + held + self.capacity * per_slot + 2 * (batch + self.batch_size * row)

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
            "buffer_shard": self._order(self._epoch)[self._slots.group[live]].tolist(),
            "buffer_row": (self._lo_of[self._slots.group[live]] + self._slots.local[live]).tolist(),
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
        if len(shards) != len(rows) or len(shards) > self.capacity:
            raise LoaderConfigError(f"state lists {len(shards)} shards and {len(rows)} rows for a buffer of "
                                    f"{self.capacity}; it is damaged: resume from another checkpoint")  # fmt: skip
        if len(shards) and not 0 <= shards.min() <= shards.max() < len(self.shards):
            raise LoaderConfigError(f"state names shard {int(shards.max())} of {len(self.shards)}; it is damaged")
        self._filled = len(shards)
        if state.get("draining"):
            self._drain = np.arange(self._filled)
        place_in_order = np.empty(len(self.shards), dtype=np.int32)
        place_in_order[self._order(self._epoch)] = np.arange(len(self.shards), dtype=np.int32)
        self._slots.group[: self._filled] = place_in_order[shards]
        self._slots.source[: self._filled] = -1  # every row is read back into its slot of the spill
        self._slots.where[: self._filled] = np.arange(self._filled)
        # The slots a shard refills are in buffer order, so its rows come in any order: `copy_rows` checks for a
        # run of consecutive rows instead of assuming one (#26: rows {5, 3, 4} were read as 3, 4, 5).
        distinct = [int(shard) for shard in np.unique(shards)]
        for fetched in self._fetch_in_turn(distinct):
            slots = np.flatnonzero(shards == fetched.shard)
            local = rows[slots] - fetched.lo
            self._lo_of[place_in_order[fetched.shard]] = fetched.lo
            self._slots.local[slots] = local
            if len(local) and not 0 <= local.min() <= local.max() < len(fetched.data[0]):
                raise LoaderConfigError(f"state names rows {rows[slots].min()}..{rows[slots].max()} of shard "
                                        f"{fetched.url}, outside this rank's rows {fetched.lo}.."
                                        f"{fetched.lo + len(fetched.data[0]) - 1}; it is damaged")  # fmt: skip
            for target, source in zip(self._slots.spill_layers, fetched.records):
                copy_rows(target, slots, source, local)
            self._slots.copy_labels(slots, fetched, local)

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
        self._current: ShardRows | None = None
        self._rng = np.random.default_rng([self.seed, epoch, self.rank, 1])
        if not hasattr(self, "_slots"):
            self._slots = Slots(self.capacity, self.batch_size, self._row_shape, self._raw, self._labels,
                                self.return_positions)  # fmt: skip
        self._filled = 0
        # At the epoch's end the buffer leaves in one random permutation of its slots, `_drained` of them gone.
        self._drain: np.ndarray | None = None
        self._drained = 0
        # Shards whose rows may be in the buffer, by place in the epoch's order; when each one's last row entered
        # (rows emitted so far, `_rows_out`), for those the stream has left.
        self._held: dict[int, ShardRows] = {}
        self._ended: dict[int, int] = {}
        self._rows_out = 0
        self._lo_of = np.zeros(len(self.shards), dtype=np.int64)  # by place: the first row of this rank's slice

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

    def _shard_rows(self) -> ShardRows:
        """The shard at the current position, fetched (or taken from the read-ahead), with read-ahead topped up."""
        if self._current is None:
            key = (self._epoch, self._k)
            future = self._futures.pop(key, None)
            if future is None:
                future = self._fetcher.submit(self._fetching.fetch, int(self._order(self._epoch)[self._k]))
            self._current = future.result()
        for key in self._upcoming():
            if key not in self._futures:
                self._futures[key] = self._fetcher.submit(self._fetching.fetch, int(self._order(key[0])[key[1]]))
        return self._current

    def _take(self, limit: int) -> tuple[ShardRows, np.ndarray] | None:
        """Up to `limit` next rows of the stream, from one shard: (the shard's rows, the picked indices into them,
        increasing); None once the epoch's stream has ended. With the shuffle, a shard the stream reads is held
        (`_held`) and, once the stream leaves it, stamped with the rows emitted so far (`_ended`)."""
        while not self._stream_ended():
            current = self._shard_rows()
            if self._j < len(current.kept):
                picked = current.kept[self._j : self._j + limit]
                if self.shuffle:
                    self._held[self._k] = current
                    self._lo_of[self._k] = current.lo
                self._j += len(picked)
                return current, picked
            if self._k in self._held:
                self._ended[self._k] = self._rows_out
            self._k, self._j, self._current = self._k + 1, 0, None
        return None

    # -- reading shards ------------------------------------------------------------------------------------------

    def _fetch_in_turn(self, shards: Sequence[int], every_rank: bool = False) -> Iterator[ShardRows]:
        """The shards' rows in order, `readahead + 1` fetched at once (as the stream reads them), each dropped by the
        caller before the next but `readahead` are read."""
        ahead = self.readahead + 1
        pending = collections.deque(self._fetcher.submit(self._fetching.fetch, shard, every_rank) for shard in shards[:ahead])
        for following in [*shards[ahead:], *[None] * len(pending)]:
            fetched = pending.popleft().result()
            if following is not None:
                pending.append(self._fetcher.submit(self._fetching.fetch, following, every_rank))
            yield fetched

    # -- batches ------------------------------------------------------------------------------------------------

    def _next_rows(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None:
        """The next batch as stored bits, [m, layers, d], with its token ids and positions (when asked for); None
        when the last epoch ends."""
        while self.epochs is None or self._epoch < self.epochs:
            rows, tokens, positions, count = self._fill_batch()
            if count and (not self.drop_last or count == self.batch_size):
                self._emitted += 1
                return rows[:count], *(None if labels is None else labels[:count] for labels in (tokens, positions))
            self._reset(self._epoch + 1)  # this epoch's stream and buffer are used up
        return None

    def _fill_batch(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, int]:
        """A batch assembled in place: (rows [batch_size, layers, d], token ids, positions, how many rows were
        filled). Each row is copied once into it: from its shard (held, or straight from the stream when there is
        no shuffle) or from the spill. With the shuffle, the steps only note which rows leave (`Slots.leave`); the batch
        is gathered once they are all known (`_gather`), and shards the buffer no longer needs are let go after."""
        batch = self._widened.take() if self._fused else self._batches.take()
        tokens = np.empty(self.batch_size, dtype=np.int32) if self._labels else None
        positions = np.empty(self.batch_size, dtype=np.int32) if self.return_positions else None
        count = 0
        while count < self.batch_size:
            need = self.batch_size - count
            if not self.shuffle:
                piece = self._take(need)
                if piece is None:
                    break
                source, picked = piece
                if len(self.layers) == 1:
                    run = run_of(picked)
                    self._put(batch, count, source.records[0], run if run is not None else picked)
                else:
                    for i, rows in enumerate(source.records):
                        copy_rows(records(batch[:, i]), slice(count, count + len(picked)), rows, picked)
                if tokens is not None:
                    tokens[count : count + len(picked)] = source.token_ids[picked]
                if positions is not None:
                    positions[count : count + len(picked)] = source.positions[picked]
                count += len(picked)
                continue
            if not self._stream_ended() and self._filled < self.capacity:
                piece = self._take(self.capacity - self._filled)
                if piece is not None:
                    self._slots.enter(np.arange(self._filled, self._filled + len(piece[1])), self._k, *piece)
                    self._filled += len(piece[1])
                continue
            if not self._stream_ended():
                piece = self._take(need)
                if piece is None:
                    continue
                slots = self._rng.choice(self.capacity, len(piece[1]), replace=False)
                self._slots.leave(slots, tokens, positions, count)
                self._slots.enter(slots, self._k, *piece)
                count += len(slots)
                continue
            # The epoch's stream has ended: the buffer leaves in one random order, each row read once, none moved.
            if self._drain is None:
                self._drain = self._rng.permutation(self._filled)
            if self._drained == len(self._drain):
                break
            slots = self._drain[self._drained : self._drained + need]
            self._slots.leave(slots, tokens, positions, count)
            self._drained += len(slots)
            count += len(slots)
        if self.shuffle and count:
            self._gather(batch, tokens, positions, count)
            self._rows_out += count
            if self._drain is None:  # while the buffer drains, no shard enters: they all go at the epoch's end
                self._let_go()
        return batch, tokens, positions, count

    def _gather(self, batch: np.ndarray, tokens: np.ndarray | None, positions: np.ndarray | None, count: int) -> None:
        """The batch's `count` rows, noted by `Slots.leave` in draw order, gathered grouped by the shard they came from
        (shards in the epoch's order, a shard's rows in draw order): one `np.take` per run of rows in one place (a
        held shard, or the spill) straight into the batch, so each row is copied once. Its labels are put in the
        same order."""
        order = stable_order(self._slots.out_group[:count])
        sources, rows = self._slots.out_source[:count][order], self._slots.out_row[:count][order]
        cuts = [0, *(np.flatnonzero(sources[1:] != sources[:-1]) + 1).tolist(), count]
        whole = None if self._fused else records(batch)
        for lo, hi, source in zip(cuts[:-1], cuts[1:], sources[cuts[:-1]].tolist()):
            if source >= 0 and len(self.layers) > 1:
                for i, layer in enumerate(self._held[source].records):
                    records(batch[:, i])[lo:hi] = layer[rows[lo:hi]]
                continue
            # Spilled rows are whole rows (every layer) at once; a held shard's, of its one layer.
            where = self._slots.spill_rows if source < 0 else self._held[source].records[0]
            if whole is not None:  # mode="clip": see _put
                np.take(where, rows[lo:hi], out=whole[lo:hi], mode="clip")
            else:
                self._put(batch, lo, where, rows[lo:hi])
        for labels in (tokens, positions):
            if labels is not None:
                labels[:count] = labels[:count][order]

    def _put(self, batch: np.ndarray, at: int, source: np.ndarray, picked: np.ndarray | slice) -> None:
        """Rows `picked` of `source` (whole rows as records) into the batch's rows from `at` on, each copied once.
        Stored bits: one gather straight into the batch (`np.take` with mode="clip": with the default, "raise",
        numpy gathers into a temporary and copies that into `out`; the rows are valid by construction, slots or rows
        of a held shard's slice). Widened to float32 (`_fused`): a cache-sized chunk at a time, gathered into
        `_chunk` and widened (and normalised) from there into the batch, so the stored bits never go through memory
        on their way; a run of consecutive rows is widened straight from where it is."""
        if isinstance(picked, slice):
            n = picked.stop - picked.start
            if self._fused:
                self._finish(source[picked], batch[at : at + n])
            else:
                records(batch)[at : at + n] = source[picked]
            return
        if not self._fused:
            np.take(source, picked, out=records(batch)[at : at + len(picked)], mode="clip")
            return
        chunk, values, step = self._chunk, self._chunk_values, len(self._chunk)
        for lo in range(0, len(picked), step):
            m = min(step, len(picked) - lo)
            np.take(source, picked[lo : lo + m], out=chunk[:m], mode="clip")
            out = batch[at + lo : at + lo + m]
            np.copyto(out, values[:m], casting="unsafe")
            if self._norm is not None:
                normalise(out, self._norm, self.normalize)

    def _finish(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Rows as records of the stored bits into `out`, float32 [m, 1, d]: widened exactly (a cast numpy runs
        without the GIL), then normalised in place while they are in cache."""
        stored = rows.view(self._raw).reshape(len(rows), 1, self.hidden_size).view(self.stored_dtype)
        np.copyto(out, stored, casting="unsafe")
        if self._norm is not None:
            normalise(out, self._norm, self.normalize)

    def _let_go(self) -> None:
        """Shards whose last row entered `hold` x C emitted rows ago: the rows of theirs still in the buffer are
        copied into their slots of the spill, and the shard is dropped (a fraction of about e^-hold of its rows:
        each emitted row leaves a given slot with probability 1/C)."""
        horizon = self.hold * self.capacity
        for place in [place for place, ended in self._ended.items() if self._rows_out - ended >= horizon]:
            held = self._held.pop(place)
            del self._ended[place]
            self._slots.spill_shard(place, held, self._filled, self._chunk)

    # -- output -------------------------------------------------------------------------------------------------
    def stats(self) -> dict[Output, LayerStats]:
        """Statistics of every stored token of each selected output (keyed by hidden-state index or hook point): the
        job index's when tools/merge.py wrote them (a queue source), else summed from the shards' own (two small
        ranged reads per shard)."""
        return stored_stats(self.source, self.shards, self.outputs, self._reader, self._client)

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
        for rows in self._fetch_in_turn(picks, every_rank=True):
            for i, output in enumerate(self.outputs):
                totals[output].add(LayerStats.of(self._fetching.decode(rows.data[i][rows.kept])))
        return totals

    def _convert(self, rows: np.ndarray, tokens: np.ndarray | None, positions: np.ndarray | None) -> Any:
        rows = rows if self._fused else self._fetching.decode(rows)  # fused: widened and normalised as it was gathered
        if not self._fused and (self._norm is not None or rows.dtype != self.dtype):
            wide = self._widen(rows)
            if self._norm is not None:
                normalise(wide, self._norm, self.normalize)
            rows = wide.astype(self.dtype, copy=False)
        if len(self.outputs) == 1:
            rows = rows[:, 0]
        out = _to_framework(rows, self.output, self.device)
        if positions is not None:
            return out, *(_to_framework(labels, self.output, self.device) for labels in (tokens, positions))
        if tokens is not None and self.return_token_ids:
            return out, _to_framework(tokens, self.output, self.device)
        return out

    def _widen(self, rows: np.ndarray) -> np.ndarray:
        """[m, outputs, d] rows as float32, in an array reused once nothing holds it (`ReusedArrays`): a fresh array
        of a batch's size would cost the kernel a pass zeroing its pages (58 MB at the 7B width). bfloat16 is the top
        half of a float32, so it widens exactly by an integer shift (which numpy runs without the GIL)."""
        if rows.dtype == np.float32:  # stored as float32 (the batch's own array), or fp8's product: normalised in place
            return rows
        wide = self._widened.take()[: len(rows)]
        np.copyto(wide, rows, casting="unsafe")  # exact from bfloat16 and float16
        return wide



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

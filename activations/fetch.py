"""Fetch and decode: this rank's rows of the selected outputs of one shard, read once, and the stored bits as values.

A shard's header comes first (one ranged read), then only the selected outputs' rows of this rank (and `token_ids`,
`positions` or `offsets` when a filter or the labels need them): gs:// in parts read in parallel, a local file mapped
(activations/loader.py, steps 3 and 4). fp8 rows travel with their scale (`ShardFetcher.decode` multiplies them out).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from activations.format import HIDDEN, POSITIONS, HookPoint, Output, ShardFormatError, ShardHeader, output_key
from activations.io import ActivationsError, ByteReader, LoaderConfigError, is_remote
from activations.reader import ShardRef, as_output, read_header
from activations.shuffle import records


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

    def kept(self, rows: int, token_ids: np.ndarray | None, positions: np.ndarray | None) -> np.ndarray:
        """Indices of the `rows` rows of a slice of a shard that are kept, given their token ids (when
        `needs_token_ids`) and their positions in their documents (when `needs_offsets`)."""
        keep = np.ones(rows, dtype=bool)
        if self.drop_token_ids:
            keep &= ~np.isin(token_ids, np.fromiter(self.drop_token_ids, dtype=np.int64))
        if self.needs_offsets:
            first, last = self.positions
            keep &= positions >= max(first, self.drop_first)
            if last is not None:
                keep &= positions < last
        return np.flatnonzero(keep)


def _row_positions(lo: int, hi: int, offsets: np.ndarray) -> np.ndarray:
    """Rows [lo, hi)'s positions in their documents when every position is stored (an unsampled shard)."""
    rows = np.arange(lo, hi, dtype=np.int64)
    return rows - offsets[np.searchsorted(offsets, rows, side="right") - 1]



@dataclasses.dataclass
class ShardRows:
    """This rank's rows of one shard, read once."""

    url: str
    shard: int  # index into the loader's shard list
    lo: int  # first absolute row of this rank's slice
    data: list[np.ndarray]  # per layer [hi - lo, d], the stored bits as unsigned integers of the stored width
    # (a local shard's are mappings of its file: the page cache's pages, not a copy)
    token_ids: np.ndarray | None  # [hi - lo]
    positions: np.ndarray | None  # [hi - lo] int32: each row's position in its document (when asked for)
    kept: np.ndarray  # int64 indices into the slice, in order
    records: list[np.ndarray] = dataclasses.field(init=False)  # per layer, `data`'s rows as opaque records

    def __post_init__(self) -> None:
        self.records = [records(layer) for layer in self.data]



class ShardFetcher:
    """Reads one shard's rows for a loader: its `outputs` (each `hidden_size` wide, `stored_dtype`, fp8 with a
    scale when `scaled`), this rank's slice of them, and the rows `token_filter` keeps; with `token_ids` and
    `positions`, those of each row too. `threads` I/O threads read parts of `part_bytes` at once."""

    def __init__(self, shards: list[ShardRef], reader: ByteReader, outputs: tuple[Output, ...], hidden_size: int,
                 stored_dtype: np.dtype, scaled: bool, token_filter: TokenFilter, rank: int, world_size: int,
                 token_ids: bool, positions: bool, part_bytes: int, threads: int):  # fmt: skip
        self.shards, self._reader, self.outputs = shards, reader, outputs
        self.hidden_size, self.stored_dtype, self._scaled = hidden_size, stored_dtype, scaled
        self._raw = np.dtype(f"u{stored_dtype.itemsize}")
        self.filter, self.rank, self.world_size = token_filter, rank, world_size
        self._labels, self.return_positions = token_ids, positions
        self.part_bytes = part_bytes
        self._io = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="loader-io")

    def close(self) -> None:
        self._io.shutdown(wait=True)

    def fetch(self, shard: int, every_rank: bool = False) -> ShardRows:
        """This rank's rows (or every rank's) of the selected layers of one shard, and the rows the filters keep.
        Every error names the shard."""
        with naming(self.shards[shard].url):
            return self._fetch_rows(shard, every_rank)


    def _fetch_rows(self, shard: int, every_rank: bool) -> ShardRows:
        ref = self.shards[shard]
        header = read_header(ref.url, self._reader)
        self._check_matches(ref, header)
        n = header.num_tokens
        lo, hi = (0, n) if every_rank else (n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size)
        data: list[np.ndarray] = []
        reads: list[Future[None]] = []
        joins: list[Callable[[], None]] = []
        for output in self.outputs:
            start, end = header.output(output).rows(lo, hi)
            if self._scaled:
                data.append(np.empty((hi - lo, self.hidden_size + 4), dtype=np.uint8))
                layer_reads, join = self._fp8_rows(ref.url, header, output, lo, hi, data[-1])
                reads += layer_reads
                joins.append(join)
            elif is_remote(ref.url):
                data.append(np.empty((hi - lo, self.hidden_size), dtype=self._raw))
                reads += self._read_rows(ref.url, start, data[-1])
            else:
                data.append(self._reader.map_local(ref.url, start, end - start).view(self._raw).reshape(hi - lo, self.hidden_size))
        token_ids = offsets = positions = None
        if self.filter.needs_token_ids or self._labels:
            token_ids = np.empty(hi - lo, dtype=np.int32)
            reads += self._read_rows(ref.url, header.tensor("token_ids").rows(lo, hi)[0], token_ids)
        needs_positions = self.filter.needs_offsets or self.return_positions
        if needs_positions and header.sampled:  # a sampled shard says where its tokens are (format.check_sampled)
            positions = np.empty(hi - lo, dtype=np.int32)
            reads += self._read_rows(ref.url, header.tensor(POSITIONS).rows(lo, hi)[0], positions)
        elif needs_positions:
            spec = header.tensor("offsets")
            offsets = np.empty(spec.shape, dtype=np.int64)
            reads += self._read_rows(ref.url, spec.start, offsets)
        for read in reads:
            read.result()
        for join in joins:
            join()
        if offsets is not None:
            if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != n or (np.diff(offsets) < 0).any():
                raise ShardFormatError(f"offsets {_ends(offsets)} do not cut its {n} tokens into documents")
            positions = _row_positions(lo, hi, offsets).astype(np.int32)
        kept = self.filter.kept(hi - lo, token_ids, positions)
        return ShardRows(ref.url, shard, lo, data, token_ids, positions if self.return_positions else None, kept)

    def _fp8_rows(
        self, url: str, header: ShardHeader, output: Output, lo: int, hi: int, out: np.ndarray
    ) -> tuple[list[Future[None]], Callable[[], None]]:
        """Reads of an fp8 output's rows [lo, hi) and their scales, and what puts them into `out` [hi - lo, d + 4]
        (uint8: each row's d bytes of e4m3, then its scale's 4 bytes) once they are done."""
        spec = header.scale(output)
        if spec is None:
            raise ActivationsError(f"shard {url}: {output_key(output)} has no per-token scale, unlike the first "
                                   "shard's; read shards of one job together")  # fmt: skip
        values = np.empty((hi - lo, self.hidden_size), dtype=np.uint8)
        scales = np.empty(hi - lo, dtype=np.float32)
        reads = self._read_rows(url, header.output(output).rows(lo, hi)[0], values)
        reads += self._read_rows(url, spec.rows(lo, hi)[0], scales)

        def join() -> None:
            out[:, : self.hidden_size] = values
            out[:, self.hidden_size :] = scales.view(np.uint8).reshape(-1, 4)

        return reads, join

    def decode(self, rows: np.ndarray) -> np.ndarray:
        """Raw rows [..., width] as the stored dtype, or (fp8) as float32: e4m3 values times their scale."""
        if not self._scaled:
            return rows.view(self.stored_dtype)
        scale = np.ascontiguousarray(rows[..., self.hidden_size :]).view(np.float32)
        return rows[..., : self.hidden_size].view(self.stored_dtype).astype(np.float32) * scale

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
            if spec.shape[0] != header.num_tokens:
                raise ShardFormatError(f"{output_key(output)} has {spec.shape[0]} rows, token_ids {header.num_tokens}")
            if spec.shape[1:] != (self.hidden_size,) or spec.dtype != self.stored_dtype:
                raise ActivationsError(f"shard {ref.url}: {output_key(output)} is {spec.dtype} {list(spec.shape)}, unlike "
                                       f"the first shard's {self.stored_dtype} [n, {self.hidden_size}]; read shards of "
                                       "one job together")  # fmt: skip


@contextlib.contextmanager
def naming(url: str) -> Iterator[None]:
    """A shard's format errors (which know the header, not where it came from) as errors that name the shard."""
    try:
        yield
    except ShardFormatError as exc:
        raise ActivationsError(f"shard {url}: {exc}") from exc



def selected(header: ShardHeader, layers: int | Output | Sequence[Output] | None, site: str) -> tuple[Output, ...]:
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


def _ends(array: np.ndarray) -> str:
    """A long array's ends, for an error message."""
    return str(array.tolist()) if len(array) <= 6 else f"[{array[0]}, {array[1]}, ..., {array[-2]}, {array[-1]}]"

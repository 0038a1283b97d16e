"""The shuffle buffer's slots: for each, where its row came from and where it is now (a held shard, or the spill).

A slot holds where its row is, not a copy of it (activations/loader.py, "Rows stay in their shards"). Per slot: its
row's shard, as its place in the epoch's order (the batch's grouping), and its row in that shard's slice for this
rank (with the loader's `_lo_of`, what a state lists); where the row is now: in the held shard of that place
(`source`, its row `where` there) or in the spill (`source` -1, its slot); its token id and position when asked for.
The spill holds copies of the rows whose shard is no longer held (and every row after a resume).
"""

from __future__ import annotations

import numpy as np

from activations.fetch import ShardRows
from activations.shuffle import records


class Slots:
    """The buffer's `capacity` slots, and the rows a batch of `batch_size` takes from them, in draw order, until it
    is gathered (its group, its source: a held shard's place in the order or -1, the spill; and its row there)."""

    def __init__(self, capacity: int, batch_size: int, row_shape: tuple[int, int], raw: np.dtype, labels: bool,
                 positions: bool) -> None:  # fmt: skip
        self.group = np.zeros(capacity, dtype=np.int32)
        self.local = np.zeros(capacity, dtype=np.int64)
        self.source = np.zeros(capacity, dtype=np.int32)
        self.where = np.zeros(capacity, dtype=np.int64)
        self.tokens = np.zeros(capacity, dtype=np.int32) if labels else None
        self.positions = np.zeros(capacity, dtype=np.int32) if positions else None
        # Rows move as opaque records (one memcpy each): whole to be emitted, a layer at a time to be copied in.
        self._spill = np.empty((capacity, *row_shape), dtype=raw)
        self.spill_rows = records(self._spill)
        self.spill_layers = [records(self._spill[:, i]) for i in range(row_shape[0])]
        self.out_group = np.zeros(batch_size, dtype=np.int32)
        self.out_source = np.zeros(batch_size, dtype=np.int32)
        self.out_row = np.zeros(batch_size, dtype=np.int64)

    def enter(self, slots: np.ndarray, place: int, source: ShardRows, picked: np.ndarray) -> None:
        """Rows `picked` of the held shard at `place` into `slots`: where they are, not copies of them."""
        self.group[slots] = self.source[slots] = place
        self.local[slots] = self.where[slots] = picked
        self.copy_labels(slots, source, picked)

    def copy_labels(self, slots: np.ndarray, source: ShardRows, picked: np.ndarray) -> None:
        if self.tokens is not None:
            self.tokens[slots] = source.token_ids[picked]
        if self.positions is not None:
            self.positions[slots] = source.positions[picked]

    def leave(self, slots: np.ndarray, tokens: np.ndarray | None, positions: np.ndarray | None, at: int) -> None:
        """The rows at `slots` leave as the batch's rows from `at` on: noted (group, source, row there), to be gathered
        by the loader's `_gather`, and their labels copied. A slot may be refilled, and even leave again, before the
        batch is gathered: its spill row and its held shard stay as they were until then (`spill_shard` runs after)."""
        end = at + len(slots)
        # mode="clip": see the loader's _gather; the slots are valid by construction (drawn from, or a permutation of,
        # the buffer's filled slots).
        np.take(self.group, slots, out=self.out_group[at:end], mode="clip")
        np.take(self.source, slots, out=self.out_source[at:end], mode="clip")
        np.take(self.where, slots, out=self.out_row[at:end], mode="clip")
        if tokens is not None:
            np.take(self.tokens, slots, out=tokens[at:end], mode="clip")
        if positions is not None:
            np.take(self.positions, slots, out=positions[at:end], mode="clip")

    def spill_shard(self, place: int, held: ShardRows, filled: int, chunk: np.ndarray) -> None:
        """The rows of the held shard at `place` still among the first `filled` slots, copied into their slots of the
        spill through `chunk` (a cache-sized buffer: no temporary of them all), so that the shard can be dropped."""
        slots = np.flatnonzero(self.source[:filled] == place)
        picked = self.where[slots]
        step = len(chunk)
        for target, rows in zip(self.spill_layers, held.records):
            for lo in range(0, len(slots), step):
                part = chunk[: min(step, len(slots) - lo)]
                np.take(rows, picked[lo : lo + len(part)], out=part, mode="clip")
                target[slots[lo : lo + len(part)]] = part
        self.source[slots], self.where[slots] = -1, slots

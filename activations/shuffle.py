"""The shuffle buffer's row moves: rows as opaque records, batch arrays reused, runs found, each row copied once.

A slot of the loader's buffer holds where its row is, not a copy (activations/loader.py, "Rows stay in their
shards"); these are the moves that gather rows from their shards or the spill into a batch in one copy.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


class ReusedArrays:
    """Arrays of one shape for batches, each reused once nobody else holds it.

    A fresh array of a batch's size (29 MB at the 7B width) costs the kernel a pass zeroing its pages, about as much
    as copying the rows into it. Whether anyone else still holds an array is its reference count: a view of it (the
    batch handed out is one), a torch tensor made by torch.from_numpy, a JAX array aliasing it, a buffer export,
    each holds a reference. So an array comes back only when every batch made from it is gone; a caller that keeps
    batches (a list of them) simply gets new arrays."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, keep: int = 2):
        self.shape, self.dtype, self.keep = shape, dtype, keep
        self._arrays: list[np.ndarray] = []
        self._alone = _references([object()], 0)  # an object only a list holds, counted the same way

    def take(self) -> np.ndarray:
        for i in range(len(self._arrays)):
            if _references(self._arrays, i) == self._alone:
                return self._arrays[i]
        array = np.empty(self.shape, dtype=self.dtype)
        if len(self._arrays) < self.keep:  # a loop holds the last batch while it asks for the next: 2 cover it
            self._arrays.append(array)
        return array


def _references(items: list[Any], i: int) -> int:
    return sys.getrefcount(items[i])


def records(rows: np.ndarray) -> np.ndarray:
    """[n, d] rows (each row contiguous; the rows may be strided) or a contiguous [n, layers, d] array, as a view of
    n opaque records of a row's bytes. numpy moves a record with one memcpy, where it copies a row of numbers
    element by element: gathering or scattering 7 KiB rows goes about 1.3-2 times faster as records."""
    if rows.ndim == 3:
        rows = rows.reshape(len(rows), rows.shape[1] * rows.shape[2])  # contiguous (the buffer, a batch): a view
    return rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize)))[:, 0]


def stable_order(keys: np.ndarray) -> np.ndarray:
    """np.argsort(keys, kind="stable"), by numpy's radix sort when the keys span fewer than 2^16 values (a batch's
    shards, nearly always): about 6 times faster on a batch's keys than its merge sort of int32."""
    if len(keys) and int(keys.max()) - int(keys.min()) < 1 << 16:
        low = keys.min()
        return np.argsort((keys - low).astype(np.uint16), kind="stable")
    return np.argsort(keys, kind="stable")


#: Bytes of rows gathered into the loader's chunk before they are widened: small enough to stay in a core's L2 cache.
CHUNK_BYTES = 256 << 10


def run_of(picked: np.ndarray) -> slice | None:
    """`picked` as a slice if it is a run of consecutive increasing indices, else None. Checked, not assumed: a
    resume refills slots in buffer order, whose rows come in any order (and {5, 3, 4} spans 3 rows too)."""
    n = len(picked)
    if n == 0 or picked[-1] - picked[0] != n - 1 or (n > 1 and (np.diff(picked) != 1).any()):
        return None
    return slice(int(picked[0]), int(picked[-1]) + 1)


def copy_rows(target: np.ndarray, at: np.ndarray | slice, source: np.ndarray, picked: np.ndarray) -> None:
    """target[at] = source[picked], for records (`records`), in one copy where numpy allows it: a run of
    consecutive rows is copied straight from the source; scattered rows into a contiguous slice are gathered into
    place; only scattered rows into scattered slots are gathered into a temporary first (a resume, a filter)."""
    run = run_of(picked)
    if run is not None:
        target[at] = source[run]
    elif isinstance(at, slice) and target.flags.c_contiguous:
        np.take(source, picked, out=target[at], mode="clip")  # `picked` is valid: see _emit for the mode
    else:
        target[at] = source[picked]

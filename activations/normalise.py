"""Normalisation: the shift and scale a loader's rows are normalised by, from the statistics the writer stored.

`mean_norm`: x · sqrt(d) / E‖x‖, as SAELens's `expected_average_only_in` does it; `standardize`: (x - mean) / std per
dimension. No estimation pass: the statistics are the job index's, or summed from the shards' own
(activations/loader.py, step 6).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from activations.format import LayerStats, Output, output_key
from activations.io import ByteReader, LoaderConfigError
from activations.reader import ShardRef, queue_index_url, read_index, sum_stats

NORMALIZATIONS = (None, "mean_norm", "standardize")


def normalisation(normalize: str, outputs: Sequence[Output], hidden_size: int,
                  stats: dict[Output, LayerStats]) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """(shift [outputs, d], scale [outputs, d]) such that the output is (x - shift) * scale."""
    missing = [output_key(o) for o in outputs if o not in stats]
    if missing:
        raise LoaderConfigError(f"normalize={normalize!r}: no statistics for {missing}")
    shift = np.zeros((len(outputs), hidden_size), np.float32)
    scale = np.ones((len(outputs), hidden_size), np.float32)
    for i, output in enumerate(outputs):
        layer_stats = stats[output]
        if normalize == "mean_norm":
            scale[i] = math.sqrt(hidden_size) / max(layer_stats.mean_norm, 1e-12)
        else:
            shift[i] = layer_stats.mean
            scale[i] = 1.0 / np.maximum(layer_stats.std, 1e-6)
    return shift, scale


def normalise(rows: np.ndarray, norm: tuple[np.ndarray, np.ndarray], normalize: str) -> None:
    """(rows - shift) * scale in place."""
    shift, scale = norm
    if normalize == "standardize":
        np.subtract(rows, shift, out=rows)
    np.multiply(rows, scale, out=rows)


def stored_stats(source: str | Sequence[str], shards: list[ShardRef], outputs: Sequence[Output], reader: ByteReader,
                 client: Any = None) -> dict[Output, LayerStats]:  # fmt: skip
    """Statistics of every stored token of each output: the job index's when merge wrote them (a queue source), else
    summed from the shards' own (two small ranged reads per shard)."""
    queue = source if isinstance(source, str) else None
    index_url = queue_index_url(queue, client) if queue else None
    if index_url is not None:
        recorded = read_index(index_url, client).get("stats") or {}
        if all(output_key(o) in recorded for o in outputs):
            return {o: LayerStats.from_json(recorded[output_key(o)], f"index {index_url} stats") for o in outputs}
    return sum_stats(shards, reader)

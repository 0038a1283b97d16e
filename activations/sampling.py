"""Which token positions a sampled job stores: a pure function of (seed, sample id, position).

A job may keep only a fraction of each document's positions (`token_sample`) and drop its first positions
(`drop_first`; a document's first tokens carry the attention sink). The forward pass still runs on whole documents;
only storage is sampled. Position `p` of the document with global sample id `s` is kept when

    p >= drop_first  and  u(seed, s, p) < token_sample,    u = splitmix64(splitmix64(splitmix64(seed) ^ s) ^ p) / 2^64

taken to 53 bits, so the comparison with the float `token_sample` is exact. Nothing else enters: not the batch, the
bucket, the packing, the padding, the task, the attempt or the machine, so a resumed task, a rerun or another
machine keeps exactly the same tokens, and a reader can recompute which positions a shard should hold.

splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014; the finaliser
of Java's SplittableRandom) is a bijection of 64-bit integers whose output bits each depend on every input bit, so
neighbouring positions and ids give independent-looking draws; it is written here in numpy, vectorised over a
document's positions.

Shards of a sampled job (`TokenSampling.active`) hold a `positions` tensor (int32, each stored token's position in
its document) and record the sampling in their metadata (`sampling`, JSON); see activations.format.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK = (1 << 64) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 output function of uint64 values (wrapping arithmetic), elementwise."""
    x = np.asarray(x, dtype=np.uint64) + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


@dataclasses.dataclass(frozen=True)
class TokenSampling:
    """The job's storage sampling: the fraction of positions kept, the first positions dropped, the seed."""

    fraction: float = 1.0
    drop_first: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"token_sample {self.fraction}: use a fraction in (0, 1]")
        if self.drop_first < 0 or not 0 <= self.seed <= _MASK:
            raise ValueError(f"drop_first {self.drop_first}, seed {self.seed}: use non-negative integers")

    @property
    def active(self) -> bool:
        """False when every position is stored: the shards are then exactly those of an unsampled job."""
        return self.fraction < 1.0 or self.drop_first > 0

    def draws(self, sample_id: int, n_tokens: int) -> np.ndarray:
        """u(seed, sample_id, p) for p in [0, n_tokens), as uint64 values below 2^53."""
        with np.errstate(over="ignore"):
            document = splitmix64(splitmix64(np.array([self.seed & _MASK], np.uint64)) ^ np.uint64(sample_id & _MASK))
            return splitmix64(document ^ np.arange(n_tokens, dtype=np.uint64)) >> np.uint64(11)

    def kept(self, sample_id: int, n_tokens: int) -> np.ndarray:
        """The positions of a document of `n_tokens` tokens that are stored, ascending (int64)."""
        if not self.active:
            return np.arange(n_tokens, dtype=np.int64)
        keep = self.draws(sample_id, n_tokens).astype(np.float64) < self.fraction * 2.0**53
        keep[: self.drop_first] = False
        return np.flatnonzero(keep)

    def expected_kept(self, n_tokens: float) -> float:
        """Mean positions stored of an `n_tokens`-token document."""
        return self.fraction * max(0.0, n_tokens - self.drop_first)

    def covered(self, n_tokens: float) -> float:
        """Probability that a document of `n_tokens` tokens keeps at least one position."""
        eligible = max(0.0, n_tokens - self.drop_first)
        return 0.0 if eligible == 0 else 1.0 - (1.0 - self.fraction) ** eligible

    def to_json(self) -> str:
        return json.dumps({"token_sample": self.fraction, "drop_first": self.drop_first, "seed": self.seed},
                          sort_keys=True)  # fmt: skip

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> TokenSampling | None:
        """The sampling a shard's (parsed) metadata records; None for a shard that stores every position."""
        raw = metadata.get("sampling")
        if raw is None:
            return None
        if isinstance(raw, str):
            raw = json.loads(raw)
        return cls(float(raw["token_sample"]), int(raw["drop_first"]), int(raw["seed"]))

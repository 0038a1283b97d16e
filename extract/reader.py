"""Reading activation shards back: `open_activations(...)` over a done marker, a prefix of shards, or one shard.

    from extract.reader import open_activations

    acts = open_activations("gs://bucket/jobs/j1/done/t000012.json")
    acts.layers                      # (12, 24)
    for s in acts.samples():         # in slice order
        s.sample_id, s.token_ids, s.layers[12]   # numpy: int64, int32 [n], bfloat16 [n, hidden]
    acts.layer(12)                   # every token of every shard, concatenated: [num_tokens, hidden]

A done marker is authoritative: its `outputs` are exactly the committed shards, in order, and each
shard's crc32c is checked against its record. A prefix lists every `*.safetensors` under it by
name, which for one holder's output directory is slice order; a prefix above several holders'
directories can also list shards that were written but never committed, so prefer the marker.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from extract import data
from extract.errors import ExtractError
from extract.writer import ShardFormatError, crc32c_b64, decode_safetensors, layer_key, parse_header

_JSON_METADATA = ("layers", "job", "task_manifest", "tokenization")
_INT_METADATA = (
    "attempt", "hidden_size", "max_seq_len", "num_hidden_layers", "sample_start", "sample_end", "samples", "tokens",
)  # fmt: skip
_HEAD_BYTES = 64 * 1024


class ActivationsError(ExtractError):
    """A shard or done marker that cannot be read, or whose bytes do not match its record."""


@dataclasses.dataclass(frozen=True)
class ShardRef:
    url: str
    crc32c: str | None = None
    bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class SampleActivations:
    sample_id: int
    token_ids: np.ndarray  # int32 [n_tokens]
    layers: Mapping[int, np.ndarray]  # layer -> [n_tokens, hidden]


@dataclasses.dataclass(frozen=True)
class Shard:
    """One decoded shard; arrays are read-only views of the shard's bytes."""

    ref: ShardRef
    tensors: Mapping[str, np.ndarray]
    metadata: Mapping[str, Any]

    @property
    def sample_ids(self) -> np.ndarray:
        return self.tensors["sample_ids"]

    @property
    def offsets(self) -> np.ndarray:
        return self.tensors["offsets"]

    @property
    def token_ids(self) -> np.ndarray:
        return self.tensors["token_ids"]

    def layer(self, layer: int) -> np.ndarray:
        return self.tensors[layer_key(layer)]

    def samples(self) -> Iterator[SampleActivations]:
        layers = parse_layers(self.metadata, self.tensors)
        offsets = self.offsets
        for k, sample_id in enumerate(self.sample_ids):
            lo, hi = int(offsets[k]), int(offsets[k + 1])
            yield SampleActivations(
                sample_id=int(sample_id),
                token_ids=self.token_ids[lo:hi],
                layers={layer: self.layer(layer)[lo:hi] for layer in layers},
            )


def parse_metadata(raw: Mapping[str, str]) -> dict[str, Any]:
    """Shard `__metadata__` with its JSON and integer fields decoded."""
    parsed: dict[str, Any] = dict(raw)
    for key in _JSON_METADATA:
        if key in parsed:
            parsed[key] = json.loads(parsed[key])
    for key in _INT_METADATA:
        if key in parsed:
            parsed[key] = int(parsed[key])
    return parsed


def parse_layers(metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> tuple[int, ...]:
    if "layers" in metadata:
        return tuple(int(x) for x in metadata["layers"])
    return tuple(sorted(int(name[len("layer_") :]) for name in tensors if name.startswith("layer_")))


def load_shard(ref: ShardRef) -> Shard:
    """Read a whole shard, check its size and crc32c against the record when given, decode it."""
    try:
        payload = data.read_bytes(ref.url)
    except OSError as exc:
        raise ActivationsError(f"shard {ref.url}: cannot be read ({exc})") from exc
    if ref.bytes is not None and len(payload) != ref.bytes:
        raise ActivationsError(f"shard {ref.url}: {len(payload)} bytes, its record says {ref.bytes}")
    if ref.crc32c is not None and crc32c_b64(payload) != ref.crc32c:
        raise ActivationsError(f"shard {ref.url}: crc32c {crc32c_b64(payload)} differs from its record's {ref.crc32c}")
    try:
        tensors, metadata = decode_safetensors(payload)
    except ShardFormatError as exc:
        raise ActivationsError(f"shard {ref.url}: {exc}") from exc
    return Shard(ref=ref, tensors=tensors, metadata=parse_metadata(metadata))


def _shard_header(url: str) -> dict[str, Any]:
    try:
        head = data.read_head(url, _HEAD_BYTES)
        size = int.from_bytes(head[:8], "little")
        if len(head) < 8 + size:
            head = data.read_head(url, 8 + size)
        header, _ = parse_header(head)
    except (OSError, ShardFormatError) as exc:
        raise ActivationsError(f"shard {url}: cannot read its header ({exc})") from exc
    return header


class Activations:
    """A sequence of shards read as one dataset of samples."""

    def __init__(self, shards: list[ShardRef], source: str):
        if not shards:
            raise ActivationsError(f"{source}: no shards found")
        self.source = source
        self.shards = tuple(shards)
        self._headers: list[dict[str, Any]] | None = None

    def _all_headers(self) -> list[dict[str, Any]]:
        if self._headers is None:
            self._headers = [_shard_header(ref.url) for ref in self.shards]
        return self._headers

    @property
    def metadata(self) -> dict[str, Any]:
        """The first shard's metadata; job, model, layers and dtype are the same in every shard of a task."""
        return parse_metadata(self._all_headers()[0].get("__metadata__", {}))

    @property
    def layers(self) -> tuple[int, ...]:
        return parse_layers(self.metadata, self._all_headers()[0])

    @property
    def num_samples(self) -> int:
        return sum(h["sample_ids"]["shape"][0] for h in self._all_headers())

    @property
    def num_tokens(self) -> int:
        return sum(h["token_ids"]["shape"][0] for h in self._all_headers())

    @property
    def hidden_size(self) -> int:
        return int(self._all_headers()[0][layer_key(self.layers[0])]["shape"][1])

    def iter_shards(self) -> Iterator[Shard]:
        """Shards one at a time, so only one is in memory."""
        for ref in self.shards:
            yield load_shard(ref)

    def samples(self) -> Iterator[SampleActivations]:
        for shard in self.iter_shards():
            yield from shard.samples()

    def layer(self, layer: int) -> np.ndarray:
        """All tokens' activations at `layer`, shards concatenated: [num_tokens, hidden]."""
        if layer not in self.layers:
            raise ActivationsError(f"layer {layer} was not extracted; these shards hold layers {list(self.layers)}")
        return np.concatenate([shard.layer(layer) for shard in self.iter_shards()], axis=0)

    def token_ids(self) -> np.ndarray:
        return np.concatenate([shard.token_ids for shard in self.iter_shards()])

    def sample_ids(self) -> np.ndarray:
        return np.concatenate([shard.sample_ids for shard in self.iter_shards()])

    def offsets(self) -> np.ndarray:
        """Per-sample token offsets into `layer(L)` and `token_ids()`: [num_samples + 1]."""
        parts, base = [np.zeros(1, dtype=np.int64)], 0
        for shard in self.iter_shards():
            parts.append(shard.offsets[1:] + base)
            base += int(shard.offsets[-1])
        return np.concatenate(parts)


def _from_done_marker(source: str) -> Activations:
    try:
        marker = json.loads(data.read_bytes(source))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ActivationsError(f"done marker {source}: cannot be read as JSON ({exc})") from exc
    outputs = marker.get("outputs") if isinstance(marker, dict) else None
    if not isinstance(outputs, list):
        raise ActivationsError(f"done marker {source}: has no 'outputs' list")
    outputs = sorted(outputs, key=lambda record: record.get("sample_start", 0))
    refs = [ShardRef(url=r["shard"], crc32c=r.get("crc32c"), bytes=r.get("bytes")) for r in outputs]
    return Activations(refs, source)


def open_activations(source: str) -> Activations:
    """`source`: a done marker (`.../done/<id>.json`), a directory or gs:// prefix of shards, or one `.safetensors`."""
    source = str(source)
    if source.endswith(".json"):
        return _from_done_marker(source)
    if source.endswith(".safetensors"):
        return Activations([ShardRef(url=source)], source)
    return Activations([ShardRef(url=url) for url in data.list_shards(source)], source)

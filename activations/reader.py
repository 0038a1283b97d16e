"""Finding a job's shards, and reading them back sample by sample: `open_activations(...)`.

    from activations import open_activations

    acts = open_activations("gs://bucket/jobs/j1/done/t000012.json")
    acts.layers                      # (12, 24): hidden-state indices
    acts.sites                       # {"mlp_out": (3,)}: hook sites and their decoder layers, if the job kept any
    for s in acts.samples():         # in slice order
        s.sample_id, s.token_ids, s.layers[12]   # numpy: int64, int32 [n], bfloat16 [n, hidden]
        s.outputs[HookPoint("mlp_out", 3)]       # every output, hook points included
    acts.layer(12)                   # every token of every shard, concatenated: [num_tokens, hidden]
    acts.layer(3, site="mlp_out")    # the same for a hook point

Sources (`resolve_shards`): a job's queue (`index.json` when tools/merge.py wrote one, else every done marker under
`done/`), one done marker or index, a directory or gs:// prefix of shards, one `.safetensors`, or a list of these.
A done marker is authoritative: its `outputs` are exactly the committed shards, in order, and each shard's crc32c is
checked against its record when the whole shard is read. A prefix lists every `*.safetensors` under it by name,
which for one holder's output directory is slice order; a prefix above several holders' directories can also list
shards that were written but never committed, so prefer the marker or the queue.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from activations.format import (
    HEAD_BYTES,
    HIDDEN,
    POSITIONS,
    HookPoint,
    LayerStats,
    Output,
    ShardFormatError,
    ShardHeader,
    check_sampled,
    crc32c_b64,
    decode_safetensors,
    dequantize,
    document_positions,
    header_length,
    output_key,
    parse_metadata,
    parse_outputs,
    scale_key,
    sites_of,
)
from activations.io import ActivationsError, ByteReader, exists, join, list_objects, read_object

INDEX_NAME = "index.json"
DONE_PREFIX = "done/"


class MissingStats(ActivationsError):
    """A shard written before the normalisation statistics existed."""


@dataclasses.dataclass(frozen=True)
class ShardRef:
    """A shard and what its progress record says about it (None where the source had no record)."""

    url: str
    crc32c: str | None = None
    bytes: int | None = None
    tokens: int | None = None


def as_output(layer: int, site: str = HIDDEN) -> Output:
    """What `layer` names at `site`: a hidden-state index (site "hidden"), else a hook point."""
    if site == HIDDEN:
        return int(layer)
    try:
        return HookPoint(site, layer)
    except ValueError as exc:
        raise ActivationsError(f"site={site!r}: {exc}; or {HIDDEN!r} for hidden states") from None


@dataclasses.dataclass(frozen=True)
class SampleActivations:
    sample_id: int
    token_ids: np.ndarray  # int32 [n_tokens]
    layers: Mapping[int, np.ndarray]  # hidden-state index -> [n_tokens, hidden]
    positions: np.ndarray  # int32 [n_tokens]: each token's position in the document (a sampled job stores some)
    outputs: Mapping[Output, np.ndarray] = dataclasses.field(default_factory=dict)  # also hook points


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

    @property
    def positions(self) -> np.ndarray:
        """Each stored token's position in its document: the shard's `positions` (a sampled job's), else computed
        from the offsets, as every position is then stored."""
        return self.tensors[POSITIONS] if POSITIONS in self.tensors else document_positions(self.offsets)

    def output(self, output: Output) -> np.ndarray:
        """[n_tokens, hidden] as stored (bf16, fp16, fp32), or float32 for fp8 (values times their scale)."""
        scale = self.tensors.get(scale_key(output))
        values = self.tensors[output_key(output)]
        return values if scale is None else dequantize(values, scale)

    def layer(self, layer: int, site: str = HIDDEN) -> np.ndarray:
        return self.output(as_output(layer, site))

    def samples(self) -> Iterator[SampleActivations]:
        outputs = parse_outputs(self.metadata, self.tensors)
        offsets, positions = self.offsets, self.positions
        arrays = {output: self.output(output) for output in outputs}
        for k, sample_id in enumerate(self.sample_ids):
            lo, hi = int(offsets[k]), int(offsets[k + 1])
            values = {output: arrays[output][lo:hi] for output in outputs}
            yield SampleActivations(
                sample_id=int(sample_id),
                token_ids=self.token_ids[lo:hi],
                layers={output: value for output, value in values.items() if isinstance(output, int)},
                positions=positions[lo:hi],
                outputs=values,
            )


# -- sources ------------------------------------------------------------------------------------------------------


def _record_ref(record: Any, where: str) -> ShardRef:
    if not isinstance(record, dict) or not isinstance(record.get("shard", record.get("url")), str):
        raise ActivationsError(f"{where}: a shard record needs a 'shard' (or 'url') string, got {record!r}")
    return ShardRef(url=record.get("shard", record.get("url")), crc32c=record.get("crc32c"), bytes=record.get("bytes"),
                    tokens=record.get("tokens"))  # fmt: skip


def _load_json(url: str, what: str, client: Any) -> Any:
    try:
        return json.loads(read_object(url, client))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ActivationsError(f"{what} {url}: cannot be read as JSON ({exc})") from exc


def _from_done_marker(url: str, client: Any = None) -> list[ShardRef]:
    marker = _load_json(url, "done marker", client)
    outputs = marker.get("outputs") if isinstance(marker, dict) else None
    if not isinstance(outputs, list):
        raise ActivationsError(f"done marker {url}: has no 'outputs' list")
    outputs = sorted(outputs, key=lambda record: record.get("sample_start", 0) if isinstance(record, dict) else 0)
    refs = {}
    for i, record in enumerate(outputs):  # a re-sent last record names its shard twice: one shard
        ref = _record_ref(record, f"done marker {url} outputs[{i}]")
        refs[ref.url] = ref
    return list(refs.values())


def read_index(url: str, client: Any = None) -> dict[str, Any]:
    index = _load_json(url, "index", client)
    if not isinstance(index, dict) or not isinstance(index.get("shards"), list):
        raise ActivationsError(f"index {url}: has no 'shards' list; rebuild it with tools/merge.py")
    return index


def _from_index(url: str, client: Any = None) -> list[ShardRef]:
    return [_record_ref(r, f"index {url} shards[{i}]") for i, r in enumerate(read_index(url, client)["shards"])]


def queue_index_url(source: str, client: Any = None) -> str | None:
    """The queue's index.json if `source` is a queue that has one."""
    if source.endswith(".json"):
        return source if source.rsplit("/", 1)[-1] == INDEX_NAME else None
    candidate = join(source, INDEX_NAME)
    return candidate if exists(candidate, client) else None


def resolve_shards(source: str | Sequence[str], client: Any = None) -> list[ShardRef]:
    """Every shard a source names, in its order (see the module docstring); duplicates are read once."""
    if not isinstance(source, str):
        refs = {}
        for item in source:
            for ref in resolve_shards(str(item), client):
                refs.setdefault(ref.url, ref)
        return list(refs.values())
    source = str(source)
    if source.endswith(".safetensors"):
        return [ShardRef(url=source)]
    if source.endswith(".json"):
        return _from_index(source, client) if source.rsplit("/", 1)[-1] == INDEX_NAME else _from_done_marker(source, client)
    index = queue_index_url(source, client)
    if index is not None:
        return _from_index(index, client)
    markers = list_objects(join(source, DONE_PREFIX), ".json", client)
    if markers:
        with ThreadPoolExecutor(max_workers=16) as pool:
            return [ref for refs in pool.map(lambda m: _from_done_marker(m, client), markers) for ref in refs]
    return [ShardRef(url=url) for url in list_objects(source, ".safetensors", client)]


# -- headers and whole shards -------------------------------------------------------------------------------------


def read_header(url: str, reader: ByteReader) -> ShardHeader:
    """A shard's header in one ranged read (two if it is longer than HEAD_BYTES)."""
    try:
        head = reader.read_prefix(url, HEAD_BYTES)
        needed = header_length(head)
        if len(head) < needed:
            head = reader.read_prefix(url, needed)
        return ShardHeader.parse(head)
    except ShardFormatError as exc:
        raise ActivationsError(f"shard {url}: {exc}") from exc


def read_stats(url: str, header: ShardHeader, reader: ByteReader) -> dict[Output, LayerStats]:
    """A shard's statistics per output (hidden-state index or hook point): one ranged read of the stats tensors."""
    if not header.has_stats():
        raise MissingStats(f"shard {url}: holds no normalisation statistics (written before they existed); "
                               "re-extract it, or train without normalisation")  # fmt: skip
    start, end = header.stats_range()
    block = np.frombuffer(reader.read(url, start, end), dtype=np.uint8)
    tensors = {}
    for name, spec in header.tensors.items():
        if name.startswith("stats."):
            tensors[name] = block[spec.start - start : spec.end - start].view(spec.dtype).reshape(spec.shape)
    return {output: LayerStats.from_tensors(output, tensors, header.num_tokens) for output in header.outputs}


def sum_stats(refs: Sequence[ShardRef], reader: ByteReader, parallel: int = 16) -> dict[Output, LayerStats]:
    """Statistics of every output over all `refs`: two small ranged reads per shard (header, stats)."""

    def of(ref: ShardRef) -> dict[Output, LayerStats]:
        return read_stats(ref.url, read_header(ref.url, reader), reader)

    totals: dict[Output, LayerStats] = {}
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for per_layer in pool.map(of, refs):
            for layer, stats in per_layer.items():
                if layer in totals:
                    totals[layer].add(stats)
                else:
                    totals[layer] = stats
    return totals


def load_shard(ref: ShardRef, client: Any = None) -> Shard:
    """Read a whole shard, check its size and crc32c against the record when given, decode it."""
    payload = read_object(ref.url, client)
    if ref.bytes is not None and len(payload) != ref.bytes:
        raise ActivationsError(f"shard {ref.url}: {len(payload)} bytes, its record says {ref.bytes}")
    if ref.crc32c is not None and crc32c_b64(payload) != ref.crc32c:
        raise ActivationsError(f"shard {ref.url}: crc32c {crc32c_b64(payload)} differs from its record's {ref.crc32c}")
    try:
        tensors, raw = decode_safetensors(payload)
        metadata = parse_metadata(raw)
        check_sampled(metadata, {name: (array.dtype, array.shape) for name, array in tensors.items()})
    except ShardFormatError as exc:
        raise ActivationsError(f"shard {ref.url}: {exc}") from exc
    return Shard(ref=ref, tensors=tensors, metadata=metadata)


class Activations:
    """A sequence of shards read as one dataset of samples."""

    def __init__(self, shards: list[ShardRef], source: str, client: Any = None):
        if not shards:
            raise ActivationsError(f"{source}: no shards found")
        self.source = source
        self.shards = tuple(shards)
        self._client = client
        self._headers: list[ShardHeader] | None = None

    def _all_headers(self) -> list[ShardHeader]:
        if self._headers is None:
            reader = ByteReader(self._client)
            with ThreadPoolExecutor(max_workers=16) as pool:
                self._headers = list(pool.map(lambda ref: read_header(ref.url, reader), self.shards))
        return self._headers

    @property
    def metadata(self) -> dict[str, Any]:
        """The first shard's metadata; job, model, layers and dtype are the same in every shard of a task."""
        return dict(self._all_headers()[0].metadata)

    @property
    def layers(self) -> tuple[int, ...]:
        """The hidden-state indices the shards hold."""
        return self._all_headers()[0].layers

    @property
    def outputs(self) -> tuple[Output, ...]:
        """Every hidden state and hook point the shards hold."""
        return self._all_headers()[0].outputs

    @property
    def sites(self) -> dict[str, tuple[int, ...]]:
        """{site: decoder layers} of the hook points the shards hold; empty for shards of hidden states only."""
        return {site: tuple(layers) for site, layers in sites_of(self.outputs).items()}

    @property
    def num_samples(self) -> int:
        return sum(h.num_samples for h in self._all_headers())

    @property
    def num_tokens(self) -> int:
        return sum(h.num_tokens for h in self._all_headers())

    @property
    def hidden_size(self) -> int:
        return self._all_headers()[0].hidden_size

    def stats(self) -> dict[Output, LayerStats]:
        """Normalisation statistics of every output over all shards, from the statistics the writer stored: keyed by
        hidden-state index (int) and hook point."""
        return sum_stats(self.shards, ByteReader(self._client))

    def iter_shards(self) -> Iterator[Shard]:
        """Shards one at a time, so only one is in memory."""
        for ref in self.shards:
            yield load_shard(ref, self._client)

    def samples(self) -> Iterator[SampleActivations]:
        for shard in self.iter_shards():
            yield from shard.samples()

    def layer(self, layer: int, site: str = HIDDEN) -> np.ndarray:
        """All tokens' activations at hidden state `layer` (or at `site` of decoder layer `layer`), shards
        concatenated: [num_tokens, width]."""
        output = as_output(layer, site)
        if output not in self.outputs:
            held = ", ".join(map(output_key, self.outputs))
            raise ActivationsError(f"{output_key(output)} was not extracted; these shards hold {held}")
        return np.concatenate([shard.output(output) for shard in self.iter_shards()], axis=0)

    def token_ids(self) -> np.ndarray:
        return np.concatenate([shard.token_ids for shard in self.iter_shards()])

    def sample_ids(self) -> np.ndarray:
        return np.concatenate([shard.sample_ids for shard in self.iter_shards()])

    def positions(self) -> np.ndarray:
        """Each token's position in its document, aligned with `layer(L)` and `token_ids()`."""
        return np.concatenate([shard.positions for shard in self.iter_shards()])

    @property
    def sampled(self) -> bool:
        """True when the shards store only some positions of each document (a job with token_sample/drop_first)."""
        return any(header.sampled for header in self._all_headers())

    def offsets(self) -> np.ndarray:
        """Per-sample token offsets into `layer(L)` and `token_ids()`: [num_samples + 1]."""
        parts, base = [np.zeros(1, dtype=np.int64)], 0
        for shard in self.iter_shards():
            parts.append(shard.offsets[1:] + base)
            base += int(shard.offsets[-1])
        return np.concatenate(parts)


def open_activations(source: str | Sequence[str], client: Any = None) -> Activations:
    """`source`: a queue, a done marker or index, a directory or gs:// prefix of shards, one `.safetensors`, or a
    list of them (see `resolve_shards`)."""
    return Activations(resolve_shards(source, client), str(source), client)

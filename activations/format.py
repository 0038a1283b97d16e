"""The one definition of the activation shard format, shared by the writer (extraction) and every reader.

A shard is a standard safetensors file (docs/EXTRACTION.md, "Output shards"):

| tensor                        | dtype        | shape               |                                                  |
|-------------------------------|--------------|---------------------|--------------------------------------------------|
| `stats.layer_<L>.sum`         | F64          | `[hidden]`          | per-dimension sum over the shard's tokens        |
| `stats.layer_<L>.sum_sq`      | F64          | `[hidden]`          | per-dimension sum of squares                     |
| `stats.layer_<L>.norm_sum`    | F64          | `[]`                | sum of the tokens' L2 norms                      |
| `layer_<L>`                   | BF16/F16/F32 | `[n_tokens, hidden]`| one per hidden state; L is the non-negative index|
| `<site>_<l>`                  | BF16/F16/F32 | `[n_tokens, width]` | one per hook point, e.g. `mlp_out_3` (below)     |
| `token_ids`                   | I32          | `[n_tokens]`        |                                                  |
| `sample_ids`                  | I64          | `[n_samples]`       | global sample ids                                |
| `offsets`                     | I64          | `[n_samples + 1]`   | sample k is rows `offsets[k]:offsets[k+1]`       |
| `positions`                   | I32          | `[n_tokens]`        | sampled shards only: each token's position in its document |

Hidden states (transformers' `output_hidden_states` index, an `int` everywhere) are stored as `layer_<L>`, as they
always were. A hook point (`HookPoint(site, layer)`: one site of decoder layer `layer`, counted from 0) is stored as
`<site>_<layer>`; its statistics as `stats.<site>_<layer>.*`. The sites are SITES (docs/EXTRACTION.md, "Hook sites");
`mlp_hidden` is `intermediate_size` wide, `router_logits` and `expert_weights` `num_experts`, `expert_indices`
`num_experts_per_tok`, every other site `hidden_size`.

The statistics come first in the data section, so one ranged read after the header fetches all of them; they are
computed from the stored values (after the cast to the output dtype), so they describe exactly what a reader gets.
Shards written before the statistics existed simply lack the `stats.` tensors.

A job that stores only some positions (`token_sample`, `drop_first`: activations.sampling) writes shards of format
`activations/v2`: the same tensors plus `positions`, and its sampling in the metadata (`sampling`, JSON). In a shard
that stores every position (v1), a token's position is its row's offset within its sample, which is what a reader
computes for it. Whether a shard is sampled is read from its metadata (`sampling`, or the format v2), never guessed
from the tensors: a sampled shard without `positions` is refused (`check_sampled`), since reading it as unsampled
would give its rows the wrong positions.

A job with `dtype: fp8` stores each layer as fp8 e4m3 (`F8_E4M3`, 1 byte a value) with a float32 scale per token
(`scale.layer_<L>`, [n_tokens]): value = fp8 × scale, the scale being the token's largest magnitude / 448, so no
value saturates (`quantize_per_token`; bench/fp8_storage.py measured what it loses). Readers return the product
(`dequantize`), and the statistics are those of the product.

Only numpy (and ml_dtypes for bfloat16 and fp8) is needed here: a trainer's machine imports this without JAX or the
queue. Without ml_dtypes (the base install, `pip install .`, whose planner and queue verbs name outputs and sites but
read no tensor) the module imports, and a bfloat16 or fp8 tensor is refused naming the extra that brings it.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

try:
    import ml_dtypes
except ModuleNotFoundError:  # the base install: see the module docstring
    ml_dtypes = None

FORMAT = "activations/v1"
#: Shards that store only some positions of each document: v1's tensors plus `positions` (activations.sampling).
FORMAT_SAMPLED = "activations/v2"
POSITIONS = "positions"
#: Bytes read for a header in one request; a larger header costs a second read of its exact size.
HEAD_BYTES = 64 * 1024
_MAX_HEADER = 100 * 1024 * 1024
_ALIGN = 8

#: safetensors dtype codes <-> numpy dtypes (bfloat16 from ml_dtypes).
CODES = {
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "U8": np.dtype(np.uint8),
}
if ml_dtypes is not None:
    CODES.update(BF16=np.dtype(ml_dtypes.bfloat16), F8_E4M3=np.dtype(ml_dtypes.float8_e4m3fn))
#: What brings the codes ml_dtypes supplies, for the error that meets one without it.
NEEDS_ML_DTYPES = "bfloat16 and fp8 need ml_dtypes: pip install 'gcs-spawner[train]' (or [extract])"
CODE_OF = {dtype: code for code, dtype in CODES.items()}


class ShardFormatError(ValueError):
    """Bytes that are not a well-formed safetensors file, or a shard that lacks a tensor of the format."""


def numpy_dtype(name: str) -> np.dtype:
    """'bfloat16' | 'float16' | 'float32' (or 'bf16', 'fp16', 'fp32') -> numpy dtype (bfloat16 via ml_dtypes)."""
    aliases = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}
    name = aliases.get(name, name)
    if name in ("bfloat16", "float8_e4m3fn"):
        if ml_dtypes is None:
            raise ModuleNotFoundError(f"dtype {name}: {NEEDS_ML_DTYPES}", name="ml_dtypes")
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


#: What a job can keep of each decoder layer, in the order the layer computes them (docs/EXTRACTION.md, "Hook
#: sites", maps them to TransformerLens's hook names):
#: the residual stream entering the layer; what attention adds to it (after Gemma's post-attention norm); the
#: residual between attention and MLP; the MLP's input (after its norm, weight applied); the MLP's hidden
#: activations (act(gate) * up, `intermediate_size` wide); what the MLP adds (after Gemma's post-MLP norm); the
#: residual stream leaving the layer (never final-normed). A mixture-of-experts layer (Mixtral, Qwen-MoE, OLMoE) has
#: no one MLP hidden activation, and adds its router's: the router's logits per expert (`router_logits`), and the
#: weight each expert's output gets (`expert_weights`: zero for the experts not chosen, so the chosen experts are its
#: nonzero entries), both `num_experts` wide; and the chosen experts themselves (`expert_indices`, `num_experts_per_tok`
#: wide: each token's experts by index, its heaviest first, stored as whole numbers in the job's dtype, exact in
#: float32, bfloat16 and float16 for up to 256 experts; fp8 is refused for it); its `mlp_out` is the block's output
#: (every chosen expert's, weighted, plus a shared expert's).
SITES = ("resid_pre", "attn_out", "resid_mid", "mlp_in", "mlp_hidden", "mlp_out", "resid_post", "router_logits",
         "expert_weights", "expert_indices")  # fmt: skip
#: The sites only a mixture-of-experts layer has.
ROUTER_SITES = ("router_logits", "expert_weights", "expert_indices")
#: The most experts whose indices `expert_indices` stores exactly in bfloat16 (8 significant bits: every whole number
#: up to 2^8); float16 (11 bits) and float32 hold more.
EXACT_EXPERT_INDICES = 256
#: The site name of hidden states (plain ints) where a site must be named, e.g. the loader's `site=`.
HIDDEN = "hidden"


@dataclasses.dataclass(frozen=True)
class HookPoint:
    """One site of one decoder layer, counted from 0 (transformers' `model.layers[l]`, TransformerLens's
    `blocks.{l}`). Stored as the tensor `<site>_<layer>`, e.g. `mlp_out_3`."""

    site: str
    layer: int

    def __post_init__(self) -> None:
        if self.site not in SITES:
            raise ValueError(f"site {self.site!r} is not one of {', '.join(SITES)}")
        if isinstance(self.layer, bool) or not isinstance(self.layer, (int, np.integer)):
            raise ValueError(f"layer {self.layer!r} of site {self.site} must be an integer")
        object.__setattr__(self, "layer", int(self.layer))

    @property
    def key(self) -> str:
        return f"{self.site}_{self.layer}"

    def __str__(self) -> str:
        return self.key

    # Ordered with hidden-state indices (`output_order`), so that outputs sort and key a pytree's dicts together.
    def __lt__(self, other: object) -> bool:
        return output_order(self) < output_order(other) if isinstance(other, (int, HookPoint)) else NotImplemented

    def __gt__(self, other: object) -> bool:
        return output_order(self) > output_order(other) if isinstance(other, (int, HookPoint)) else NotImplemented

    def __le__(self, other: object) -> bool:
        return self == other or self < other

    def __ge__(self, other: object) -> bool:
        return self == other or self > other


#: What a shard holds one tensor of: a hidden-state index (int) or a hook point.
Output = int | HookPoint


def output_key(output: Output) -> str:
    """The tensor name of a hidden state (`layer_<L>`) or a hook point (`<site>_<l>`)."""
    return output.key if isinstance(output, HookPoint) else layer_key(output)


def output_of_key(name: str) -> Output | None:
    """The output a tensor name stores, or None for any other tensor (token_ids, stats., ...)."""
    head, _, tail = name.rpartition("_")
    if not tail.isdigit():
        return None
    if head == "layer":
        return int(tail)
    return HookPoint(head, int(tail)) if head in SITES else None


def output_order(output: Output) -> tuple[int, int, int]:
    """Hidden states first, by index; then hook points by layer, and within a layer in SITES order."""
    if isinstance(output, HookPoint):
        return (1, output.layer, SITES.index(output.site))
    return (0, int(output), 0)


def sites_of(outputs: Sequence[Output]) -> dict[str, list[int]]:
    """{site: [layers]} of the hook points among `outputs` (the shards' `sites` metadata)."""
    sites: dict[str, list[int]] = {}
    for output in sorted(outputs, key=output_order):
        if isinstance(output, HookPoint):
            sites.setdefault(output.site, []).append(output.layer)
    return sites


def layer_key(layer: int) -> str:
    return f"layer_{layer}"


def stats_keys(output: Output) -> tuple[str, str, str]:
    """Names of an output's (sum, sum of squares, norm sum) tensors."""
    base = f"stats.{output_key(output)}"
    return f"{base}.sum", f"{base}.sum_sq", f"{base}.norm_sum"


def scale_key(output: Output) -> str:
    """The per-token scale of an fp8 output (`scale.layer_<L>`, `scale.<site>_<l>`)."""
    return f"scale.{output_key(output)}"


FP8 = np.dtype(ml_dtypes.float8_e4m3fn) if ml_dtypes is not None else None
#: e4m3's largest finite value: a token's scale maps its largest magnitude there.
FP8_MAX = 448.0


def quantize_per_token(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, d] activations -> (fp8 e4m3 [n, d], float32 scale [n]) with scale = max |row| / 448 (1 for a zero row)."""
    wide = as_float32(rows)
    absmax = np.abs(wide).max(axis=1) if wide.shape[1] else np.zeros(len(wide), np.float32)
    scale = np.where(absmax > 0, absmax / np.float32(FP8_MAX), np.float32(1)).astype(np.float32)
    return (wide / scale[:, None]).astype(FP8), scale


def dequantize(values: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """float32 activations from stored values and, for fp8, their per-token scale."""
    if scale is None:
        return as_float32(values)
    return values.astype(np.float32) * np.asarray(scale, np.float32)[:, None]


def shard_name(sample_start: int, sample_end: int) -> str:
    """Positions in the name make a prefix listing sort in slice order."""
    return f"shard-{sample_start:09d}-{sample_end:09d}.safetensors"


def crc32c_b64(data: bytes | np.ndarray) -> str:
    """CRC32C as GCS reports it: the 4 big-endian bytes, base64-encoded.

    google-crc32c's C implementation (it releases the GIL for buffers of 1 MB or more) takes `bytes` or a
    read-only numpy array, so a shard buffer is checksummed in place."""
    import google_crc32c

    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


# -- safetensors encoding -----------------------------------------------------------------------------------------


def safetensors_layout(
    specs: Sequence[tuple[str, np.dtype, tuple[int, ...]]], metadata: Mapping[str, str]
) -> tuple[bytes, list[int], int]:
    """(the 8-byte length + JSON header padded to 8 bytes, each tensor's absolute byte offset, total file size)
    for tensors given as (name, dtype, shape) in storage order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    starts = []
    for name, dtype, shape in specs:
        dtype = np.dtype(dtype)
        if dtype not in CODE_OF:
            raise ShardFormatError(f"tensor {name}: dtype {dtype} has no safetensors code")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": CODE_OF[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        starts.append(offset)
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % _ALIGN)
    head = len(header_bytes).to_bytes(8, "little") + header_bytes
    return head, [len(head) + start for start in starts], len(head) + offset


def encode_safetensors(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    """Standard safetensors bytes: u64 header length, JSON header padded to 8 bytes, tensor data."""
    # reshape: np.ascontiguousarray makes a 0-d array (a statistic's norm_sum) 1-d.
    arrays = {name: np.ascontiguousarray(array).reshape(np.shape(array)) for name, array in tensors.items()}
    head, starts, total = safetensors_layout([(n, a.dtype, a.shape) for n, a in arrays.items()], metadata)
    out = np.empty(total, dtype=np.uint8)
    out[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    for array, position in zip(arrays.values(), starts):
        out[position : position + array.nbytes] = array.reshape(-1).view(np.uint8)
    return out.tobytes()


def header_length(head: bytes) -> int:
    """Bytes of the length prefix and JSON header together, from the file's first 8 bytes or more."""
    if len(head) < 8:
        raise ShardFormatError("shorter than a safetensors header")
    size = int.from_bytes(head[:8], "little")
    if size > _MAX_HEADER:
        raise ShardFormatError(f"header length {size} is implausible")
    return 8 + size


def parse_header(head: bytes) -> tuple[dict[str, Any], int]:
    """(header dict, offset of the data section) from the first bytes of a safetensors file."""
    data_start = header_length(head)
    if len(head) < data_start:
        raise ShardFormatError(f"header needs {data_start} bytes, got {len(head)}")
    try:
        header = json.loads(head[8:data_start])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ShardFormatError(f"header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ShardFormatError("header is not a JSON object")
    return header, data_start


def decode_safetensors(buffer: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors (read-only views of `buffer`) and the string metadata."""
    header, data_start = parse_header(buffer)
    metadata = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, spec in header.items():
        tensor = TensorSpec.parse(name, spec, data_start)
        if tensor.end > len(buffer):
            raise ShardFormatError(f"tensor {name}: data_offsets end past the file's {len(buffer)} bytes")
        array = np.frombuffer(buffer, dtype=tensor.dtype, count=tensor.count, offset=tensor.start)
        tensors[name] = array.reshape(tensor.shape)
    return tensors, metadata


# -- a shard's header, for ranged reads ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lies in the file: absolute byte range, dtype and shape."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @classmethod
    def parse(cls, name: str, spec: Any, data_start: int) -> "TensorSpec":
        try:
            code, shape, (begin, end) = spec["dtype"], tuple(int(n) for n in spec["shape"]), spec["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardFormatError(f"tensor {name}: malformed header entry {spec!r}") from exc
        if code not in CODES:
            needs = f"; {NEEDS_ML_DTYPES}" if code in ("BF16", "F8_E4M3") else ""
            raise ShardFormatError(f"tensor {name}: dtype {code} is not supported here{needs}")
        dtype = CODES[code]
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize or begin < 0:
            raise ShardFormatError(f"tensor {name}: data_offsets {begin}:{end} do not match shape {list(shape)}")
        return cls(name, dtype, shape, data_start + begin, data_start + end)

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the first axis) of a 2-D tensor."""
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def rows(self, lo: int, hi: int) -> tuple[int, int]:
        """Absolute byte range of rows [lo, hi)."""
        return self.start + lo * self.row_bytes, self.start + hi * self.row_bytes


@dataclasses.dataclass(frozen=True)
class ShardHeader:
    """A shard's parsed header: its tensors' ranges and its decoded metadata."""

    tensors: Mapping[str, TensorSpec]
    metadata: Mapping[str, Any]

    @classmethod
    def parse(cls, head: bytes) -> "ShardHeader":
        """The header of a well-formed shard; ShardFormatError otherwise (a sampled shard without `positions`
        included: `check_sampled`)."""
        header, data_start = parse_header(head)
        raw = header.pop("__metadata__", {}) or {}
        tensors = {name: TensorSpec.parse(name, spec, data_start) for name, spec in header.items()}
        metadata = parse_metadata(raw)
        check_sampled(metadata, {name: (spec.dtype, spec.shape) for name, spec in tensors.items()})
        return cls(tensors, metadata)

    def tensor(self, name: str) -> TensorSpec:
        if name not in self.tensors:
            raise ShardFormatError(f"the shard has no tensor {name!r}; it holds {sorted(self.tensors)}")
        return self.tensors[name]

    @property
    def layers(self) -> tuple[int, ...]:
        """The hidden-state indices the shard holds."""
        return parse_layers(self.metadata, self.tensors)

    @functools.cached_property
    def outputs(self) -> tuple[Output, ...]:
        """Every hidden state and hook point the shard holds, in storage order."""
        return parse_outputs(self.metadata, self.tensors)

    @property
    def num_tokens(self) -> int:
        return self.tensor("token_ids").shape[0]

    @property
    def num_samples(self) -> int:
        return self.tensor("sample_ids").shape[0]

    @property
    def hidden_size(self) -> int:
        if "hidden_size" in self.metadata:
            return int(self.metadata["hidden_size"])
        return self.output(self.outputs[0]).shape[1]

    def output(self, output: Output) -> TensorSpec:
        """The tensor of one hidden state (int) or hook point; an error listing what the shard holds otherwise."""
        if output not in self.outputs:
            held = ", ".join(output_key(o) for o in self.outputs)
            raise ShardFormatError(f"{output_key(output)} was not extracted; this shard holds {held}")
        return self.tensor(output_key(output))

    def layer(self, layer: int) -> TensorSpec:
        if layer not in self.layers:
            raise ShardFormatError(f"layer {layer} was not extracted; this shard holds layers {list(self.layers)}")
        return self.tensor(layer_key(layer))

    @property
    def sampled(self) -> bool:
        """True when the shard stores only some positions and says which (`positions`; `parse` checked that a shard
        whose metadata records sampling has them)."""
        return POSITIONS in self.tensors

    def scale(self, output: Output) -> TensorSpec | None:
        """An fp8 output's per-token scale; None for one stored in bf16, fp16 or fp32."""
        return self.tensors.get(scale_key(output))

    def has_stats(self) -> bool:
        return all(key in self.tensors for output in self.outputs for key in stats_keys(output))

    def stats_range(self) -> tuple[int, int]:
        """The byte range holding every output's statistics (they are stored together, first)."""
        specs = [self.tensor(key) for output in self.outputs for key in stats_keys(output)]
        return min(s.start for s in specs), max(s.end for s in specs)


_JSON_METADATA = ("layers", "sites", "job", "task_manifest", "tokenization", "sampling")
_INT_METADATA = (
    "attempt", "hidden_size", "max_seq_len", "num_hidden_layers", "sample_start", "sample_end", "samples", "tokens",
)  # fmt: skip


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
    """Hidden-state indices: the `layers` metadata, else (older shards) the `layer_<L>` tensors' names."""
    if "layers" in metadata:
        return tuple(int(x) for x in metadata["layers"])
    return tuple(sorted(o for o in map(output_of_key, tensors) if isinstance(o, int)))


def parse_outputs(metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> tuple[Output, ...]:
    """Hidden states (`layers`) then hook points (the `sites` metadata, {site: [layers]}, else the tensors' names)."""
    if "sites" in metadata:
        points = [HookPoint(site, layer) for site, layers in metadata["sites"].items() for layer in layers]
    else:
        points = [o for o in map(output_of_key, tensors) if isinstance(o, HookPoint)]
    return (*parse_layers(metadata, tensors), *sorted(points, key=output_order))


def records_sampling(metadata: Mapping[str, Any]) -> bool:
    """Whether a shard's (parsed) metadata says it stores only some positions: a `sampling` entry, or format v2."""
    return "sampling" in metadata or metadata.get("format") == FORMAT_SAMPLED


def check_sampled(metadata: Mapping[str, Any], tensors: Mapping[str, tuple[np.dtype, tuple[int, ...]]]) -> None:
    """A shard whose metadata records sampling must hold `positions`, int32, one per token: without it nothing says
    which position each row is, and reading it as a shard of every position would give its rows the wrong ones
    (the drop_first and positions filters would keep the wrong rows). `tensors`: name -> (dtype, shape)."""
    if POSITIONS not in tensors:
        if records_sampling(metadata):
            recorded = metadata.get("sampling", f"format {metadata.get('format')}")
            raise ShardFormatError(f"its metadata records token sampling ({json.dumps(recorded)}) but it holds no "
                                   f"{POSITIONS!r} tensor, so its rows' positions are unknown; re-extract it (the "
                                   "writer stores positions with every sampled shard)")  # fmt: skip
        return
    dtype, shape = tensors[POSITIONS]
    tokens = tuple(tensors["token_ids"][1]) if "token_ids" in tensors else tuple(shape)
    if dtype != CODES["I32"] or tuple(shape) != tokens:
        raise ShardFormatError(f"{POSITIONS} is {dtype} {list(shape)}; the format stores int32 {list(tokens)}, one "
                               "per token")  # fmt: skip


def document_positions(offsets: np.ndarray) -> np.ndarray:
    """Each row's position in its document when every position is stored (v1 shards): row - offsets[its sample]."""
    lengths = np.diff(np.asarray(offsets, dtype=np.int64))
    starts = np.repeat(np.asarray(offsets[:-1], dtype=np.int64), lengths)
    return (np.arange(int(offsets[-1]) - int(offsets[0]), dtype=np.int64) + int(offsets[0]) - starts).astype(np.int32)


# -- normalisation statistics -------------------------------------------------------------------------------------


def as_float32(rows: np.ndarray) -> np.ndarray:
    """Activations as float32. bfloat16 is the top half of a float32, so it widens by an integer shift (numpy runs
    that without the GIL, unlike ml_dtypes' cast) and the result is exact."""
    if rows.dtype == CODES.get("BF16"):
        wide = np.empty(rows.shape, dtype=np.uint32)
        np.left_shift(rows.view(np.uint16), 16, out=wide, dtype=np.uint32)
        return wide.view(np.float32)
    return rows.astype(np.float32, copy=False)


@dataclasses.dataclass
class LayerStats:
    """Sums over tokens of one layer; they add across shards, tasks and jobs.

    Derived: mean = sum / tokens; variance = sum_sq / tokens - mean²; mean_norm = norm_sum / tokens."""

    tokens: int
    sum: np.ndarray  # float64 [hidden]
    sum_sq: np.ndarray  # float64 [hidden]
    norm_sum: float

    @classmethod
    def zeros(cls, hidden: int) -> "LayerStats":
        return cls(0, np.zeros(hidden), np.zeros(hidden), 0.0)

    #: Rows widened to float32 at a time: small enough that a chunk stays in cache (measured fastest at 128).
    CHUNK_ROWS = 128

    @classmethod
    def of(cls, rows: np.ndarray, scale: np.ndarray | None = None) -> "LayerStats":
        """Statistics of [n, hidden] activations (times a per-row `scale`, fp8's), accumulated in float64 over
        float32 chunks of CHUNK_ROWS rows (column sums and row norms as matrix-vector products, which BLAS runs
        without the GIL)."""
        n, hidden = rows.shape
        stats = cls.zeros(hidden)
        ones_rows = np.ones(cls.CHUNK_ROWS, dtype=np.float32)
        ones_hidden = np.ones(hidden, dtype=np.float32)
        for lo in range(0, n, cls.CHUNK_ROWS):
            chunk = as_float32(rows[lo : lo + cls.CHUNK_ROWS])
            if scale is not None:
                chunk = chunk * scale[lo : lo + cls.CHUNK_ROWS, None]
            m = chunk.shape[0]
            stats.sum += ones_rows[:m] @ chunk
            squares = chunk * chunk
            stats.sum_sq += ones_rows[:m] @ squares
            stats.norm_sum += float(np.sqrt(squares @ ones_hidden).sum(dtype=np.float64))
        stats.tokens = n
        return stats

    def add(self, other: "LayerStats") -> None:
        self.tokens += other.tokens
        self.sum += other.sum
        self.sum_sq += other.sum_sq
        self.norm_sum += other.norm_sum

    @property
    def mean(self) -> np.ndarray:
        return self.sum / max(self.tokens, 1)

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(np.maximum(self.sum_sq / max(self.tokens, 1) - self.mean**2, 0.0))

    @property
    def mean_norm(self) -> float:
        return self.norm_sum / max(self.tokens, 1)

    def tensors(self, output: Output) -> dict[str, np.ndarray]:
        """As the shard stores them."""
        names = stats_keys(output)
        return {names[0]: self.sum, names[1]: self.sum_sq, names[2]: np.array(self.norm_sum, dtype=np.float64)}

    @classmethod
    def from_tensors(cls, output: Output, tensors: Mapping[str, np.ndarray], tokens: int) -> "LayerStats":
        names = stats_keys(output)
        return cls(tokens, np.array(tensors[names[0]], np.float64), np.array(tensors[names[1]], np.float64),
                   float(tensors[names[2]]))  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """JSON for the job index; floats survive exactly (JSON numbers are written with repr)."""
        return {"tokens": self.tokens, "sum": self.sum.tolist(), "sum_sq": self.sum_sq.tolist(),
                "norm_sum": self.norm_sum, "mean_norm": self.mean_norm}  # fmt: skip

    @classmethod
    def from_json(cls, value: Mapping[str, Any], where: str) -> "LayerStats":
        try:
            return cls(int(value["tokens"]), np.array(value["sum"], np.float64), np.array(value["sum_sq"], np.float64),
                       float(value["norm_sum"]))  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardFormatError(f"{where}: malformed statistics ({exc})") from exc

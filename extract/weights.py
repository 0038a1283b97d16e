"""Where a checkpoint comes from and how its tensors reach the devices.

Sources: a local directory, a Hugging Face hub id (`snapshot_download`, config/tokenizer/safetensors only), or a
`gs://` directory mirrored there by `tools/mirror_model.py`. For a gs:// model only the small files (config,
tokenizer, index) are downloaded into a cache directory; the weights are read in place by parallel ranged reads
(`Checkpoint.from_store`), so loading runs at the bucket's aggregate rate rather than one stream's.

Loading follows the abstract-model pattern: the model is first built with `nnx.eval_shape` (shapes only, no
memory), then each parameter is read from its safetensors file, converted to the compute dtype and put straight
onto its `NamedSharding`, LOAD_WORKERS tensors at a time. The host therefore holds a few tensors, never the model,
and only the layers the caller needs are read; the LM head never is.

Tensors are read through a memory map of the safetensors layout (an 8-byte header length, a JSON header, raw
little-endian data) rather than `safe_open(framework="numpy")`, because numpy's backend of safetensors cannot
represent bfloat16, the dtype most checkpoints ship in; `ml_dtypes` (a JAX dependency) can.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import shutil
import struct
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

import objectstore
from extract import names
from extract.config import ModelConfig
from extract.errors import BadInput, TransientIOError
from extract.hub import (  # noqa: F401 - the mirror's names, where the loader's callers have always found them
    INDEX_FILE,
    MODEL_FILE_PATTERNS,
    download_hub_config,
    download_hub_snapshot,
    is_hub_id,
    is_model_file,
    mirror_hub_snapshot,
    upload_model_dir,
)
from extract.names import Stored
from extract.sharding import ShardingRules

log = logging.getLogger(__name__)

CACHE_ENV = "EXTRACT_MODEL_CACHE"
_COPY_CHUNK = 16 * 1024 * 1024
#: One ranged read of a tensor in an object store; several run at once, so a large tensor is fetched in parallel.
READ_PIECE_BYTES = 32 * 1024 * 1024
#: Tensors loaded at once by `load_state`.
LOAD_WORKERS = 4

_SAFETENSORS_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}


# -- sources ------------------------------------------------------------------------------------------------------


def resolve_model_dir(
    model: str, *, revision: str | None = None, cache_dir: str | os.PathLike | None = None, weights: bool = True
) -> pathlib.Path:
    """A local directory holding config.json, tokenizer files and *.safetensors for `model`.

    `model` is a local directory, a `gs://bucket/prefix` directory, or a hub id such as `Qwen/Qwen2.5-7B`.
    `weights=False` leaves a gs:// model's safetensors files in the bucket.
    """
    if not isinstance(model, str) or not model:
        raise BadInput(f"model={model!r} must be a local directory, a gs:// directory or a hub id")
    if model.startswith("gs://"):
        cache = pathlib.Path(cache_dir) if cache_dir else default_cache_dir(model)
        return fetch_from_store(model, cache, weights=weights)
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if is_hub_id(model):
        return download_hub_snapshot(model, revision=revision)
    raise BadInput(f"model={model!r} is not an existing directory, a gs:// directory or a hub id (org/name)")


def default_cache_dir(url: str) -> pathlib.Path:
    root = pathlib.Path(os.environ.get(CACHE_ENV) or pathlib.Path.home() / ".cache" / "gcs-spawner" / "models")
    return root / url.removeprefix("gs://").strip("/")


def fetch_from_store(url: str, cache_dir: pathlib.Path, weights: bool = True) -> pathlib.Path:
    """Download a mirrored model directory into `cache_dir`, skipping files already fetched at the same generation.

    With `weights=False` the `*.safetensors` files stay in the store (`Checkpoint.from_store` reads them there).

    Each file is streamed to a temporary name and renamed into place, so a killed download is never mistaken for
    a complete one; `.fetched.json` records the generation of every file that arrived whole.
    """
    store = objectstore.open_store(url)
    try:
        entries = [e for e in store.list("") if "/" not in e.name and is_model_file(e.name)]
    except objectstore.StoreError as exc:  # unavailable, or refused (permissions may still be propagating)
        raise TransientIOError(f"model={url!r}: listing failed: {exc}") from exc
    names = {e.name for e in entries}
    if "config.json" not in names:
        raise BadInput(
            f"model={url!r} holds no config.json: mirror the checkpoint there first with "
            f"gcs-spawner mirror HUB_ID {url}"
        )
    if not any(name.endswith(".safetensors") for name in names):
        raise BadInput(f"model={url!r} holds no *.safetensors files: the checkpoint must be in safetensors format")

    cache_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = cache_dir / ".fetched.json"
    try:
        fetched = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        fetched = {}
    except (OSError, json.JSONDecodeError):
        log.warning("event=model_cache_manifest_unreadable path=%s action=refetch", manifest_path)
        fetched = {}

    started = time.monotonic()
    downloaded = 0
    for entry in sorted(entries, key=lambda e: e.name):
        if not weights and entry.name.endswith(".safetensors"):
            continue
        target = cache_dir / entry.name
        if fetched.get(entry.name) == entry.generation and target.is_file() and target.stat().st_size == entry.size:
            continue
        partial = cache_dir / f".{entry.name}.part{os.getpid()}"
        try:
            with store.open_read(entry.name) as source, open(partial, "wb") as sink:
                shutil.copyfileobj(source, sink, _COPY_CHUNK)
            if partial.stat().st_size != entry.size:
                raise TransientIOError(
                    f"model={url!r}: {entry.name} arrived with {partial.stat().st_size} bytes, expected {entry.size}"
                )
            os.replace(partial, target)
        except (objectstore.StoreError, OSError) as exc:  # includes a file deleted while a mirror is rewritten
            raise TransientIOError(f"model={url!r}: downloading {entry.name} failed: {exc}") from exc
        finally:
            partial.unlink(missing_ok=True)
        fetched[entry.name] = entry.generation
        downloaded += entry.size
        manifest_path.write_text(json.dumps(fetched, indent=1, sort_keys=True))
    log.info(
        "event=model_fetched url=%s cache=%s files=%d downloaded_bytes=%d seconds=%.1f",
        url, cache_dir, len(entries), downloaded, time.monotonic() - started,
    )  # fmt: skip
    return cache_dir


# -- safetensors --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorLocation:
    file: pathlib.Path | str  # a local path, or an object name in the checkpoint's store
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in `file`


def read_safetensors_header(
    path: pathlib.Path | str, store: objectstore.ObjectStore | None = None
) -> dict[str, TensorLocation]:
    """Where each tensor of one safetensors file lies; `path` is an object name in `store` when one is given."""
    where = store.url(str(path)) if store is not None else path
    try:
        with store.open_read(str(path)) if store is not None else open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise BadInput(f"weights file {where} is not a safetensors file (shorter than 8 bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > 100 * 1024 * 1024:
                raise BadInput(f"weights file {where} is not a safetensors file (header length {header_len})")
            header = json.loads(f.read(header_len))
    except (FileNotFoundError, objectstore.NotFound):
        raise BadInput(f"weights file {where} is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"weights file {where} has an unreadable safetensors header: {exc}") from exc
    except (OSError, objectstore.StoreError) as exc:
        raise TransientIOError(f"weights file {where} could not be read: {exc}") from exc
    data_start = 8 + header_len
    tensors = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(spec.get("dtype"))
        shape = tuple(spec.get("shape", ()))
        begin, end = spec.get("data_offsets", (0, -1))
        if dtype is not None and end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise BadInput(f"weights file {where}: tensor {name} has data_offsets that do not match its shape")
        tensors[name] = TensorLocation(path, dtype, shape, data_start + begin)
    return tensors


def default_read_streams() -> int:
    """Ranged reads in flight while loading weights from a store: network-bound, so several per core."""
    return max(8, min(32, 4 * (os.cpu_count() or 1)))


class Checkpoint:
    """The safetensors files of one model directory: which file holds each tensor, and where in it.

    Local files are read through memory maps. A checkpoint in an object store (`from_store`) is read in place:
    each tensor is fetched by ranged reads of at most READ_PIECE_BYTES, `streams` of them in flight, into one
    host buffer that `load_state` converts and places on the devices; no local copy of the files is made.
    """

    store: objectstore.ObjectStore | None = None
    _pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @classmethod
    def from_store(cls, url: str, streams: int | None = None) -> "Checkpoint":
        """The checkpoint under `url` (gs://bucket/prefix), read where it lies."""
        checkpoint = cls.__new__(cls)
        checkpoint.model_dir = url
        checkpoint.store = objectstore.open_store(url)
        checkpoint.streams = streams or default_read_streams()
        try:
            names = sorted(e.name for e in checkpoint.store.list("") if "/" not in e.name)
            if INDEX_FILE in names:
                weight_map = json.loads(checkpoint.store.read(INDEX_FILE).data)["weight_map"]
                files = sorted(set(weight_map.values()))
                missing = [f for f in files if f not in names]
                if missing:
                    raise BadInput(f"weights file {missing[0]} named by {INDEX_FILE} is missing from {url}")
            else:
                files = [n for n in names if n.endswith(".safetensors")]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise BadInput(f"weights index {url}/{INDEX_FILE} is unreadable or has no weight_map: {exc}") from exc
        except objectstore.StoreError as exc:
            raise TransientIOError(f"model={url!r}: listing its weights failed: {exc}") from exc
        if not files:
            raise BadInput(f"model={url!r} has no *.safetensors weights (model.safetensors or shards)")
        checkpoint.tensors = {}
        for file in files:
            checkpoint.tensors.update(read_safetensors_header(file, checkpoint.store))
        return checkpoint

    def __init__(self, model_dir: pathlib.Path):
        self.model_dir = model_dir
        index_path = model_dir / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
                raise BadInput(f"weights index {index_path} is unreadable or has no weight_map: {exc}") from exc
            files = sorted({model_dir / name for name in weight_map.values()})
            for file in files:
                if not file.is_file():
                    raise BadInput(f"weights file {file.name} named by {INDEX_FILE} is missing from {model_dir}")
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                raise BadInput(
                    f"model directory {model_dir} has no *.safetensors weights (model.safetensors or shards)"
                )
        self.tensors: dict[str, TensorLocation] = {}
        for file in files:
            self.tensors.update(read_safetensors_header(file))

    def read(self, name: str, rows: Sequence[tuple[int, int]] | None = None) -> np.ndarray:
        """One tensor, or the [start, end) `rows` of it (along its first axis, concatenated in order: one part of
        a fused tensor). Local files: a read-only memory map (no copy until the caller converts it), or the rows
        copied out of it; a store: ranged reads of exactly those bytes."""
        location = self.tensors.get(name)
        if location is None:
            raise BadInput(f"tensor {name} is missing from the checkpoint in {self.model_dir}")
        if location.dtype is None:
            raise BadInput(f"tensor {name} in {location.file.name} has a dtype that is not a float type")
        if rows is not None and (not location.shape or any(not 0 <= a < b <= location.shape[0] for a, b in rows)):
            raise BadInput(f"tensor {name} has shape {location.shape}, too small for the rows {list(rows)} the config needs")
        if self.store is not None:
            return self._read_ranges(name, location, rows)
        try:
            if not location.shape or 0 in location.shape:
                return np.zeros(location.shape, location.dtype)
            whole = np.memmap(
                location.file, dtype=location.dtype, mode="r", offset=location.offset, shape=location.shape
            )
        except OSError as exc:
            raise TransientIOError(f"tensor {name} in {location.file} could not be read: {exc}") from exc
        if rows is None:
            return whole
        return whole[rows[0][0] : rows[0][1]] if len(rows) == 1 else np.concatenate([whole[a:b] for a, b in rows])

    def _read_ranges(
        self, name: str, location: TensorLocation, rows: Sequence[tuple[int, int]] | None = None
    ) -> np.ndarray:
        row_bytes = location.dtype.itemsize * int(np.prod(location.shape[1:], dtype=np.int64))
        spans = [(a * row_bytes, b * row_bytes) for a, b in rows] if rows is not None else [
            (0, location.dtype.itemsize * int(np.prod(location.shape, dtype=np.int64)))]  # fmt: skip
        nbytes = sum(end - start for start, end in spans)
        buffer = np.empty(nbytes, dtype=np.uint8)
        view = memoryview(buffer)
        # Each span lands after the previous ones in the buffer, cut into pieces of at most READ_PIECE_BYTES.
        pieces, at = [], 0
        for start, end in spans:
            for lo in range(start, end, READ_PIECE_BYTES):
                hi = min(end, lo + READ_PIECE_BYTES)
                pieces.append((lo, hi, at))
                at += hi - lo

        def piece(lo: int, hi: int, at: int) -> None:
            data = self.store.read_range(str(location.file), location.offset + lo, location.offset + hi)
            if len(data) != hi - lo:
                raise TransientIOError(f"tensor {name} in {self.store.url(str(location.file))}: short read at {lo}")
            view[at : at + hi - lo] = data

        if self._pool is None:
            # Shared by every tensor being loaded: pieces never wait on other pieces, so callers may block on them.
            self._pool = ThreadPoolExecutor(max_workers=self.streams, thread_name_prefix="weights-read")
        try:
            for future in [self._pool.submit(piece, *p) for p in pieces]:
                future.result()
        except objectstore.StoreError as exc:
            where = self.store.url(str(location.file))
            raise TransientIOError(f"tensor {name} in {where} could not be read: {exc}") from exc
        shape = location.shape if rows is None else (sum(b - a for a, b in rows), *location.shape[1:])
        return buffer.view(location.dtype).reshape(shape)


# -- parameters ---------------------------------------------------------------------------------------------------


def to_model_layout(stored: Stored, tensor: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A checkpoint tensor (its rows already chosen) in the model's layout: torch Linear weights are [out, in] and
    are transposed, GPT-2's Conv1D weights are [in, out] already (a fused one's columns chosen here); then reshaped
    to the model's [in, ..., out-split]."""
    if stored.layout in ("linear", "conv1d") and tensor.ndim != 2:
        raise BadInput(f"tensor {stored.name} has shape {tensor.shape}; a linear weight must be 2-D")
    if stored.layout == "linear":
        tensor = tensor.T
    elif stored.layout == "conv1d" and stored.ranges is not None:
        if any(not 0 <= a < b <= tensor.shape[1] for a, b in stored.ranges):
            raise BadInput(f"tensor {stored.name} has shape {tensor.shape}, too small for the config's columns")
        tensor = np.concatenate([tensor[:, a:b] for a, b in stored.ranges], axis=1)
    if tensor.size != int(np.prod(shape, dtype=np.int64)):
        raise BadInput(f"tensor {stored.name} has shape {tensor.shape}, which does not fit the config's shape {shape}")
    return tensor.reshape(shape)


def load_state(
    checkpoint: Checkpoint,
    abstract_state: nnx.State,
    mesh: Mesh,
    rules: ShardingRules,
    dtype,
    workers: int = LOAD_WORKERS,
    *,
    config: ModelConfig,
) -> nnx.State:
    """Fill `abstract_state` (from `nnx.eval_shape`) with checkpoint tensors placed on their shardings.

    `workers` tensors are read, converted and placed at once, so reads (ranged, from a store) overlap
    conversion and transfer; the host holds at most that many tensors. `config` says which tensor holds each
    parameter (extract/names.py: the family's names, its norms by position, the parts of fused tensors)."""
    target_dtype = np.dtype(dtype)
    prefix = names.prefix_for(config, checkpoint.tensors)

    def place(path, variable) -> jax.Array:
        stored = names.tensor_for(config, path, prefix)
        shape = tuple(variable.get_value().shape)
        sharding = NamedSharding(mesh, getattr(rules, variable.get_metadata()["role"]))
        rows = stored.ranges if stored.layout != "conv1d" else None  # Conv1D parts are columns: read whole
        if stored.experts:  # one tensor per expert, stacked along the model's first (experts) axis
            if shape[0] != stored.experts:
                raise BadInput(f"{stored.name}: the config has {shape[0]} experts, the names {stored.experts}")
            host = np.stack([
                to_model_layout(dataclasses.replace(stored, name=name), checkpoint.read(name, rows), shape[1:])
                for name in stored.expert_names()
            ])  # fmt: skip
        else:
            host = to_model_layout(stored, checkpoint.read(stored.name, rows), shape)
        # astype copies out of the memory map (and converts); skip the copy when the layout already matches.
        host = np.ascontiguousarray(host.astype(target_dtype, copy=False))
        placed = jax.device_put(host, sharding)
        # Wait for the transfer before this worker reads its next tensor, so host memory stays bounded.
        placed.block_until_ready()
        return placed

    items = list(nnx.to_flat_state(abstract_state))
    if {device.process_index for device in mesh.devices.flat} != {jax.process_index()}:
        # Across the processes of a slice, placing a tensor is a collective (device_put checks that every
        # process passes the same value), and collectives must come in the same order on every process:
        # threads would interleave them differently on each host and the slice's collectives mismatch.
        workers = 1
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="weights-place") as pool:
        placed_values = list(pool.map(lambda item: place(*item), items))
    checkpoint.close()
    values: dict = {}
    for (path, _), placed in zip(items, placed_values):
        node = values
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = placed
    nnx.replace_by_pure_dict(abstract_state, values)
    return abstract_state

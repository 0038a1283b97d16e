"""Data files: where they are (local, gs://, hf://), how many rows each holds, and streaming a task's slice of them.

Nothing here downloads a whole dataset. Parquet row counts come from the footer (a few ranged
reads); a slice is read with `iter_batches` over only the row groups it touches, and only the text
column. JSON Lines are read line by line. A `.json` file is either JSON Lines or one JSON array;
an array is parsed whole, so prefer parquet or `.jsonl` for large data.

Row numbering: the rows of a parquet file are its records in order; the rows of a JSON Lines file
are its non-blank lines in order; the rows of a JSON array file are its elements.

Errors: a file that is missing, unreadable or malformed, a missing text field and a non-string
text are `BadInput` (exit 65). Transient store or network failures stay `StoreUnavailable` or
become `TransientIOError` (exit 75), so the task is retried.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import glob
import importlib
import json
import logging
import os
import pathlib
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

from extract.errors import BadInput, TransientIOError
from extract.job import HubDataset, Job, Task

log = logging.getLogger(__name__)

FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "json"}
_GLOB_CHARS = "*?["
_PARQUET_READ_ROWS = 1024


def file_format(url: str) -> str:
    suffix = pathlib.PurePosixPath(url).suffix.lower()
    if suffix not in FORMATS:
        raise BadInput(f"data file {url}: unsupported extension {suffix!r}; use .parquet, .jsonl or .json")
    return FORMATS[suffix]


def _split_gs(url: str) -> tuple[str, str]:
    bucket, _, key = url[len("gs://") :].partition("/")
    if not bucket:
        raise BadInput(f"data file {url}: not a gs://bucket/path URL")
    return bucket, key


@functools.lru_cache(maxsize=16)
def _bucket_store(bucket: str):
    """One store (and so one HTTP client) per bucket, shared by every file read from it."""
    import objectstore

    return objectstore.open_store(f"gs://{bucket}")


@functools.lru_cache(maxsize=1)
def _hf_fs():
    from huggingface_hub import HfFileSystem

    return HfFileSystem()


def _hub_transport_errors() -> tuple[type[BaseException], ...]:
    """huggingface_hub talks HTTP through httpx2 (httpx in older releases); their transport errors are transient."""
    for name in ("httpx2", "httpx"):
        try:
            return (importlib.import_module(name).TransportError,)
        except ImportError:
            continue
    return (ConnectionError, TimeoutError)


@contextlib.contextmanager
def _hub_errors(url: str) -> Iterator[None]:
    """Hub failures: a missing repo/file/revision is bad input, anything on the wire is transient."""
    from huggingface_hub import errors as hub_errors

    try:
        yield
    except (hub_errors.RepositoryNotFoundError, hub_errors.RevisionNotFoundError, hub_errors.EntryNotFoundError) as exc:
        raise BadInput(
            f"data file {url}: not found on the Hub ({exc.__class__.__name__}); check the dataset name and path"
        ) from exc
    except hub_errors.HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status is not None and (status == 429 or status >= 500):
            raise TransientIOError(f"data file {url}: Hub answered {status}; retry later") from exc
        raise BadInput(f"data file {url}: Hub refused the request ({status}): {exc}") from exc
    except _hub_transport_errors() as exc:
        raise TransientIOError(f"data file {url}: cannot reach the Hub ({exc}); retry later") from exc


def open_binary(url: str) -> BinaryIO:
    """A seekable binary file for a local path, a gs:// object (ranged reads) or an hf:// file."""
    from objectstore import NotFound

    if url.startswith("gs://"):
        bucket, key = _split_gs(url)
        try:
            return _bucket_store(bucket).open_read(key)
        except NotFound as exc:
            raise BadInput(f"data file {url}: does not exist; check the path in the job or task") from exc
    if url.startswith("hf://"):
        with _hub_errors(url):
            try:
                return _hf_fs().open(url, "rb")
            except FileNotFoundError as exc:
                raise BadInput(f"data file {url}: does not exist on the Hub") from exc
    try:
        return open(url, "rb")
    except OSError as exc:
        raise BadInput(f"data file {url}: cannot be read ({exc.strerror or exc}); check the path") from exc


# -- which files -------------------------------------------------------------------------------


def _expand_local(pattern: str) -> list[str]:
    path = pathlib.Path(pattern).expanduser()
    if any(c in pattern for c in _GLOB_CHARS):
        matches = [m for m in glob.glob(str(path), recursive=True) if os.path.isfile(m)]
    elif path.is_dir():
        matches = [str(p) for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FORMATS]
    else:
        matches = [str(path)]
    return sorted(os.path.abspath(m) for m in matches)


def _expand_gs(pattern: str) -> list[str]:
    bucket, key = _split_gs(pattern)
    store = _bucket_store(bucket)
    if any(c in key for c in _GLOB_CHARS):
        first = min(key.index(c) for c in _GLOB_CHARS if c in key)
        prefix = key[: key.rfind("/", 0, first) + 1]
        names = [e.name for e in store.list(prefix) if fnmatch.fnmatchcase(e.name, key)]
    elif pathlib.PurePosixPath(key).suffix.lower() in FORMATS:
        names = [key]
    else:
        prefix = key.rstrip("/") + "/" if key else ""
        names = [e.name for e in store.list(prefix) if pathlib.PurePosixPath(e.name).suffix.lower() in FORMATS]
    return sorted(f"gs://{bucket}/{name}" for name in names)


def expand_data_files(patterns: Iterable[str]) -> list[str]:
    """Globs and directories expanded to files, each pattern's matches sorted, duplicates dropped.

    A glob's `*` also matches `/` on gs:// (fnmatch semantics); `**` recurses locally.
    """
    files: list[str] = []
    seen: set[str] = set()
    for pattern in patterns:
        if pattern.startswith("gs://"):
            matches = _expand_gs(pattern)
        elif pattern.startswith("hf://"):
            with _hub_errors(pattern):
                globbed = any(c in pattern for c in _GLOB_CHARS)
                matches = sorted("hf://" + m for m in _hf_fs().glob(pattern)) if globbed else [pattern]
        else:
            matches = _expand_local(pattern)
        if not matches:
            raise BadInput(f"data_files: {pattern!r} matches no file; check the path or glob")
        for match in matches:
            file_format(match)
            if match not in seen:
                seen.add(match)
                files.append(match)
    return files


def resolve_hub_dataset(dataset: HubDataset) -> list[str]:
    """The hf:// data files of a Hub dataset's config and split, pinned to a commit.

    The dataset card's `configs` say which files make up each config and split; `datasets` reads
    them (only metadata, never the data). Script-based datasets without data files fall back to
    the Hub's parquet export (`refs/convert/parquet`).
    """
    from datasets import load_dataset_builder

    with _hub_errors(f"hf://datasets/{dataset.name}"):
        try:
            builder = load_dataset_builder(dataset.name, dataset.config, revision=dataset.revision)
        except FileNotFoundError as exc:
            raise BadInput(f"dataset.name: {dataset.name!r} not found on the Hub ({exc})") from exc
        except ValueError as exc:  # datasets' way of saying the config name is unknown
            raise BadInput(f"dataset.config: {dataset.config!r} is not a config of {dataset.name}: {exc}") from exc
        except ConnectionError as exc:  # datasets' way of saying the Hub is unreachable
            raise TransientIOError(f"dataset.name: cannot reach {dataset.name} on the Hub ({exc}); retry later") from exc
        data_files = builder.config.data_files
        if data_files:
            if dataset.split not in data_files:
                raise BadInput(
                    f"dataset.split: {dataset.split!r} is not a split of {dataset.name}; it has {', '.join(data_files)}"
                )
            files = [str(f) for f in data_files[dataset.split]]
        else:
            config = dataset.config or "default"
            export = f"datasets/{dataset.name}@refs%2Fconvert%2Fparquet/{config}/{dataset.split}/*.parquet"
            files = ["hf://" + f for f in _hf_fs().glob(export)]
    files = sorted(f for f in files if pathlib.PurePosixPath(f).suffix.lower() in FORMATS)
    if not files:
        raise BadInput(
            f"dataset: {dataset.name} config={dataset.config} split={dataset.split} has no parquet or JSON data files"
        )
    return files


def job_data_files(job: Job) -> list[str]:
    """The job's data files in the order that defines global sample ids."""
    if job.dataset is not None:
        return resolve_hub_dataset(job.dataset)
    return expand_data_files(job.data_files)


# -- how many rows ------------------------------------------------------------------------------


def _parquet_file(url: str, source: Any):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(source)
    except (pa.ArrowInvalid, OSError) as exc:
        raise BadInput(f"data file {url}: not a readable parquet file ({exc})") from exc


@contextlib.contextmanager
def _opened(url: str) -> Iterator[Any]:
    """A local parquet file is opened by path (pyarrow maps it); everything else through open_binary."""
    if file_format(url) == "parquet" and not url.startswith(("gs://", "hf://")):
        if not os.path.isfile(url):
            raise BadInput(f"data file {url}: does not exist or is not a file; check the path")
        yield url
        return
    with open_binary(url) as handle:
        yield handle


def _nonblank_lines(handle: BinaryIO) -> Iterator[bytes]:
    for line in handle:
        if line.strip():
            yield line


def _json_array(url: str, handle: BinaryIO) -> list[Any]:
    try:
        rows = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadInput(f"data file {url}: not valid JSON ({exc})") from exc
    if not isinstance(rows, list):
        raise BadInput(f"data file {url}: a .json file must be a JSON array of objects or JSON Lines")
    return rows


def _is_json_array(handle: BinaryIO) -> bool:
    """Peek at the first non-blank byte; `[` means one JSON array, anything else JSON Lines."""
    start = handle.tell()
    head = handle.read(4096).lstrip()
    handle.seek(start)
    return head[:1] == b"["


def count_rows(url: str) -> int:
    """Rows in one data file: parquet from its footer only; JSON by reading it through once."""
    fmt = file_format(url)
    with _opened(url) as source:
        if fmt == "parquet":
            return _parquet_file(url, source).metadata.num_rows
        if fmt == "json" and _is_json_array(source):
            return len(_json_array(url, source))
        return sum(1 for _ in _nonblank_lines(source))


# -- reading a slice ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Document:
    """One row of the task's slice: its position in the slice, its global sample id, its text."""

    position: int
    sample_id: int
    text: str


def _check_text(url: str, row: int, text: Any, text_field: str) -> str:
    if not isinstance(text, str):
        kind = "null" if text is None else type(text).__name__
        raise BadInput(
            f"text_field: {text_field!r} of row {row} in {url} is {kind}, not a string; fix the data or the field"
        )
    return text


def _parquet_text_column(url: str, pf: Any, text_field: str) -> None:
    import pyarrow as pa

    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise BadInput(
            f"text_field: {text_field!r} is not a column of {url} (columns: {', '.join(schema.names)}); "
            "set text_field in the job"
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise BadInput(f"text_field: column {text_field!r} of {url} has type {kind}, not string; pick a text column")


def _parquet_rows(url: str, source: Any, text_field: str, start: int, end: int) -> Iterator[tuple[int, str]]:
    pf = _parquet_file(url, source)
    _parquet_text_column(url, pf, text_field)
    meta = pf.metadata
    if end > meta.num_rows:
        raise BadInput(
            f"task.files: {url} has {meta.num_rows} rows, the task asks for rows up to {end}; re-plan the tasks"
        )
    selected: list[int] = []
    first_row = None
    row = 0
    for group in range(meta.num_row_groups):
        n = meta.row_group(group).num_rows
        if row < end and row + n > start:
            selected.append(group)
            first_row = row if first_row is None else first_row
        row += n
    if not selected:
        return
    row = first_row
    batches = pf.iter_batches(
        batch_size=_PARQUET_READ_ROWS, row_groups=selected, columns=[text_field], use_threads=False
    )
    for batch in batches:
        column = batch.column(0)
        lo, hi = max(start - row, 0), min(end - row, len(column))
        if lo < hi:
            for i, text in enumerate(column.slice(lo, hi - lo).to_pylist()):
                yield row + lo + i, _check_text(url, row + lo + i, text, text_field)
        row += len(column)
        if row >= end:
            return


def _json_text(url: str, row: int, record: Any, text_field: str) -> str:
    if not isinstance(record, dict):
        raise BadInput(f"data file {url}: row {row} is {type(record).__name__}, not a JSON object")
    if text_field not in record:
        raise BadInput(
            f"text_field: {text_field!r} is missing from row {row} of {url} (keys: {', '.join(record)}); "
            "set text_field in the job"
        )
    return _check_text(url, row, record[text_field], text_field)


def _json_rows(url: str, handle: BinaryIO, text_field: str, start: int, end: int) -> Iterator[tuple[int, str]]:
    if _is_json_array(handle):
        records: Iterable[tuple[int, Any]] = enumerate(_json_array(url, handle))
    else:
        records = ((row, line) for row, line in enumerate(_nonblank_lines(handle)))
    row = -1
    for row, record in records:
        if row < start:
            continue
        if row >= end:
            return
        if isinstance(record, bytes):
            try:
                record = json.loads(record)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise BadInput(f"data file {url}: row {row} is not valid JSON ({exc})") from exc
        yield row, _json_text(url, row, record, text_field)
    if row + 1 < end:
        raise BadInput(f"task.files: {url} has {row + 1} rows, the task asks for rows up to {end}; re-plan the tasks")


def check_task_files(task: Task, text_field: str) -> None:
    """Fail fast, before the model loads: every file opens, has the rows and (parquet) a string text column."""
    for entry in task.files:
        if entry.rows == 0:
            continue
        with _opened(entry.path) as source:
            if file_format(entry.path) == "parquet":
                pf = _parquet_file(entry.path, source)
                _parquet_text_column(entry.path, pf, text_field)
                if entry.end > pf.metadata.num_rows:
                    raise BadInput(
                        f"task.files: {entry.path} has {pf.metadata.num_rows} rows, "
                        f"the task asks for rows up to {entry.end}; re-plan the tasks"
                    )


def read_slice(task: Task, text_field: str, skip: int = 0) -> Iterator[Document]:
    """The task's documents in slice order, starting at position `skip` (rows before it are not read)."""
    position = 0
    for entry in task.files:
        if skip >= position + entry.rows:
            position += entry.rows
            continue
        start = entry.start + max(skip - position, 0)
        position = max(position, skip)
        with _opened(entry.path) as source:
            if file_format(entry.path) == "parquet":
                rows = _parquet_rows(entry.path, source, text_field, start, entry.end)
            else:
                rows = _json_rows(entry.path, source, text_field, start, entry.end)
            for row, text in rows:
                yield Document(position=position, sample_id=entry.base + row, text=text)
                position += 1


def read_bytes(url: str) -> bytes:
    """A whole object: for shards and done markers, which are read in one piece."""
    if url.startswith("gs://"):
        from objectstore import NotFound

        bucket, key = _split_gs(url)
        try:
            return _bucket_store(bucket).read(key).data
        except NotFound as exc:
            raise FileNotFoundError(f"{url} does not exist") from exc
    with open_binary(url) if url.startswith("hf://") else open(url, "rb") as handle:
        return handle.read()


def read_head(url: str, size: int, offset: int = 0) -> bytes:
    """`size` bytes at `offset` (a ranged read on gs://)."""
    if url.startswith("gs://"):
        bucket, key = _split_gs(url)
        from objectstore import NotFound

        try:
            handle = _bucket_store(bucket).open_read(key)
        except NotFound as exc:
            raise FileNotFoundError(f"{url} does not exist") from exc
    else:
        handle = open(url, "rb")
    with handle:
        handle.seek(offset)
        return handle.read(size)


def list_shards(prefix: str) -> list[str]:
    """Every `*.safetensors` object under a local directory or a gs:// prefix, sorted by name."""
    if prefix.startswith("gs://"):
        bucket, key = _split_gs(prefix)
        key = key.rstrip("/") + "/" if key else ""
        entries = _bucket_store(bucket).list(key)
        return sorted(f"gs://{bucket}/{e.name}" for e in entries if e.name.endswith(".safetensors"))
    return sorted(str(p) for p in pathlib.Path(prefix).rglob("*.safetensors") if p.is_file())


__all__ = [
    "Document",
    "check_task_files",
    "count_rows",
    "expand_data_files",
    "file_format",
    "job_data_files",
    "list_shards",
    "open_binary",
    "read_bytes",
    "read_head",
    "read_slice",
    "resolve_hub_dataset",
]

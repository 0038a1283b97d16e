"""Data files: where they are (local, gs://, hf://), how many rows each holds, and streaming a task's slice of them.

Nothing here downloads a whole dataset. Parquet row counts come from the footer (a few ranged
reads); a slice is read with `iter_batches` over only the row groups it touches, and only the text
column. JSON Lines are read line by line. A `.json` file is either JSON Lines or one JSON array;
an array is parsed whole, so prefer parquet or `.jsonl` for large data.

Row numbering: the rows of a parquet file are its records in order; the rows of a JSON Lines file
are its non-blank lines in order; the rows of a JSON array file are its elements.

Errors: a file that is missing, unreadable or malformed, a parquet text column that is missing or
not a string column, and a JSON slice in which no row has the text field are `BadInput` (exit 65):
they are mistakes in the job or the file, not in one row. A *bad row* (null, missing or non-string
text, bytes that are not UTF-8, a JSON line that does not parse) is not an error here: its `Document` carries a `BadRow`
and the caller applies the job's `on_bad_row`. Transient store or network failures stay
`StoreUnavailable` or become `TransientIOError` (exit 75), so the task is retried.
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
from objectstore.address import BadAddress, split_gs
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
    try:
        return split_gs(url, "data file")
    except BadAddress as exc:
        raise BadInput(str(exc)) from None


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
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(source)
    except Exception as exc:
        if not _is_corrupt_parquet(exc):
            raise  # e.g. a connection error from the gs:// reader: transient, not a bad file
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
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nesting too deep
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


#: Why a row is bad; the `reason` of a skipped-row entry (docs/EXTRACTION.md, "Bad rows").
BAD_ROW_REASONS = (
    "null", "missing_field", "not_a_string", "invalid_utf8", "invalid_json", "not_an_object", "lone_surrogate",
    "untokenizable", "non_finite",
)  # fmt: skip
#: A bad row's detail is cut to this many characters, so that records of skipped rows stay small.
MAX_DETAIL_CHARS = 160


@dataclasses.dataclass(frozen=True)
class BadRow:
    """Why one row cannot be extracted: a reason from BAD_ROW_REASONS and a short human detail."""

    reason: str
    detail: str

    def __post_init__(self) -> None:
        if self.reason not in BAD_ROW_REASONS:
            raise ValueError(f"unknown bad-row reason {self.reason!r}")


@dataclasses.dataclass(frozen=True)
class Document:
    """One row of the task's slice: its position in the slice, its global sample id, its text.

    `url` and `row` say where it came from. A bad row has `bad` set and an empty `text`; it keeps
    its position and sample id, so the ids of the other rows never move.
    """

    position: int
    sample_id: int
    text: str
    url: str = ""
    row: int = -1
    bad: BadRow | None = None

    def skipped_entry(self) -> dict[str, Any]:
        """How a skipped row is recorded in its shard's progress record (and so in the done marker)."""
        assert self.bad is not None
        return {
            "sample_id": self.sample_id,
            "file": self.url,
            "row": self.row,
            "reason": self.bad.reason,
            "detail": self.bad.detail[:MAX_DETAIL_CHARS],
        }

    def bad_row_error(self) -> BadInput:
        """With `on_bad_row: fail`: the exit-65 error naming the file, the row and the reason."""
        assert self.bad is not None
        return BadInput(
            f"data file {self.url}: row {self.row} (sample id {self.sample_id}) is a bad row, "
            f"{self.bad.reason}: {self.bad.detail[:MAX_DETAIL_CHARS]}; fix the row, "
            'or set "on_bad_row": "skip" in the job to record such rows and extract the others'
        )


def _check_text(text: Any, text_field: str) -> str | BadRow:
    if text is None:
        return BadRow("null", f"text_field {text_field!r} is null")
    if not isinstance(text, str):
        return BadRow("not_a_string", f"text_field {text_field!r} is {type(text).__name__}, not a string")
    return text


def _decode_utf8(raw: bytes | None, text_field: str) -> str | BadRow:
    """One value of a parquet string column read as bytes; invalid UTF-8 becomes a bad row."""
    if raw is None:
        return _check_text(None, text_field)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BadRow("invalid_utf8", f"text_field {text_field!r}: {exc.reason} at byte {exc.start}")


def _column_values(column: Any, text_field: str) -> list[str | BadRow]:
    """A parquet text column slice as Python values.

    Parquet does not check that a string column holds UTF-8, so one bad value makes `to_pylist`
    raise for the whole slice. Only then is the slice re-read as bytes (a cast, which checks nothing) and
    decoded row by row, so that the bad value is one bad row and the good ones keep their text.
    """
    import pyarrow as pa

    try:
        return [_check_text(text, text_field) for text in column.to_pylist()]
    except UnicodeDecodeError:
        pass
    kind = column.type
    binary = pa.large_binary() if pa.types.is_large_string(kind) else pa.binary()
    if pa.types.is_string_view(kind):
        binary = pa.binary_view()
    return [_decode_utf8(raw, text_field) for raw in column.cast(binary).to_pylist()]


def _is_corrupt_parquet(exc: BaseException) -> bool:
    """pyarrow's own failures on a file's bytes: a plain OSError (pyarrow's IOError, e.g. "Couldn't deserialize
    thrift"), ArrowInvalid, or ArrowNotImplementedError (a codec or encoding this pyarrow cannot read).
    Exceptions raised by a Python file object (the gs:// and Hub readers) reach us unchanged and are other
    types (ConnectionError, TimeoutError, StoreUnavailable...), so a transient network failure is never
    mistaken for a corrupt file."""
    import pyarrow as pa

    return isinstance(exc, (pa.ArrowInvalid, pa.ArrowNotImplementedError)) or type(exc) is OSError


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


def _parquet_rows(url: str, source: Any, text_field: str, start: int, end: int) -> Iterator[tuple[int, str | BadRow]]:
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
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:
            if not _is_corrupt_parquet(exc):
                raise
            raise BadInput(
                f"data file {url}: the data after row {row} cannot be decoded ({exc}); "
                "the file is corrupt: rewrite it or leave it out of the job"
            ) from exc
        if batch is None:
            return
        column = batch.column(0)
        lo, hi = max(start - row, 0), min(end - row, len(column))
        if lo < hi:
            for i, text in enumerate(_column_values(column.slice(lo, hi - lo), text_field)):
                yield row + lo + i, text
        row += len(column)
        if row >= end:
            return


def _json_text(record: Any, text_field: str) -> str | BadRow:
    if not isinstance(record, dict):
        return BadRow("not_an_object", f"the row is a JSON {type(record).__name__}, not an object")
    if text_field not in record:
        # JSON rows need not share keys, so one row without the field is that row's problem (like a null); a
        # parquet file without the column is a job error (`_parquet_text_column`), and so is a JSON slice in
        # which no row has the field (`_json_rows`): both are what a wrong `text_field` looks like.
        return BadRow("missing_field", f"text_field {text_field!r} is missing (keys: {', '.join(record)[:100]})")
    return _check_text(record[text_field], text_field)


def _json_rows(
    url: str, handle: BinaryIO, text_field: str, start: int, end: int, whole_slice: bool
) -> Iterator[tuple[int, str | BadRow]]:
    if _is_json_array(handle):
        records: Iterable[tuple[int, Any]] = enumerate(_json_array(url, handle))
    else:
        records = ((row, line) for row, line in enumerate(_nonblank_lines(handle)))
    row = -1
    # Object rows with and without the text field: a slice read from its first row in which rows lack it and none
    # has it is a wrong text_field. (A resumed attempt reads part of the slice and does not judge.)
    found = missing = 0
    for row, record in records:
        if row < start:
            continue
        if row >= end:
            break
        if isinstance(record, bytes):
            try:
                record = json.loads(record)
            except UnicodeDecodeError as exc:
                yield row, BadRow("invalid_utf8", f"the line is not UTF-8: {exc.reason} at byte {exc.start}")
                continue
            except json.JSONDecodeError as exc:
                yield row, BadRow("invalid_json", f"the line is not JSON: {exc}")
                continue
            except RecursionError:
                yield row, BadRow("invalid_json", "the line nests JSON deeper than Python's recursion limit")
                continue
        text = _json_text(record, text_field)
        if isinstance(text, BadRow) and text.reason == "missing_field":
            missing += 1
        elif isinstance(record, dict):
            found += 1
        yield row, text
    else:
        if row + 1 < end:
            raise BadInput(
                f"task.files: {url} has {row + 1} rows, the task asks for rows up to {end}; re-plan the tasks"
            )
    if missing and not found and whole_slice:
        raise BadInput(
            f"text_field: {text_field!r} is in no row ({start}..{end - 1}) of {url}; "
            "set text_field in the job"
        )


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
    """The task's documents in slice order, starting at position `skip` (rows before it are not read).

    Every position yields one document; a bad row is a document with `bad` set (see `BadRow`).
    """
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
                rows = _json_rows(entry.path, source, text_field, start, entry.end, start == entry.start)
            for row, text in rows:
                if isinstance(text, BadRow):
                    yield Document(position, entry.base + row, "", url=entry.path, row=row, bad=text)
                else:
                    yield Document(position, entry.base + row, text, url=entry.path, row=row)
                position += 1


__all__ = [
    "BAD_ROW_REASONS",
    "BadRow",
    "Document",
    "check_task_files",
    "count_rows",
    "expand_data_files",
    "file_format",
    "job_data_files",
    "open_binary",
    "read_slice",
    "resolve_hub_dataset",
]

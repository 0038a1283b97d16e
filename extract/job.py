"""The inputs of one extraction task, validated here and nowhere else: the job, the task manifest, the resume state.

Every rule a field must follow lives in this module, and every violation is a `BadInput` whose
message names the field and says what to write instead. Unknown fields are errors too, so that a
typo (`"layer": [3]`) fails the task at once instead of silently running with a default.

Sample identity is defined here as well: a task lists file slices in order; position `p` within
the task's slice counts rows across those slices; the global sample id of row `r` of a file is
`file.base + r`, where `base` is the number of rows in the files before it in the job's sorted
file list (tools/make_tasks.py computes it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from extract.errors import BadInput

#: Output dtypes: job spelling -> numpy/JAX dtype name.
OUT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: Compute dtypes the engine runs in.
COMPUTE_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
#: Smallest default bucket: below it padding costs less than another compiled program.
MIN_DEFAULT_BUCKET = 64
MESH_AXES = ("data", "model")
#: What a bad row (null, not UTF-8, lone surrogate, untokenisable) does: skipped and recorded, or fails the task.
ON_BAD_ROW = ("skip", "fail")

_JOB_FIELDS = {
    "dataset", "data_files", "text_field", "model", "layers", "max_seq_len", "batch_size",
    "dtype", "compute_dtype", "shard_size", "mesh", "buckets", "on_bad_row",
}  # fmt: skip
# Shard sizing by bytes (writer throughput, issue 10 section 2).
_JOB_FIELDS |= {"shard_bytes", "packing"}
#: Default cap of a shard's tensor bytes: large enough that per-object overheads vanish, small enough that a few
#: shards in flight fit any host's memory (about 100-500 MB is a sensible object).
DEFAULT_SHARD_BYTES = 256 * 1024 * 1024
_DATASET_FIELDS = {"name", "config", "split", "revision"}
_TASK_FIELDS = {"id", "files"}
_FILE_FIELDS = {"path", "base", "start", "end"}


def _fail(where: str, problem: str, fix: str) -> BadInput:
    return BadInput(f"{where}: {problem}; {fix}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(where: str, value: Any) -> int:
    if not _is_int(value) or value <= 0:
        raise _fail(where, f"got {value!r}", "use a positive integer")
    return value


def _non_negative_int(where: str, value: Any) -> int:
    if not _is_int(value) or value < 0:
        raise _fail(where, f"got {value!r}", "use an integer >= 0")
    return value


def _non_empty_str(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(where, f"got {value!r}", "use a non-empty string")
    return value


def _bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, f"got {value!r}", "use true or false")
    return value


def _reject_unknown(where: str, raw: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise _fail(
            f"{where}.{unknown[0]}" if where else unknown[0],
            "unknown field" + (f" (also unknown: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""),
            f"remove it or use one of: {', '.join(sorted(allowed))}",
        )


def default_buckets(max_seq_len: int) -> tuple[int, ...]:
    """Powers of two from 64 (or max_seq_len if smaller) up to max_seq_len, which is always the last."""
    buckets = []
    length = min(MIN_DEFAULT_BUCKET, max_seq_len)
    while length < max_seq_len:
        buckets.append(length)
        length *= 2
    buckets.append(max_seq_len)
    return tuple(buckets)


def parse_mesh(spec: str) -> dict[str, int]:
    """`"data=2,model=2"` -> {"data": 2, "model": 2}; raises BadInput naming `mesh`."""
    axes: dict[str, int] = {}
    for part in spec.split(","):
        match = re.fullmatch(r"\s*([a-z]+)\s*=\s*(\d+)\s*", part)
        if not match or match.group(1) not in MESH_AXES or int(match.group(2)) <= 0 or match.group(1) in axes:
            raise _fail(
                "mesh",
                f"{spec!r} is not a mesh",
                f"write axis=size pairs over {'/'.join(MESH_AXES)}, e.g. 'data=2,model=2'",
            )
        axes[match.group(1)] = int(match.group(2))
    return axes


@dataclasses.dataclass(frozen=True)
class HubDataset:
    """A Hugging Face Hub dataset; resolved to its data files by tools/make_tasks.py."""

    name: str
    config: str | None = None
    split: str = "train"
    revision: str | None = None


@dataclasses.dataclass(frozen=True)
class Job:
    """job.json. A shard ends after `shard_size` samples (documents) or before its tensors pass `shard_bytes`."""

    model: str
    layers: tuple[int, ...]
    max_seq_len: int
    batch_size: int
    shard_size: int
    buckets: tuple[int, ...]
    dataset: HubDataset | None = None
    data_files: tuple[str, ...] = ()
    text_field: str = "text"
    dtype: str = "bf16"
    compute_dtype: str = "bf16"
    mesh: str | None = None
    on_bad_row: str = "skip"
    shard_bytes: int = DEFAULT_SHARD_BYTES
    packing: bool = False  # several documents per row (extract.batching.pack_window)

    @property
    def out_dtype_name(self) -> str:
        return OUT_DTYPES[self.dtype]

    @property
    def compute_dtype_name(self) -> str:
        return COMPUTE_DTYPES[self.compute_dtype]

    def to_dict(self) -> dict[str, Any]:
        """The job as it would be written in job.json (buckets resolved), for shard metadata."""
        out: dict[str, Any] = {
            "model": self.model,
            "layers": list(self.layers),
            "max_seq_len": self.max_seq_len,
            "batch_size": self.batch_size,
            "shard_size": self.shard_size,
            "buckets": list(self.buckets),
            "text_field": self.text_field,
            "dtype": self.dtype,
            "compute_dtype": self.compute_dtype,
            "on_bad_row": self.on_bad_row,
        }
        if self.dataset is not None:
            out["dataset"] = {k: v for k, v in dataclasses.asdict(self.dataset).items() if v is not None}
        else:
            out["data_files"] = list(self.data_files)
        if self.mesh is not None:
            out["mesh"] = self.mesh
        out["shard_bytes"] = self.shard_bytes
        out["packing"] = self.packing
        return out

    @classmethod
    def from_dict(cls, raw: Any) -> "Job":
        if not isinstance(raw, Mapping):
            raise _fail("job", f"is a {type(raw).__name__}", "write a JSON object as in docs/EXTRACTION.md")
        _reject_unknown("", raw, _JOB_FIELDS)

        for required in ("model", "layers", "max_seq_len", "batch_size", "shard_size"):
            if required not in raw:
                raise _fail(required, "missing", "a job needs model, layers, max_seq_len, batch_size, shard_size")

        dataset = None
        data_files: tuple[str, ...] = ()
        if ("dataset" in raw) == ("data_files" in raw):
            raise _fail(
                "dataset/data_files",
                "both given" if "dataset" in raw else "neither given",
                'give exactly one: "dataset": {"name": ..., "config": ..., "split": ...} or "data_files": [paths]',
            )
        if "dataset" in raw:
            spec = raw["dataset"]
            if not isinstance(spec, Mapping):
                raise _fail("dataset", f"got {spec!r}", 'use an object such as {"name": "HuggingFaceFW/fineweb-edu"}')
            _reject_unknown("dataset", spec, _DATASET_FIELDS)
            if "name" not in spec:
                raise _fail("dataset.name", "missing", "name the Hub dataset, e.g. 'HuggingFaceFW/fineweb-edu'")
            dataset = HubDataset(
                name=_non_empty_str("dataset.name", spec["name"]),
                config=None if spec.get("config") is None else _non_empty_str("dataset.config", spec["config"]),
                split=_non_empty_str("dataset.split", spec.get("split", "train")),
                revision=None if spec.get("revision") is None else _non_empty_str("dataset.revision", spec["revision"]),
            )
        else:
            files = raw["data_files"]
            files = [files] if isinstance(files, str) else files
            if not isinstance(files, list) or not files:
                raise _fail("data_files", f"got {raw['data_files']!r}", "use a path, glob or URL, or a list of them")
            data_files = tuple(_non_empty_str(f"data_files[{i}]", f) for i, f in enumerate(files))

        layers = raw["layers"]
        if not isinstance(layers, list) or not layers or not all(_is_int(x) for x in layers):
            raise _fail("layers", f"got {raw['layers']!r}", "use a non-empty list of layer indices, e.g. [12, 24]")
        if len(set(layers)) != len(layers):
            raise _fail("layers", f"{layers} repeats an index", "list each layer once")

        max_seq_len = _positive_int("max_seq_len", raw["max_seq_len"])
        batch_size = _positive_int("batch_size", raw["batch_size"])
        shard_size = _positive_int("shard_size", raw["shard_size"])

        dtype = raw.get("dtype", "bf16")
        if dtype not in OUT_DTYPES:
            raise _fail("dtype", f"got {dtype!r}", f"use one of {', '.join(OUT_DTYPES)}")
        compute_dtype = raw.get("compute_dtype", "bf16")
        if compute_dtype not in COMPUTE_DTYPES:
            raise _fail("compute_dtype", f"got {compute_dtype!r}", f"use one of {', '.join(COMPUTE_DTYPES)}")

        on_bad_row = raw.get("on_bad_row", "skip")
        if on_bad_row not in ON_BAD_ROW:
            raise _fail(
                "on_bad_row",
                f"got {on_bad_row!r}",
                'use "skip" (record the row in the done marker, extract the rest) or "fail" (dead-letter the task)',
            )

        mesh = raw.get("mesh")
        if mesh is not None:
            if not isinstance(mesh, str):
                raise _fail("mesh", f"got {mesh!r}", "use a string such as 'data=2,model=2'")
            parse_mesh(mesh)

        if raw.get("buckets") is None:
            buckets = default_buckets(max_seq_len)
        else:
            given = raw["buckets"]
            if (
                not isinstance(given, list)
                or not given
                or not all(_is_int(b) and b > 0 for b in given)
                or any(a >= b for a, b in zip(given, given[1:]))
            ):
                raise _fail("buckets", f"got {given!r}", "use a strictly increasing list of positive lengths")
            if given[-1] != max_seq_len:
                raise _fail(
                    "buckets",
                    f"the last bucket is {given[-1]}, not max_seq_len={max_seq_len}",
                    "end the list at max_seq_len",
                )
            buckets = tuple(given)

        return cls(
            model=_non_empty_str("model", raw["model"]),
            layers=tuple(layers),
            max_seq_len=max_seq_len,
            batch_size=batch_size,
            shard_size=shard_size,
            buckets=buckets,
            dataset=dataset,
            data_files=data_files,
            text_field=_non_empty_str("text_field", raw.get("text_field", "text")),
            dtype=dtype,
            compute_dtype=compute_dtype,
            mesh=mesh,
            on_bad_row=on_bad_row,
            shard_bytes=_positive_int("shard_bytes", raw.get("shard_bytes", DEFAULT_SHARD_BYTES)),
            packing=_bool("packing", raw.get("packing", False)),
        )


@dataclasses.dataclass(frozen=True)
class FileSlice:
    """Rows [start, end) of one data file; row r has global sample id base + r."""

    path: str
    base: int
    start: int
    end: int

    @property
    def rows(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Task:
    """A task manifest: file slices read in order; their rows are the task's positions 0..num_samples-1."""

    id: str
    files: tuple[FileSlice, ...]

    @property
    def num_samples(self) -> int:
        return sum(f.rows for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "files": [dataclasses.asdict(f) for f in self.files]}

    @classmethod
    def from_dict(cls, raw: Any) -> "Task":
        if not isinstance(raw, Mapping):
            raise _fail("task", f"is a {type(raw).__name__}", 'write {"id": ..., "files": [...]} (tools/make_tasks.py)')
        _reject_unknown("task", raw, _TASK_FIELDS)
        if "id" not in raw:
            raise _fail("task.id", "missing", "give the task an id")
        task_id = _non_empty_str("task.id", raw["id"])
        files = raw.get("files")
        if not isinstance(files, list) or not files:
            raise _fail("task.files", f"got {files!r}", 'list slices: [{"path", "base", "start", "end"}, ...]')
        slices = []
        for i, entry in enumerate(files):
            where = f"task.files[{i}]"
            if not isinstance(entry, Mapping):
                raise _fail(where, f"got {entry!r}", "use an object with path, base, start and end")
            _reject_unknown(where, entry, _FILE_FIELDS)
            for name in ("path", "start", "end"):
                if name not in entry:
                    raise _fail(f"{where}.{name}", "missing", "give path, start and end (base defaults to 0)")
            start = _non_negative_int(f"{where}.start", entry["start"])
            end = _non_negative_int(f"{where}.end", entry["end"])
            if end < start:
                raise _fail(f"{where}.end", f"{end} is before start={start}", "use end >= start (end is exclusive)")
            slices.append(
                FileSlice(
                    path=_non_empty_str(f"{where}.path", entry["path"]),
                    base=_non_negative_int(f"{where}.base", entry.get("base", 0)),
                    start=start,
                    end=end,
                )
            )
        task = cls(id=task_id, files=tuple(slices))
        if task.num_samples == 0:
            raise _fail("task.files", f"task {task_id} is an empty slice (0 rows)", "give a file end > start")
        return task


@dataclasses.dataclass(frozen=True)
class ResumeState:
    """What previous holders of the task committed: a contiguous run of positions from 0."""

    attempt: int
    records: tuple[dict[str, Any], ...]
    committed: int  # positions [0, committed) are covered by committed shards

    @property
    def listed_skipped(self) -> int:
        """Skipped rows the committed records already list, so that the task's list stays bounded."""
        return sum(len(r["skipped"]) for r in self.records if isinstance(r.get("skipped"), list))

    @classmethod
    def fresh(cls) -> "ResumeState":
        return cls(attempt=1, records=(), committed=0)

    @classmethod
    def from_dict(cls, raw: Any, task: Task) -> "ResumeState":
        if not isinstance(raw, Mapping):
            raise _fail("resume", f"is a {type(raw).__name__}", 'expected {"task": id, "attempt": n, "progress": []}')
        if raw.get("task") not in (None, task.id):
            raise _fail("resume.task", f"{raw['task']!r} is not this task ({task.id!r})", "pass this task's file")
        progress = raw.get("progress", [])
        if not isinstance(progress, list):
            raise _fail("resume.progress", f"got {progress!r}", "use a list of progress records")
        attempt = raw.get("attempt", 1)
        if not _is_int(attempt) or attempt < 1:
            raise _fail("resume.attempt", f"got {attempt!r}", "use a 1-based attempt number")
        spans = []
        for i, record in enumerate(progress):
            where = f"resume.progress[{i}]"
            if not isinstance(record, Mapping):
                raise _fail(where, f"got {record!r}", "each record is a JSON object written by consume.py")
            start = _non_negative_int(f"{where}.sample_start", record.get("sample_start"))
            end = _non_negative_int(f"{where}.sample_end", record.get("sample_end"))
            if not start < end <= task.num_samples:
                raise _fail(
                    where,
                    f"covers [{start}, {end}), outside the task's {task.num_samples} samples",
                    "pass this task's records",
                )
            spans.append((start, end, dict(record)))
        spans.sort(key=lambda span: span[0])
        committed = 0
        for start, end, _ in spans:
            # Each attempt starts right after the last committed sample, so the records tile a prefix.
            if start != committed:
                raise _fail(
                    "resume.progress",
                    f"records do not tile the slice: one starts at {start}, expected {committed}",
                    "pass the records exactly as committed for this task",
                )
            committed = end
        return cls(attempt=attempt, records=tuple(span[2] for span in spans), committed=committed)


def _read_json(path: str | os.PathLike[str], what: str) -> Any:
    try:
        text = pathlib.Path(path).read_text()
    except OSError as exc:
        raise _fail(what, f"cannot read {path}: {exc.strerror or exc}", "check the path") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(what, f"{path} is not JSON ({exc})", "fix the file") from exc


def load_job(path: str | os.PathLike[str]) -> Job:
    return Job.from_dict(_read_json(path, "job file"))


def load_task(path: str | os.PathLike[str]) -> Task:
    return Task.from_dict(_read_json(path, "task file"))


def load_resume(path: str | os.PathLike[str] | None, task: Task) -> ResumeState:
    if path is None:
        return ResumeState.fresh()
    return ResumeState.from_dict(_read_json(path, "resume file"), task)



def plan_tasks(files: Sequence[tuple[str, int]], rows_per_task: int, id_prefix: str = "t") -> list[Task]:
    """Cut the job's files, given as (path, row count) in job order, into tasks of `rows_per_task` rows.

    Global sample ids run through the files in order, so a file's `base` is the row count of the
    files before it. Tasks are consecutive runs of global ids and may span file boundaries; only
    the last task may be shorter. Files without rows are skipped.
    """
    if rows_per_task <= 0:
        raise _fail("rows_per_task", f"got {rows_per_task}", "use a positive number of rows")
    total = sum(count for _, count in files)
    n_tasks = -(-total // rows_per_task)
    width = max(6, len(str(max(n_tasks - 1, 0))))
    tasks = []
    file_index, base, row = 0, 0, 0  # the next unassigned row is row `row` of files[file_index]
    for k in range(n_tasks):
        want = min(rows_per_task, total - k * rows_per_task)
        slices = []
        while want > 0:
            path, count = files[file_index]
            take = min(want, count - row)
            if take > 0:
                slices.append(FileSlice(path=path, base=base, start=row, end=row + take))
                row += take
                want -= take
            if row == count:
                file_index, base, row = file_index + 1, base + count, 0
        tasks.append(Task(id=f"{id_prefix}{k:0{width}d}", files=tuple(slices)))
    return tasks

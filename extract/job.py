"""The inputs of one extraction task, validated here and nowhere else: the job, the task manifest, the resume state.

The job and the task manifest are declared here as pydantic models (`schemas.Model`): every rule a
field must follow is in its declaration, and every violation is a `BadInput` whose message names
the field with its path (`dataset.config`, `task.files[0].end`) and says what to write instead.
Unknown fields are errors too, so that a typo (`"layer": [3]`) fails the task at once instead of
silently running with a default. `docs/schema/job.json` is the job's JSON Schema, for editors.

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
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, StrictInt, StrictStr, ValidationError
from pydantic import ValidationInfo
from pydantic import WithJsonSchema, field_validator, model_validator

from activations.format import SITES
from activations.sampling import TokenSampling
from extract.errors import BadInput
from schemas import Flag, Model, NonNegativeInt, PositiveInt, Text
from schemas import choice, cross_field, invalid, phrase, problems, rule, summary

#: Output dtypes: job spelling -> numpy/JAX dtype name. fp8 is e4m3 with a float32 scale per token and layer
#: (activations.format.quantize_per_token), quantised by the writer from the engine's bf16 output; it is offered
#: because an SAE trained on it came within issue 31's bar of one trained on bf16 (bench/fp8_storage.py,
#: docs/EXTRACTION.md "Compact storage: fp8").
OUT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "float8_e4m3fn"}
#: Compute dtypes the engine runs in.
COMPUTE_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
#: Smallest default bucket: below it padding costs less than another compiled program.
MIN_DEFAULT_BUCKET = 64
MESH_AXES = ("data", "model")
#: What a bad row (null, not UTF-8, lone surrogate, untokenisable) does: skipped and recorded, or fails the task.
ON_BAD_ROW = ("skip", "fail")
#: Default cap of a shard's tensor bytes: large enough that per-object overheads vanish, small enough that a few
#: shards in flight fit any host's memory (about 100-500 MB is a sensible object).
DEFAULT_SHARD_BYTES = 256 * 1024 * 1024


def _validate(model: type[Model], raw: Any, root: str, prefix: str = "") -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        raise BadInput(summary(problems(error, model), phrase, prefix, root)) from None


def default_buckets(max_seq_len: int, packing: bool = False) -> tuple[int, ...]:
    """Powers of two from 64 (or max_seq_len if smaller) up to max_seq_len, which is always the last; max_seq_len
    alone for a packed job.

    Packed rows are full but for the last batch of a packing window, so smaller buckets save almost nothing there
    (0.0 to 0.3 points of padding at FineWeb-Edu-like lengths: 3.36% against 3.69% at max_seq_len 2048, batch 8)
    while each costs a program to trace and compile on every machine (docs/PERFORMANCE.md, "Goodput")."""
    if packing:
        return (max_seq_len,)
    buckets = []
    length = min(MIN_DEFAULT_BUCKET, max_seq_len)
    while length < max_seq_len:
        buckets.append(length)
        length *= 2
    buckets.append(max_seq_len)
    return tuple(buckets)


def _mesh(spec: str) -> str:
    """`"data=2,model=2"`: axis=size pairs over MESH_AXES, each axis once, sizes positive."""
    axes = set()
    for part in spec.split(","):
        match = re.fullmatch(r"\s*([a-z]+)\s*=\s*(\d+)\s*", part)
        if not match or match.group(1) not in MESH_AXES or int(match.group(2)) <= 0 or match.group(1) in axes:
            raise ValueError(spec)
        axes.add(match.group(1))
    return spec


def _distinct(values: tuple[int, ...]) -> tuple[int, ...]:
    if len(set(values)) != len(values):
        raise ValueError(values)
    return values


def _increasing(values: tuple[int, ...]) -> tuple[int, ...]:
    if any(a >= b for a, b in zip(values, values[1:])):
        raise ValueError(values)
    return values


_DATA_FILES_SCHEMA = {
    "anyOf": [
        {"type": "string", "pattern": r"\S"},
        {"type": "array", "items": {"type": "string", "pattern": r"\S"}, "minItems": 1},
    ]
}


_LayerList = Annotated[
    tuple[Annotated[StrictInt, rule("must be a layer index (an integer)")], ...],
    Field(min_length=1, json_schema_extra={"uniqueItems": True}),
    AfterValidator(_distinct),
    rule("must be a non-empty list of distinct layer indices, e.g. [12, 24]"),
]


class HubDataset(Model):
    """A Hugging Face Hub dataset; resolved to its data files by tools/make_tasks.py."""

    name: Text = Field(description="the Hub dataset id, e.g. 'HuggingFaceFW/fineweb-edu'")
    config: Text | None = Field(None, description="the dataset's config, e.g. 'sample-10BT'")
    split: Text = Field("train", description="the split to read")
    revision: Text | None = Field(None, description="a branch, tag or commit of the dataset repository")


class Job(Model):
    """job.json. A shard ends after `shard_size` samples (documents) or before its tensors pass `shard_bytes`."""

    model_config = {"json_schema_extra": {"oneOf": [{"required": ["dataset"]}, {"required": ["data_files"]}]}}

    dataset: HubDataset | None = Field(None, description="a Hub dataset (give this or data_files)")
    data_files: Annotated[
        tuple[Text, ...],
        BeforeValidator(lambda value: [value] if isinstance(value, str) else value),
        Field(min_length=1),
        rule("must be a path, glob or URL, or a non-empty list of them"),
        WithJsonSchema(_DATA_FILES_SCHEMA),
    ] = Field((), description="local, gs:// or hf:// paths, globs or directories (give this or dataset)")
    model: Text = Field(description="a local checkpoint directory, Hub id, or gs:// directory")
    layers: _LayerList = Field(
        (), description="hidden-state indices: 0 = embeddings, i = output of block i, -1 = final norm"
    )
    sites: (
        Annotated[
            dict[choice(*SITES, hint=f"must be a hook site: {', '.join(SITES)}"), _LayerList],
            Field(min_length=1),
            rule('must map hook sites to decoder layers, e.g. {"mlp_out": [3, 7], "attn_out": [3]}'),
        ]
        | None
    ) = Field(None, description="hook sites to keep, each with its decoder layers counted from 0 (-1 = the last)")
    max_seq_len: PositiveInt = Field(description="tokens kept per document (longer documents are truncated)")
    batch_size: PositiveInt = Field(description="rows per device batch; a multiple of the mesh's data axis")
    shard_size: PositiveInt = Field(description="at most this many samples (documents) per output shard")
    buckets: (
        Annotated[
            tuple[PositiveInt, ...],
            Field(min_length=1),
            AfterValidator(_increasing),
            rule("must be a strictly increasing list of positive lengths"),
        ]
        | None
    ) = Field(None, validate_default=True,
              description="padded lengths, ending at max_seq_len; default: 64, 128, ..., max_seq_len (packed: max_seq_len)")
    text_field: Text = Field("text", description="the column or key holding the text")
    dtype: choice(*OUT_DTYPES) = Field("bf16", description="the dtype of the stored activations")
    compute_dtype: choice(*COMPUTE_DTYPES) = Field("bf16", description="the dtype the forward pass runs in")
    mesh: (
        Annotated[
            StrictStr,
            AfterValidator(_mesh),
            rule(f"must be axis=size pairs over {'/'.join(MESH_AXES)}, e.g. 'data=2,model=2'"),
        ]
        | None
    ) = Field(None, description="'data=D,model=M'; default: chosen from the model size and the devices")
    on_bad_row: choice(
        *ON_BAD_ROW,
        hint='must be "skip" (record the row in the done marker, extract the rest) or "fail" (dead-letter the task)',
    ) = Field("skip", description="skip: record a bad row and extract the rest; fail: dead-letter the task")
    shard_bytes: PositiveInt = Field(DEFAULT_SHARD_BYTES, description="a shard ends before its tensors pass this")
    packing: Flag = Field(False, description="several documents per device row (sequence packing)")
    # Storage sampling (activations.sampling): the forward pass runs on whole documents, only storage is sampled.
    token_sample: Annotated[
        float, Field(strict=True, gt=0, le=1), rule("must be a fraction in (0, 1], e.g. 0.1 (1 stores every token)")
    ] = Field(1.0, description="the fraction of each document's token positions stored, chosen by (sample_seed, "
                               "sample id, position)")  # fmt: skip
    drop_first: NonNegativeInt = Field(0, description="the first positions of every document that are not stored")
    sample_seed: Annotated[StrictInt, Field(ge=0, le=2**64 - 1), rule("must be an integer from 0 to 2**64 - 1")] = Field(
        0, description="the seed of the token_sample choice"
    )

    @field_validator("buckets")
    @classmethod
    def _buckets_end_at_max_seq_len(cls, buckets: tuple[int, ...] | None, info: ValidationInfo) -> Any:
        max_seq_len = info.data.get("max_seq_len")
        if max_seq_len is None:  # itself invalid, and reported
            return buckets
        if buckets is None:
            return default_buckets(max_seq_len)
        if buckets[-1] != max_seq_len:
            raise cross_field(
                "buckets",
                f"the last bucket is {buckets[-1]}, not max_seq_len={max_seq_len}; end the list at max_seq_len",
            )
        return buckets

    @model_validator(mode="before")
    @classmethod
    def _packed_default_buckets(cls, raw: Any) -> Any:
        """A packed job without buckets gets one, max_seq_len (`default_buckets`); an invalid max_seq_len is left to
        its own check."""
        if isinstance(raw, dict) and raw.get("buckets") is None and raw.get("packing") is True:
            max_seq_len = raw.get("max_seq_len")
            if isinstance(max_seq_len, int) and not isinstance(max_seq_len, bool) and max_seq_len > 0:
                return {**raw, "buckets": [max_seq_len]}
        return raw

    @model_validator(mode="after")
    def _one_source(self) -> Job:
        if (self.dataset is None) == (not self.data_files):
            raise cross_field(
                "dataset/data_files",
                ("both given" if self.dataset is not None else "neither given")
                + '; give exactly one: "dataset": {"name": ..., "config": ..., "split": ...} or "data_files": [paths]',
            )
        return self

    @model_validator(mode="after")
    def _keeps_something(self) -> Job:
        if not self.layers and not self.sites:
            raise cross_field(
                "layers/sites",
                'neither given; keep hidden states ("layers": [12]), hook sites ("sites": {"mlp_out": [11]}), or both',
            )
        return self

    @model_validator(mode="after")
    def _indices_stored_exactly(self) -> Job:
        # fp8's 3 mantissa bits and its per-token scale would store most expert indices only approximately.
        if self.dtype == "fp8" and self.sites and "expert_indices" in self.sites:
            raise cross_field(
                "dtype/sites.expert_indices",
                "fp8 cannot store expert indices exactly; use dtype bf16, fp16 or fp32, or keep expert_weights (the "
                "chosen experts are its nonzero entries)",
            )
        return self

    @property
    def sampling(self) -> TokenSampling:
        """Which positions are stored; `.active` is False when every one is (the shards are then unsampled)."""
        return TokenSampling(float(self.token_sample), self.drop_first, self.sample_seed)

    @property
    def out_dtype_name(self) -> str:
        return OUT_DTYPES[self.dtype]

    @property
    def engine_out_dtype_name(self) -> str:
        """What the engine hands the writer: the output dtype, or bf16 for fp8 (the writer quantises per token)."""
        return "bfloat16" if self.dtype == "fp8" else self.out_dtype_name

    @property
    def compute_dtype_name(self) -> str:
        return COMPUTE_DTYPES[self.compute_dtype]

    def to_dict(self) -> dict[str, Any]:
        """The job as it would be written in job.json (buckets resolved), for shard metadata."""
        return self.model_dump(mode="json", exclude_none=True, exclude={"data_files"} if self.dataset else None)

    @classmethod
    def from_dict(cls, raw: Any) -> Job:
        return _validate(cls, raw, root="job")


class FileSlice(Model):
    """Rows [start, end) of one data file; row r has global sample id base + r."""

    path: Text = Field(description="the data file")
    base: NonNegativeInt = Field(0, description="the global sample id of the file's row 0")
    start: NonNegativeInt = Field(description="the first row")
    end: NonNegativeInt = Field(description="the row after the last (exclusive)")

    @field_validator("end")
    @classmethod
    def _end_not_before_start(cls, end: int, info: ValidationInfo) -> int:
        start = info.data.get("start")
        if start is not None and end < start:
            raise invalid(f"must be >= start={start} (end is exclusive)")
        return end

    @property
    def rows(self) -> int:
        return self.end - self.start


class Task(Model):
    """A task manifest: file slices read in order; their rows are the task's positions 0..num_samples-1."""

    id: Text = Field(description="the task's id")
    files: Annotated[
        tuple[FileSlice, ...], Field(min_length=1), rule('must list slices: [{"path", "base", "start", "end"}, ...]')
    ] = Field(description="file slices, read in order (tools/make_tasks.py)")

    @field_validator("files")
    @classmethod
    def _not_empty(cls, files: tuple[FileSlice, ...], info: ValidationInfo) -> tuple[FileSlice, ...]:
        if sum(f.rows for f in files) == 0:
            task = info.data.get("id")
            raise cross_field("files", f"task {task} is an empty slice (0 rows); give a file end > start")
        return files

    @property
    def num_samples(self) -> int:
        return sum(f.rows for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, raw: Any) -> Task:
        return _validate(cls, raw, root="task", prefix="task.")


class _ProgressRecord(Model, extra="allow"):
    """A record consume.py wrote for a stored shard; fields other than the span travel along unread."""

    sample_start: NonNegativeInt = Field(description="the first task position the shard holds")
    sample_end: NonNegativeInt = Field(description="the position after the shard's last")


class _ResumeFile(Model, extra="ignore"):
    """SPAWN_RESUME_FILE as the worker writes it (taskqueue): not user-written, so extra fields are ignored."""

    task: StrictStr | None = None
    attempt: Annotated[StrictInt, Field(ge=1), rule("must be a 1-based attempt number")] = 1
    progress: Annotated[tuple[_ProgressRecord, ...], rule("must be a list of progress records")] = ()


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
    def fresh(cls) -> ResumeState:
        return cls(attempt=1, records=(), committed=0)

    @classmethod
    def from_dict(cls, raw: Any, task: Task) -> ResumeState:
        resume = _validate(_ResumeFile, raw, root="resume", prefix="resume.")
        if resume.task not in (None, task.id):
            raise BadInput(f"resume.task: {resume.task!r} is not this task ({task.id!r}); pass this task's file")
        spans = []
        for i, record in enumerate(resume.progress):
            start, end = record.sample_start, record.sample_end
            if not start < end <= task.num_samples:
                raise BadInput(
                    f"resume.progress[{i}]: covers [{start}, {end}), outside the task's {task.num_samples} samples; "
                    "pass this task's records"
                )
            spans.append((start, end, record.model_dump()))
        spans.sort(key=lambda span: span[0])
        committed = 0
        for start, end, _ in spans:
            # Each attempt starts right after the last committed sample, so the records tile a prefix.
            if start != committed:
                raise BadInput(
                    f"resume.progress: records do not tile the slice: one starts at {start}, expected {committed}; "
                    "pass the records exactly as committed for this task"
                )
            committed = end
        return cls(attempt=resume.attempt, records=tuple(span[2] for span in spans), committed=committed)


def _read_json(path: str | os.PathLike[str], what: str) -> Any:
    try:
        text = pathlib.Path(path).read_text()
    except OSError as exc:
        raise BadInput(f"{what}: cannot read {path}: {exc.strerror or exc}; check the path") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{what}: {path} is not JSON ({exc}); fix the file") from exc


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
        raise BadInput(f"rows_per_task: got {rows_per_task}; use a positive number of rows")
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

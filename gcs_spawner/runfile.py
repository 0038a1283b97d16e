"""The run file (`run.yaml`): one file that describes a run whole, declared as a pydantic model (`schemas.Model`).

A run is the job (inline or a path), its tasks (a tasks file, or `rows_per_task` to cut the data files at `up`),
the queue and the code URLs, the model's source and its mirror in the bucket (the job's `model`), the fleet (a
machine spec, how many, where, spot or not, which other accelerators the plan compares), a spending limit and a
name. `docs/schema/run.json` is
its JSON Schema for editors (`tools/export_schema.py`); it refers to `job.json`, `vm-spec.json` and
`tpu-spec.json` beside it for the parts given inline.

`load_run(path)` validates everything that can be judged from the files alone, in this order, and returns a `Run`:
the run file's own fields (`RunFile`), then the job by the model `consume.py` uses (`extract.job.Job`, so a
misspelt `batch_sise` stops here), then the machine spec by `fleet.specs.parse_spec`, then the rules across them
(addresses, zones for the kind of fleet, a model and data the machines can reach).
Every error is a `RunFileError` naming the file and the field (`run.yaml: fleet.count ...`) and what to write.
Paths inside the file are relative to the file. What needs the network (the bucket, the code prefix, the
model's config, the quotas) is `gcs_spawner.checks`.

Resources are named after the run, whatever the spec's `name`: the instance template and the group are NAME,
TPU VMs NAME-0000, NAME-0001, ..., so that two runs made from one template never share a resource, and every
resource carries the label `spawn-run: NAME`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Annotated, Any

import yaml
from pydantic import Field, StrictFloat, ValidationError, WithJsonSchema, field_validator, model_validator

from exitcodes import EX_DATAERR
from objectstore.address import BadAddress, check_address
from schemas import CROSS, MISSING, UNKNOWN, Flag, Model, PositiveInt, Problem, Text
from schemas import choice, cross_field, external_ref, invalid, problems, rule, summary

#: The checkout this package runs from: the code a run uploads unless `code.source` says otherwise.
CHECKOUT = pathlib.Path(__file__).resolve().parent.parent
#: Label every resource of a run carries (its value: the run's name).
RUN_LABEL = "spawn-run"
#: Label the machines `gcs-spawner add` makes carry besides RUN_LABEL (its value: the added spec's name), so that
#: `up` and the keeper, which converge the run file's own fleet, leave them alone (gcs_spawner/add.py).
ADD_LABEL = "spawn-add"

# Compute Engine names (https://cloud.google.com/compute/docs/naming-resources): lowercase letters, digits and
# hyphens, starting with a letter. 50 rather than 63 characters leaves room for the -NNNN of TPU VM names.
_NAME = r"^[a-z]([-a-z0-9]{0,48}[a-z0-9])?$"
# Zones and regions (https://cloud.google.com/compute/docs/regions-zones): us-central1-a, us-central1.
_ZONE = r"^[a-z]+(-[a-z]+)+[0-9]+-[a-z]$"
_REGION = r"^[a-z]+(-[a-z]+)+[0-9]+$"


class RunFileError(ValueError):
    """The run file (or a file it names) is invalid; the message names the file, the field and what to write."""

    exit_code = EX_DATAERR  # what a command that ends on it exits with (gcs_spawner/cli.py)


def _positive_number(hint: str):
    return Annotated[StrictFloat, Field(gt=0), rule(hint)]


Address = Annotated[Text, rule("must be gs://bucket/prefix or a directory")]
Zone = Annotated[Text, Field(pattern=_ZONE), rule("must be a zone such as us-central1-a")]
# The job and the spec may be given inline; their schemas are the files beside this one's in docs/schema/.
_JOB_SCHEMA = {"anyOf": [{"type": "string", "pattern": r"\S", "description": "a path to job.json, from this file"},
                         external_ref("job.json")]}
_SPEC_SCHEMA = {"anyOf": [{"type": "string", "pattern": r"\S", "description": "a path to a machine spec (YAML)"},
                          external_ref("vm-spec.json"), external_ref("tpu-spec.json")]}


def _path_or_mapping(value: Any) -> Any:
    if isinstance(value, str) and value.strip() or isinstance(value, dict):
        return value
    raise invalid("must be a path (a string) or the same fields inline (a mapping)")


class TasksSection(Model):
    """Where the task manifests come from: a tasks file, or the data files cut at `up`."""

    file: Text | None = Field(None, description="tasks.jsonl (tools/make_tasks.py), from this file")
    rows_per_task: PositiveInt | None = Field(None, description="cut the job's data files into tasks of this many rows")
    id_prefix: Annotated[
        Text, Field(pattern=r"^[A-Za-z0-9][-_.A-Za-z0-9]*$"), rule("must be letters, digits, '-', '_' or '.'")
    ] = Field("t", description="with rows_per_task: task ids are PREFIX + a zero-padded index")

    @model_validator(mode="after")
    def _one_source(self) -> TasksSection:
        if (self.file is None) == (self.rows_per_task is None):
            raise cross_field("tasks", "tasks: give exactly one of 'file' (a tasks file) or 'rows_per_task'")
        return self


class ModelSection(Model):
    """Where the job's model comes from: the job's `model` is its mirror in the bucket (gs://), which the machines
    read, never the Hub; `up` copies the source there once, unless the mirror has its config.json already."""

    source: Text = Field(description="a Hub id or a local checkpoint directory, copied into the job's model once")
    revision: Text | None = Field(None, description="with a Hub source: a branch, tag or commit")


class CodeSection(Model):
    """The code the machines sync at boot, and its locked environment (tools/upload_code.py)."""

    url: Address = Field(description="gs://bucket/prefix of the code")
    upload: Flag = Field(True, description="upload the checkout at `up`; false: the prefix already holds it")
    source: Text | None = Field(None, description="the checkout to upload; default: the one gcs-spawner runs from")
    environment: Flag = Field(True, description="compile the locks and stage uv/uv next to the code (false: the "
                                                "machines install unpinned)")
    wheelhouse: Flag = Field(False, description="also upload every locked wheel (firewalled fleets)")
    python_mirror: Flag = Field(False, description="also upload the fleet's CPython (firewalled fleets)")
    exclude: list[Text] = Field([], description="globs to leave out of the upload as well")


class FleetSection(Model):
    """The machines: a spec, how many, where."""

    spec: Annotated[Any, WithJsonSchema(_SPEC_SCHEMA)] = Field(
        description="a machine spec (templates/vm.yaml or tpu.yaml): a path from this file, or its fields inline")
    count: PositiveInt = Field(description="VMs in the group, or TPU VMs (slices, times the spec's `slices`) at most")
    zones: Annotated[list[Zone], rule("must be a list of zones such as [us-central1-a]")] = Field(
        [], description="zones to create in, the first preferred (a VM group: one zone, or give region)")
    region: Annotated[Text, Field(pattern=_REGION), rule("must be a region such as us-central1")] | None = Field(
        None, description="VMs only: a regional group, spread over the region's zones")
    spot: Flag | None = Field(None, description="spot capacity; default: the spec's")
    alternatives: list[Text] = Field(
        [], description="other accelerator types `plan` prices beside the fleet's, e.g. [v6e-8, a3-highgpu-8g]")
    keeper: Flag = Field(True, description="TPU queued resources: `gcs-spawner keep` replaces preempted ones")
    on_failure: choice("repair", "do-nothing") = Field(
        "repair", description="a VM group's action on a failed member (instanceLifecyclePolicy)")
    force: Flag = Field(False, description="go on when the pre-flight finds a shortfall (quota, role, location)")

    _field_spec = field_validator("spec", mode="before")(classmethod(lambda cls, value: _path_or_mapping(value)))


class PlanSection(Model):
    """What the planner assumes (tools/plan.py's flags of the same names)."""

    mfu: Annotated[StrictFloat, Field(gt=0, le=1), rule("must be a fraction in (0, 1], e.g. 0.35")] = Field(
        0.35, description="assumed model FLOPs utilisation")
    tokens_per_row: _positive_number("must be a positive number") | None = Field(
        None, description="mean stored tokens per row, instead of tokenising a sample")
    sample_rows: PositiveInt = Field(1024, description="rows to tokenise for tokens per row")
    model_config_file: Text | None = Field(
        None, alias="model_config", description="the model's config.json, when the model is not local or mirrored yet")
    tokenizer: Text | None = Field(None, description="a directory with the model's tokenizer, when it is not local")
    target_minutes: _positive_number("must be a positive number of minutes") = Field(10.0, description="task length")
    fixed_seconds: Annotated[StrictFloat, Field(ge=0), rule("must be a number of seconds >= 0")] | None = Field(
        None, description="a task's fixed seconds on a warm machine, measured (status's goodput line); default: the "
                          "platform's figure")
    months: _positive_number("must be a positive number of months") = Field(1.0, description="months output is kept")
    storage_budget_tb: _positive_number("must be a positive number of TB") | None = Field(
        None, description="suggest the token_sample whose output fits this many TB")
    prices: Text | None = Field(
        None, description="a price table (a copy of reporting/prices.json), from this file: it prices a machine type "
                          "the shipped one does not, or your own prices; --prices overrides it")


class RunFile(Model):
    """run.yaml: one run of a job on a fleet."""

    name: Annotated[Text, Field(pattern=_NAME), rule(
        "must be lowercase letters, digits and hyphens, start with a letter, at most 50 characters")] = Field(
        description="the run's name: its template, group and TPU VMs are named after it")
    project: Text | None = Field(None, description="the Google Cloud project; default: gcloud config")
    queue: Address = Field(description="gs://bucket/prefix of the queue (job, tasks, outputs, the run's record)")
    job: Annotated[Any, WithJsonSchema(_JOB_SCHEMA)] = Field(
        description="the job: a path to job.json from this file, or its fields inline")
    tasks: TasksSection = Field(description="the task manifests: a file, or rows_per_task")
    model: ModelSection | None = Field(None, description="where the job's model (its mirror, gs://) is copied from")
    code: CodeSection = Field(description="the code the machines run")
    fleet: FleetSection = Field(description="the machines")
    max_dollars: _positive_number("must be a positive number of dollars") | None = Field(
        None, description="spending limit: `up` refuses a plan above it, `keep` stops replacing machines at it")
    plan: PlanSection = Field(PlanSection(), description="what the planner assumes")

    _field_job = field_validator("job", mode="before")(classmethod(lambda cls, value: _path_or_mapping(value)))


@dataclasses.dataclass(frozen=True)
class Run:
    """A validated run: the file's fields, and the job and the spec it names, resolved."""

    file: pathlib.Path
    fields: RunFile
    job: Any  # extract.job.Job
    job_raw: dict  # the job as submitted: the user's fields
    spec: Any  # fleet.specs.VmSpec | TpuSpec, named after the run, spot as the run says
    tasks_file: pathlib.Path | None
    code_source: pathlib.Path
    model_source: str | None  # a local directory (resolved) or a Hub id

    @property
    def name(self) -> str:
        return self.fields.name

    @property
    def queue(self) -> str:
        return self.fields.queue

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def accelerator(self) -> str:
        """The type the planner prices: the TPU accelerator type, or the VM's machine type."""
        return self.spec.accelerator_type if self.kind == "tpu" else self.spec.machine_type

    @property
    def platform(self) -> str:
        """cpu | gpu | tpu: which JAX (and lock) the machines install."""
        return "tpu" if self.kind == "tpu" else self.spec.jax_flavour

    @property
    def machines(self) -> int:
        return self.fields.fleet.count * (self.spec.slices if self.kind == "tpu" else 1)

    @property
    def job_bytes(self) -> bytes:
        return (json.dumps(self.job_raw, indent=1, sort_keys=True) + "\n").encode()


def _phrase(problem: Problem, where: str) -> str:
    if problem.kind == UNKNOWN:
        return f"{where}: unknown field; remove it or use one of: {problem.text}"
    if problem.kind == MISSING:
        return f"{where}: missing; a required field" + (f": {problem.text}" if problem.text else "")
    return problem.text if problem.kind == CROSS else f"{where}: {problem.text}"


def _read_mapping(path: pathlib.Path, what: str) -> dict:
    """A YAML file's mapping (a `.json` file is read as JSON: YAML 1.1 would take its `1e-06` for a string)."""
    try:
        with path.open() as stream:  # a stream, so that YAML's errors name the file, not "<unicode string>"
            raw = json.load(stream) if path.suffix == ".json" else yaml.safe_load(stream)
    except OSError as err:
        raise RunFileError(f"{what}: cannot read {path}: {err.strerror or err}") from None
    except (yaml.YAMLError, ValueError) as err:
        raise RunFileError(f"{what}: {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {err}") from None
    if not isinstance(raw, dict):
        raise RunFileError(f"{what}: {path} must hold a mapping of fields, got {type(raw).__name__}")
    return raw


def parse_run(raw: object, file: pathlib.Path) -> Run:
    """Validate a decoded run file whose paths are relative to `file`'s directory (see the module docstring)."""
    from extract.errors import BadInput
    from extract.job import Job
    from fleet import specs

    if not isinstance(raw, dict):
        raise RunFileError(f"{file}: must be a YAML mapping of fields, got {type(raw).__name__}")
    try:
        fields = RunFile.model_validate(raw)
    except ValidationError as error:
        raise RunFileError(f"{file}: {summary(problems(error, RunFile), _phrase)}") from None
    here = file.parent

    def local(text: str) -> pathlib.Path:
        path = pathlib.Path(text).expanduser()
        return path if path.is_absolute() else here / path

    def address(text: str, what: str, directory: bool = False) -> str:
        try:
            return check_address(text, what, directory=directory)
        except BadAddress as err:
            raise RunFileError(f"{file}: {err}") from None

    queue = address(fields.queue, "queue")
    code_url = address(fields.code.url, "code.url")
    fields = fields.model_copy(update={"queue": queue, "code": fields.code.model_copy(update={"url": code_url})})

    # The job, by the model consume.py validates it with.
    if isinstance(fields.job, str):
        job_raw = _read_mapping(local(fields.job), f"{file}: job")
        where = f"{file}: job ({local(fields.job)})"
    else:
        job_raw, where = dict(fields.job), f"{file}: job"
    try:
        job = Job.from_dict(job_raw)
    except BadInput as err:
        raise RunFileError(f"{where}: {err}") from None
    model_source = None
    if fields.model:
        source = fields.model.source
        model_source = str(local(source)) if local(source).is_dir() else source
        if not local(source).is_dir() and (source.startswith((".", "/", "~")) or local(source).exists()
                                           or source.count("/") > 1):
            # A Hub id is `name` or `org/name`; a path (./x, /x, ~/x, a/b/c, a file) names a local checkpoint,
            # which must be a directory.
            raise RunFileError(f"{file}: model.source: {local(source)} is not a checkpoint directory"
                               f"{' (it does not exist)' if not local(source).exists() else ''}; give the local "
                               "checkpoint's directory, or a Hub id such as Qwen/Qwen2.5-0.5B")
    remote = [p for p in job.data_files if not p.startswith(("gs://", "hf://"))]
    if remote:
        raise RunFileError(f"{where}: data_files {remote[0]!r} is a local path, which the machines cannot read; "
                           "copy the data to gs://bucket/prefix (or use hf:// paths or a Hub dataset)")
    if not job.model.startswith("gs://"):
        raise RunFileError(f"{where}: model {job.model!r} is not in a bucket, so every machine would download it; "
                           "make the job's model a gs://bucket/prefix (its mirror) and put this one in the run's "
                           "model.source, which up copies there")
    try:
        check_address(job.model, f"{where}: model", directory=False)
    except BadAddress as err:
        raise RunFileError(str(err)) from None

    # The machine spec, named after the run.
    if isinstance(fields.fleet.spec, str):
        spec_path = local(fields.fleet.spec)
        shipped = CHECKOUT / "templates" / pathlib.Path(fields.fleet.spec).name
        if not spec_path.exists() and shipped.is_file():
            raise RunFileError(f"{file}: fleet.spec: {spec_path} does not exist; the machine specs ship in templates/ "
                               f"(templates/{shipped.name}): copy it beside the run file "
                               f"(cp {shipped} {spec_path.parent}/), or give its path")
        try:
            spec = specs.load_spec(spec_path)
        except specs.SpecError as err:
            raise RunFileError(f"{file}: fleet.spec: {err}") from None
    else:
        try:
            spec = specs.parse_spec(dict(fields.fleet.spec), f"{file}: fleet.spec")
        except specs.SpecError as err:
            raise RunFileError(str(err)) from None
    update: dict[str, Any] = {"name": fields.name, "labels": {**spec.labels, RUN_LABEL: fields.name}}
    if fields.fleet.spot is not None:
        update["spot"] = fields.fleet.spot
    spec = spec.model_copy(update=update)

    fleet = fields.fleet
    if spec.kind == "vm":
        if fleet.region and fleet.zones:
            raise RunFileError(f"{file}: fleet: give zones (a zonal group) or region (a regional group), not both")
        if not fleet.region and len(fleet.zones) != 1:
            raise RunFileError(f"{file}: fleet.zones: a VM fleet is one managed instance group: give one zone, or "
                               f"region for a regional group (got {len(fleet.zones)} zones)")
    else:
        if fleet.region:
            raise RunFileError(f"{file}: fleet.region: TPU VMs are created in zones; give fleet.zones instead")
        if not fleet.zones:
            raise RunFileError(f"{file}: fleet.zones: missing; give the zones to create TPU VMs in, the first preferred")
        if fleet.keeper and not spec.use_queued_resources:
            raise RunFileError(f"{file}: fleet.keeper: the keeper replaces queued resources, and this spec makes "
                               "plain nodes (queued: false); set fleet.keeper: false or queued: true")
    tasks_file = local(fields.tasks.file) if fields.tasks.file else None
    code_source = local(fields.code.source) if fields.code.source else CHECKOUT
    if fields.code.upload and not code_source.is_dir():
        raise RunFileError(f"{file}: code.source: {code_source} is not a directory; give the checkout to upload")
    return Run(file=file, fields=fields, job=job, job_raw=job_raw, spec=spec, tasks_file=tasks_file,
               code_source=code_source, model_source=model_source)


def load_run(path: str | pathlib.Path) -> Run:
    """Read and validate a run file (YAML or JSON); `RunFileError` names the field at fault."""
    path = pathlib.Path(path)
    if path.is_dir():
        raise RunFileError(f"{path}: is a directory; give the run file (run.yaml)")
    return parse_run(_read_mapping(path, str(path)), path.resolve() if path.exists() else path)


def is_run_file(text: str) -> bool:
    """Whether a command's RUN|QUEUE argument names a run file rather than a queue: an existing file."""
    return pathlib.Path(text).expanduser().is_file()


def run_fields(path: str | pathlib.Path) -> RunFile:
    """The run file's own fields, checked alone (not its job, tasks or spec files): what `down` needs to find the
    run's resources by its label after those files have moved."""
    path = pathlib.Path(path)
    raw = _read_mapping(path, str(path))
    try:
        return RunFile.model_validate(raw)
    except ValidationError as error:
        raise RunFileError(f"{path}: {summary(problems(error, RunFile), _phrase)}") from None


def queue_of(path: str | pathlib.Path) -> str:
    """The queue a run file names, with only the run file's own fields checked: what `status`, `down`, `merge`,
    `logs` and `export` need, which must work after the job or tasks files have moved."""
    fields = run_fields(path)
    try:
        return check_address(fields.queue, f"{path}: queue", directory=False)
    except BadAddress as err:
        raise RunFileError(str(err)) from None

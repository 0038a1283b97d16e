"""The machine spec schema (`templates/*.yaml`), declared as pydantic models (`schemas.Model`), and its
translation into the API objects the launch tools send. `docs/schema/{vm,tpu}-spec.json` are the specs'
JSON Schemas, for editors.

A spec describes a machine: `kind: vm` (a Compute Engine instance template) or `kind: tpu` (TPU VMs).
The tools add where the work is (queue and code URLs) at launch time; all of it reaches the
machine as instance metadata attributes, named here once (ATTR_*), which `startup/startup.sh`,
`fleet.service` and `fleet.selfdelete` read.

The API clients' message types (`compute_v1`, `tpu_v2`) are imported only by the functions that build them:
validating a spec (the run file, `--help`, the schema export) costs no second of client import.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, Field, StrictInt, StrictStr, ValidationError, WithJsonSchema, model_validator

from exitcodes import EX_DATAERR
from objectstore.address import BadAddress, check_address
from schemas import CROSS, MISSING, UNKNOWN, Flag, Model, NonNegativeInt, PositiveInt, Problem, Text
from schemas import choice, cross_field, invalid, problems, rule, summary

# Metadata attributes the tools set and the machine reads.
ATTR_STARTUP_SCRIPT = "startup-script"
ATTR_QUEUE = "spawn-queue"
ATTR_CODE = "spawn-code"
ATTR_CONSUMER = "spawn-consumer"
ATTR_FLAGS = "spawn-flags"  # shlex-quoted; split by fleet.service, never evaluated by a shell
ATTR_ACCELERATOR = "spawn-accelerator"  # cpu | gpu | tpu: which JAX the startup script installs
ATTR_EXTRAS = "spawn-extras"  # comma-separated package extras, e.g. "extract"
ATTR_PYTHON = "spawn-python"  # CPython version uv provisions for the virtualenv, e.g. 3.11
ATTR_QUEUED_RESOURCE = "spawn-queued-resource"  # on a TPU node made by a queued resource: its id

SCOPE_PREFIX = "https://www.googleapis.com/auth/"
STARTUP_SCRIPT = Path(__file__).resolve().parent.parent / "startup" / "startup.sh"


class SpecError(ValueError):
    """A spec file or launch setting is invalid; the message names the file and the field."""

    exit_code = EX_DATAERR  # what a command that ends on it exits with (gcs_spawner/cli.py)


# 50 rather than GCE's 63 characters leaves room for the suffixes the tools append.
_GCE_NAME = r"^[a-z]([-a-z0-9]{0,48}[a-z0-9])?$"
_LABEL = re.compile(r"^[a-z][-_a-z0-9]{0,62}$")
_LABEL_VALUE = re.compile(r"^[-_a-z0-9]{0,63}$")
MIN_PYTHON_MINOR = 11  # JAX 0.10 needs CPython 3.11


def _labels(labels: dict[Any, Any]) -> dict[str, str]:
    for key, value in labels.items():
        if not (isinstance(key, str) and _LABEL.match(key) and isinstance(value, str) and _LABEL_VALUE.match(value)):
            raise invalid(
                f"has label {key!r}: {value!r}; keys and values must be lowercase letters, digits, '-' or '_' "
                "(values quoted)"
            )
    return labels


def _python(version: str) -> str:
    # startup.sh hands it to `uv python install`; `python3.11` is accepted for older specs.
    minor = int(version.removeprefix("python").split(".")[1])
    if minor < MIN_PYTHON_MINOR:
        raise ValueError(version)
    return f"3.{minor}"


# Labels are validated by _labels (its message names the label at fault); the schema shows editors the same rule.
_LABELS_SCHEMA = {
    "type": "object",
    "propertyNames": {"pattern": _LABEL.pattern},
    "additionalProperties": {"type": "string", "pattern": _LABEL_VALUE.pattern},
}


class _Common(Model):
    """The fields both kinds share."""

    kind: str
    name: Annotated[
        StrictStr,
        Field(pattern=_GCE_NAME),
        rule("must be lowercase letters, digits and hyphens, start with a letter, at most 50 characters"),
    ] = Field(description="the instance template's name (vm), or the prefix of node ids (tpu)")
    consumer: Text = Field(description="the command spawn.py runs per task, e.g. 'python consume.py'")
    spawn_flags: Annotated[list[Text], rule("must be a list of non-empty strings")] = Field(
        [], description="extra spawn.py flags, one list item per word"
    )
    resident: Flag = Field(
        True,
        description="one consumer process per machine (per host of a slice) serving every task, its model kept loaded "
        "(spawn.py --resident; the consumer must speak the resident protocol, as consume.py does); false: a fresh "
        "consumer per task",
    )
    extras: Annotated[
        list[Annotated[StrictStr, Field(pattern=r"^[a-z0-9][-_a-z0-9]*$"), rule("must be a package extra")]],
        rule("must be a list of package extras such as [extract]"),
    ] = Field(["extract"], description="package extras installed on the machine")
    python: Annotated[
        StrictStr,
        Field(pattern=r"^(python)?3\.[0-9]+$"),
        AfterValidator(_python),
        rule(f'must be a CPython version of at least 3.{MIN_PYTHON_MINOR}, quoted, such as "3.11" or "3.12"'),
    ] = Field("3.11", description="the CPython version uv provisions (quote it: \"3.11\")")
    # The idle cap that matters most on TPU VMs, which have no max_run_duration.
    max_idle_s: PositiveInt | None = Field(
        None, description="seconds the worker waits for work held by others before it leaves (spawn.py --idle-timeout)"
    )
    spot: Flag = Field(True, description="spot capacity (preemptible, cheaper)")
    service_account: Text = Field("default", description="the machines' service account email, or 'default'")
    scopes: Annotated[
        list[Text],
        Field(min_length=1),
        AfterValidator(lambda scopes: [s if s.startswith("https://") else SCOPE_PREFIX + s for s in scopes]),
        rule("must list at least one OAuth scope, e.g. cloud-platform"),
    ] = Field(["cloud-platform"], validate_default=True, description="OAuth scopes, short (cloud-platform) or URLs")
    labels: Annotated[
        dict[Any, Any],
        rule("must be a mapping of label keys to values"),
        AfterValidator(_labels),
        WithJsonSchema(_LABELS_SCHEMA),
    ] = Field({}, description="resource labels: lowercase letters, digits, '-' or '_'")
    network: Text = Field("default", description="the VPC network")
    subnetwork: Text | None = Field(None, description="the subnetwork (needed on custom-mode networks)")
    external_ip: Flag = Field(True, description="false: no external IP (Cloud NAT or Private Google Access)")


class VmSpec(_Common):
    """An instance template: `name` is the template's name."""

    kind: Literal["vm"] = Field(description="vm: a Compute Engine instance template")
    machine_type: Text = Field(description="the machine type, e.g. g2-standard-8")
    image: Text = Field(description="the boot image, e.g. projects/PROJECT/global/images/family/FAMILY")
    disk_gb: PositiveInt = Field(100, description="boot disk size in GB")
    disk_type: Text = Field("pd-balanced", description="boot disk type")
    gpu_type: Text | None = Field(None, description="GPUs to attach to N1 machine types, e.g. nvidia-tesla-t4")
    gpu_count: NonNegativeInt = Field(0, description="how many gpu_type GPUs to attach")
    accelerator: choice("cpu", "gpu") | None = Field(None, description="which JAX to install; default: from the GPUs")
    # Compute Engine accepts 30 s to 120 days (https://cloud.google.com/compute/docs/instances/limit-vm-runtime).
    max_run_duration_s: (
        Annotated[
            StrictInt,
            Field(ge=30, le=120 * 86400),
            rule("must be a number of seconds between 30 and 10368000 (120 days)"),
        ]
        | None
    ) = Field(None, description="hard cap: Compute Engine deletes the VM this many seconds after it starts")

    @model_validator(mode="after")
    def _gpus(self) -> VmSpec:
        if bool(self.gpu_type) != bool(self.gpu_count):
            raise cross_field("gpu_type", "fields 'gpu_type' and 'gpu_count' go together; set both or neither")
        if self.gpu_count and self.accelerator == "cpu":
            raise cross_field("accelerator", "field 'accelerator' is 'cpu' but the spec attaches GPUs; use 'gpu'")
        return self

    @property
    def jax_flavour(self) -> str:
        return self.accelerator or ("gpu" if self.gpu_count else "cpu")


class TpuSpec(_Common):
    """TPU VMs: `name` is the prefix of node (and queued resource) ids."""

    kind: Literal["tpu"] = Field(description="tpu: TPU VMs (queued resources or plain nodes)")
    # Single-host (v5litepod-8) and multi-host (v4-16, v5litepod-64) types alike: a slice is one worker. Single-host
    # TPU VMs have at most 8 chips (v5e, v6e) or 8 TensorCores (v2-v5p) under the number in the type; anything larger
    # is a multi-host slice (docs/CLOUD.md, "Slices"; https://cloud.google.com/tpu/docs/v5e,
    # https://cloud.google.com/tpu/docs/v4).
    accelerator_type: Annotated[
        StrictStr,
        Field(pattern=r"^[a-z0-9]+-0*[1-9][0-9]*$"),
        rule("must be a TPU accelerator type such as v5litepod-8, v5litepod-16 or v4-32"),
    ] = Field(description="the TPU type; more than 8 chips is a multi-host slice")
    runtime_version: Text = Field(description="the TPU software version, e.g. v2-alpha-tpuv5-lite")
    queued: Flag | None = Field(None, description="make queued resources; default: when spot")
    #: Slices per unit of --count: K independent single-slice queued resources (or nodes), each its
    #: own claimant, never one multislice queued resource (docs/CLOUD.md, "Slices").
    slices: PositiveInt = Field(1, description="slices per unit of --count: independent queued resources or nodes")

    @property
    def use_queued_resources(self) -> bool:
        # Spot TPU capacity comes and goes; a queued resource waits for it instead of failing.
        return self.spot if self.queued is None else self.queued


_KINDS: dict[str, type[VmSpec | TpuSpec]] = {"vm": VmSpec, "tpu": TpuSpec}


def parse_spec(raw: object, source: str) -> VmSpec | TpuSpec:
    """Validate a decoded spec; every problem is reported as 'SOURCE: field ...' before any API call."""
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: must be a YAML mapping of fields, got {type(raw).__name__}")
    kind = raw.get("kind")
    if kind not in _KINDS:
        raise SpecError(f"{source}: field 'kind' must be one of {', '.join(_KINDS)}, got {kind!r}")

    def phrase(problem: Problem, where: str) -> str:
        if problem.kind == UNKNOWN:
            return f"unknown field {where!r} for kind {kind!r}; known fields: {problem.text}"
        if problem.kind == MISSING:
            return f"field {where!r} is required for kind {kind!r}: {problem.text}"
        return problem.text if problem.kind == CROSS else f"field {where!r} {problem.text}"

    try:
        return _KINDS[kind].model_validate(raw)
    except ValidationError as error:
        raise SpecError(f"{source}: {summary(problems(error, _KINDS[kind]), phrase)}") from None


def load_spec(path: str | Path) -> VmSpec | TpuSpec:
    path = Path(path)
    try:
        with path.open() as stream:  # a stream, so that YAML's errors name the file, not "<unicode string>"
            raw = yaml.safe_load(stream)
    except OSError as err:
        raise SpecError(f"{path}: cannot read the spec file: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML: {err}") from None
    return parse_spec(raw, str(path))


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the tools add to a spec: where the queue and the code live, and what the worker runs."""

    queue: str
    code: str
    consumer: str
    spawn_flags: list[str]
    startup_script: str

    @classmethod
    def make(
        cls,
        spec: VmSpec | TpuSpec,
        queue: str,
        code: str,
        consumer: str | None = None,
        spawn_flags: list[str] | None = None,
        startup_script: Path = STARTUP_SCRIPT,
    ) -> "Launch":
        for flag, url in (("--queue", queue), ("--code", code)):
            try:  # the one address rule (objectstore.address), as `up` and every tool check it
                check_address(url, flag, prefix=False, directory=False)
            except BadAddress as err:
                raise SpecError(f"{flag} must be a gs://bucket/prefix URL the machines can reach: {err}") from None
        flags = list(spec.spawn_flags if spawn_flags is None else spawn_flags)
        if spec.max_idle_s is not None and "--idle-timeout" not in flags:
            flags += ["--idle-timeout", str(spec.max_idle_s)]
        if spec.resident and "--resident" not in flags:
            # A warm task starts in about a second instead of paying imports, devices, weights and traces again
            # (docs/PERFORMANCE.md, "Resident consumers"; issue 44).
            flags.append("--resident")
        return cls(
            queue=queue.rstrip("/"),
            code=code.rstrip("/"),
            consumer=consumer or spec.consumer,
            spawn_flags=flags,
            startup_script=startup_script.read_text(),
        )

    def metadata(self, spec: VmSpec | TpuSpec, accelerator: str) -> dict[str, str]:
        return {
            ATTR_STARTUP_SCRIPT: self.startup_script,
            ATTR_QUEUE: self.queue,
            ATTR_CODE: self.code,
            ATTR_CONSUMER: self.consumer,
            ATTR_FLAGS: shlex.join(self.spawn_flags),
            ATTR_ACCELERATOR: accelerator,
            ATTR_EXTRAS: ",".join(spec.extras),
            ATTR_PYTHON: spec.python,
        }


def _compute_network(value: str) -> str:
    # Compute wants a (partial) URL; the TPU API takes the bare network name as well.
    return value if "/" in value else f"global/networks/{value}"


def instance_template(spec: VmSpec, launch: Launch, name: str | None = None) -> compute_v1.InstanceTemplate:
    """A global instance template whose VMs run the startup script and then the worker."""
    from google.cloud import compute_v1

    gpu = spec.jax_flavour == "gpu"
    if spec.spot:
        # DELETE rather than STOP: a stopped spot VM still holds its disk and its group slot.
        scheduling = compute_v1.Scheduling(
            provisioning_model="SPOT",
            instance_termination_action="DELETE",
            on_host_maintenance="TERMINATE",
            automatic_restart=False,
        )
    else:
        # GPU VMs cannot live-migrate; the others can.
        scheduling = compute_v1.Scheduling(
            provisioning_model="STANDARD", on_host_maintenance="TERMINATE" if gpu else "MIGRATE", automatic_restart=True
        )
    if spec.max_run_duration_s is not None:
        # The backstop against a machine that never manages to delete itself: Compute Engine
        # deletes it at the limit (https://cloud.google.com/compute/docs/instances/limit-vm-runtime).
        scheduling.max_run_duration = compute_v1.Duration(seconds=spec.max_run_duration_s)
        scheduling.instance_termination_action = "DELETE"
    interface = compute_v1.NetworkInterface(network=_compute_network(spec.network))
    if spec.subnetwork:
        interface.subnetwork = spec.subnetwork
    if spec.external_ip:
        interface.access_configs = [compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")]
    properties = compute_v1.InstanceProperties(
        machine_type=spec.machine_type,
        disks=[
            compute_v1.AttachedDisk(
                boot=True,
                auto_delete=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(
                    source_image=spec.image, disk_size_gb=spec.disk_gb, disk_type=spec.disk_type
                ),
            )
        ],
        network_interfaces=[interface],
        scheduling=scheduling,
        service_accounts=[compute_v1.ServiceAccount(email=spec.service_account, scopes=spec.scopes)],
        labels=spec.labels,
        metadata=compute_v1.Metadata(
            items=[compute_v1.Items(key=k, value=v) for k, v in launch.metadata(spec, spec.jax_flavour).items()]
        ),
    )
    if spec.gpu_count:
        properties.guest_accelerators = [
            compute_v1.AcceleratorConfig(accelerator_type=spec.gpu_type, accelerator_count=spec.gpu_count)
        ]
    return compute_v1.InstanceTemplate(name=name or spec.name, properties=properties)


def tpu_node(spec: TpuSpec, launch: Launch, queued_resource_id: str | None = None) -> tpu_v2.Node:
    """A TPU VM node; with `queued_resource_id` it is the node spec inside that queued resource."""
    from google.cloud import tpu_v2

    metadata = launch.metadata(spec, "tpu")
    if queued_resource_id:
        # Lets the node find, from its own metadata, what to delete when it is done.
        metadata[ATTR_QUEUED_RESOURCE] = queued_resource_id
    node = tpu_v2.Node(
        accelerator_type=spec.accelerator_type,
        runtime_version=spec.runtime_version,
        network_config=tpu_v2.NetworkConfig(
            network=spec.network,
            subnetwork=spec.subnetwork or "",
            enable_external_ips=spec.external_ip,
        ),
        # "default" means the project's default compute service account, which the TPU API
        # uses when no email is given.
        service_account=tpu_v2.ServiceAccount(
            email="" if spec.service_account == "default" else spec.service_account, scope=spec.scopes
        ),
        labels=spec.labels,
        metadata=metadata,
    )
    if spec.spot and not queued_resource_id:
        node.scheduling_config = tpu_v2.SchedulingConfig(spot=True)
    return node


def queued_resource(spec: TpuSpec, launch: Launch, project: str, zone: str, resource_id: str) -> tpu_v2.QueuedResource:
    """One queued resource holding one slice: a node named like the queued resource
    (https://cloud.google.com/tpu/docs/reference/rest/v2/projects.locations.queuedResources).

    Never `multisliceParams`, even for `slices: K`: a multislice queued resource puts MEGASCALE_*
    variables in every node's `tpu-env`, from which JAX and libtpu join the K slices into one
    program, while this project runs one independent program per slice (docs/CLOUD.md, "Slices").
    K single-slice queued resources give the same capacity, and a preemption costs one slice."""
    from google.cloud import tpu_v2

    node_spec = tpu_v2.QueuedResource.Tpu.NodeSpec(
        parent=f"projects/{project}/locations/{zone}",
        node_id=resource_id,
        node=tpu_node(spec, launch, queued_resource_id=resource_id),
    )
    qr = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[node_spec]))
    if spec.spot:
        qr.spot = tpu_v2.QueuedResource.Spot()
    return qr

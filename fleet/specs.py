"""The machine spec schema (`templates/*.yaml`), validated in one place, and its translation into
the API objects the launch tools send.

A spec describes a machine: `kind: vm` (a Compute Engine instance template) or `kind: tpu` (TPU VMs).
The tools add where the work is (queue and code URLs) at launch time; all of it reaches the
machine as instance metadata attributes, named here once (ATTR_*), which `startup/startup.sh`,
`fleet.service` and `fleet.selfdelete` read.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Callable
from pathlib import Path

import yaml
from google.cloud import compute_v1, tpu_v2

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
# Single-host TPU VMs have at most 8 chips (v5e, v6e) or 8 TensorCores (v2-v5p) under the
# number in the accelerator type; anything larger is a multi-host slice, whose hosts run one
# worker together (docs/CLOUD.md, "Slices"; https://cloud.google.com/tpu/docs/v5e,
# https://cloud.google.com/tpu/docs/v4).
MAX_SINGLE_HOST_TPU = 8


class SpecError(ValueError):
    """A spec file or launch setting is invalid; the message names the file and the field."""


# ---- field checks: each returns the normalised value or raises ValueError("must be ...") ----


def _positive_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _non_negative_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("must be a non-negative integer")
    return value


def _boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _text(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("must be a non-empty string")
    return value


_GCE_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,48}[a-z0-9])?$")


def _resource_name(value: object) -> str:
    # 50 rather than GCE's 63 characters leaves room for the suffixes the tools append.
    if not isinstance(value, str) or not _GCE_NAME.match(value):
        raise ValueError("must be lowercase letters, digits and hyphens, start with a letter, at most 50 characters")
    return value


def _text_list(value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError("must be a list of non-empty strings")
    return list(value)


def _scopes(value: object) -> list[str]:
    scopes = _text_list(value)
    if not scopes:
        raise ValueError("must list at least one OAuth scope, e.g. cloud-platform")
    return [s if s.startswith("https://") else SCOPE_PREFIX + s for s in scopes]


_LABEL = re.compile(r"^[a-z][-_a-z0-9]{0,62}$")
_LABEL_VALUE = re.compile(r"^[-_a-z0-9]{0,63}$")


def _labels(value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ValueError("must be a mapping of label keys to values")
    for key, val in value.items():
        if not isinstance(key, str) or not _LABEL.match(key) or not isinstance(val, str) or not _LABEL_VALUE.match(val):
            raise ValueError(
                f"has label {key!r}: {val!r}; keys and values must be lowercase letters, digits, '-' or '_' (values quoted)"
            )
    return dict(value)


def _extras(value: object) -> list[str]:
    extras = _text_list(value)
    if not all(re.match(r"^[a-z0-9][-_a-z0-9]*$", e) for e in extras):
        raise ValueError("must be a list of package extras such as [extract]")
    return extras


MIN_PYTHON_MINOR = 11  # JAX 0.10 needs CPython 3.11


def _python(value: object) -> str:
    # startup.sh hands it to `uv python install`; `python3.11` is accepted for older specs.
    match = re.match(r"^(?:python)?3\.([0-9]+)$", value) if isinstance(value, str) else None
    if not match or int(match.group(1)) < MIN_PYTHON_MINOR:
        raise ValueError(f"must be a CPython version of at least 3.{MIN_PYTHON_MINOR}, such as 3.11 or 3.12")
    return f"3.{match.group(1)}"


# Compute Engine accepts 30 s to 120 days (https://cloud.google.com/compute/docs/instances/limit-vm-runtime).
def _run_duration(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 30 <= value <= 120 * 86400:
        raise ValueError("must be a number of seconds between 30 and 10368000 (120 days)")
    return value


def _choice(*options: str) -> Callable[[object], str]:
    def check(value: object) -> str:
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return value  # type: ignore[return-value]

    return check


def _tpu_type(value: object) -> str:
    """Single-host (v5litepod-8) and multi-host (v4-16, v5litepod-64) types alike: a slice is one worker."""
    match = re.match(r"^[a-z0-9]+-([0-9]+)$", value) if isinstance(value, str) else None
    if not match or int(match.group(1)) < 1:
        raise ValueError("must be a TPU accelerator type such as v5litepod-8, v5litepod-16 or v4-32")
    return value


def is_multi_host(accelerator_type: str) -> bool:
    return int(accelerator_type.rsplit("-", 1)[1]) > MAX_SINGLE_HOST_TPU


def _field(check: Callable[[object], object], default: object = dataclasses.MISSING) -> dataclasses.Field:
    """A spec field: `check` validates a value from the file; no default means required."""
    if isinstance(default, (list, dict)):
        # A fresh copy per spec, as dataclasses require for mutable defaults.
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"check": check})
    return dataclasses.field(default=default, metadata={"check": check})


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Common:
    kind: str = _field(_choice("vm", "tpu"))
    name: str = _field(_resource_name)
    consumer: str = _field(_text)
    spawn_flags: list[str] = _field(_text_list, [])
    extras: list[str] = _field(_extras, ["extract"])
    python: str = _field(_python, "3.11")
    # Seconds the worker waits for work held by others before it leaves (spawn.py --idle-timeout):
    # the idle cap that matters most on TPU VMs, which have no max_run_duration.
    max_idle_s: int | None = _field(_positive_int, None)
    spot: bool = _field(_boolean, True)
    service_account: str = _field(_text, "default")
    scopes: list[str] = _field(_scopes, ["cloud-platform"])
    labels: dict[str, str] = _field(_labels, {})
    network: str = _field(_text, "default")
    subnetwork: str | None = _field(_text, None)
    external_ip: bool = _field(_boolean, True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VmSpec(_Common):
    """An instance template: `name` is the template's name."""

    machine_type: str = _field(_text)
    image: str = _field(_text)
    disk_gb: int = _field(_positive_int, 100)
    disk_type: str = _field(_text, "pd-balanced")
    gpu_type: str | None = _field(_text, None)
    gpu_count: int = _field(_non_negative_int, 0)
    accelerator: str | None = _field(_choice("cpu", "gpu"), None)
    # Hard cap: Compute Engine deletes the VM this many seconds after it starts, whatever it is doing.
    max_run_duration_s: int | None = _field(_run_duration, None)

    @property
    def jax_flavour(self) -> str:
        return self.accelerator or ("gpu" if self.gpu_count else "cpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuSpec(_Common):
    """TPU VMs: `name` is the prefix of node (and queued resource) ids."""

    accelerator_type: str = _field(_tpu_type)
    runtime_version: str = _field(_text)
    queued: bool | None = _field(_boolean, None)
    #: Slices per unit of --count: K independent single-slice queued resources (or nodes), each its
    #: own claimant, never one multislice queued resource (docs/CLOUD.md, "Slices").
    slices: int = _field(_positive_int, 1)

    @property
    def use_queued_resources(self) -> bool:
        # Spot TPU capacity comes and goes; a queued resource waits for it instead of failing.
        return self.spot if self.queued is None else self.queued


_KINDS: dict[str, type[_Common]] = {"vm": VmSpec, "tpu": TpuSpec}


def parse_spec(raw: object, source: str) -> VmSpec | TpuSpec:
    """Validate a decoded spec; every problem is reported as 'SOURCE: field ...' before any API call."""
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: must be a YAML mapping of fields, got {type(raw).__name__}")
    kind = raw.get("kind")
    if kind not in _KINDS:
        raise SpecError(f"{source}: field 'kind' must be one of {', '.join(_KINDS)}, got {kind!r}")
    cls = _KINDS[kind]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise SpecError(
            f"{source}: unknown field {unknown[0]!r} for kind {kind!r}; known fields: {', '.join(sorted(fields))}"
        )
    values = {}
    for name, field in fields.items():
        if name not in raw:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise SpecError(f"{source}: field {name!r} is required for kind {kind!r}")
            continue
        if raw[name] is None and field.default is None:
            continue
        try:
            values[name] = field.metadata["check"](raw[name])
        except ValueError as err:
            raise SpecError(f"{source}: field {name!r} {err}, got {raw[name]!r}") from None
    spec = cls(**values)
    if isinstance(spec, VmSpec):
        if bool(spec.gpu_type) != bool(spec.gpu_count):
            raise SpecError(f"{source}: fields 'gpu_type' and 'gpu_count' go together; set both or neither")
        if spec.gpu_count and spec.accelerator == "cpu":
            raise SpecError(f"{source}: field 'accelerator' is 'cpu' but the spec attaches GPUs; use 'gpu'")
    return spec


def load_spec(path: str | Path) -> VmSpec | TpuSpec:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
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
            if not url.startswith("gs://") or len(url.rstrip("/")) <= len("gs://"):
                raise SpecError(f"{flag} must be a gs://bucket/prefix URL the machines can reach, got {url!r}")
        flags = list(spec.spawn_flags if spawn_flags is None else spawn_flags)
        if spec.max_idle_s is not None and "--idle-timeout" not in flags:
            flags += ["--idle-timeout", str(spec.max_idle_s)]
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
    node_spec = tpu_v2.QueuedResource.Tpu.NodeSpec(
        parent=f"projects/{project}/locations/{zone}",
        node_id=resource_id,
        node=tpu_node(spec, launch, queued_resource_id=resource_id),
    )
    qr = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[node_spec]))
    if spec.spot:
        qr.spot = tpu_v2.QueuedResource.Spot()
    return qr

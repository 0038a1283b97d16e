"""A machine spec's requests, built and then printed (`dry_run`) or sent and waited for: an instance template, a
managed instance group (or its resize), TPU VMs as queued resources or nodes. `gcs-spawner up` and `add` make a
run's machines from the same builders (fleet/specs.py, fleet/compute.py, fleet/tpu.py) and record them first
(gcs_spawner/fleetstep.py); these are the builders sent as they are. Clients are passed in by tests and made from
Application Default Credentials (or the FLEET_*_ENDPOINT overrides) otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import proto

from fleet import compute, gapi, specs, tpu

log = logging.getLogger(__name__)


def _send(batch: list[proto.Message], dry_run: bool, connect: Callable[[], object], bodies: bool = False) -> list[proto.Message]:
    """Print the batch (dry run: a line per request, or with `bodies` each whole) or send it through the clients
    `connect()` returns (made once)."""
    if dry_run:
        gapi.print_dry_run(batch, bodies)
    elif batch:
        try:
            clients = connect()
        except gapi.API_ERRORS as err:
            raise gapi.LaunchError(
                f"cannot make the API clients: {err} (run 'gcloud auth application-default login')"
            ) from None
        gapi.run_all(clients.send, batch)
    return batch


def create_template(
    spec_path: Path,
    project: str,
    queue: str,
    code: str,
    name: str | None = None,
    consumer: str | None = None,
    spawn_flags: list[str] | None = None,
    dry_run: bool = False,
    clients: compute.ComputeClients | None = None,
    bodies: bool = False,
) -> list[proto.Message]:
    spec = specs.load_spec(spec_path)
    if not isinstance(spec, specs.VmSpec):
        raise specs.SpecError(f"{spec_path}: kind {spec.kind!r} is not an instance template; give a kind: vm spec")
    launch = specs.Launch.make(spec, queue, code, consumer, spawn_flags)
    request = compute.insert_template(project, specs.instance_template(spec, launch, name))
    return _send([request], dry_run, lambda: clients or compute.ComputeClients.connect(), bodies)


def create_group(
    project: str,
    template: str,
    size: int,
    zone: str | None = None,
    region: str | None = None,
    name: str | None = None,
    resize: bool = False,
    dry_run: bool = False,
    clients: compute.ComputeClients | None = None,
    on_failure: str = "REPAIR",
    bodies: bool = False,
) -> list[proto.Message]:
    """A managed instance group named `name` (default: the template's name), or a resize of it."""
    name = name or template
    if resize:
        request = compute.resize_group(project, name, size, zone=zone, region=region)
    else:
        request = compute.insert_group(project, name, template, size, zone=zone, region=region, on_failure=on_failure)
    return _send([request], dry_run, lambda: clients or compute.ComputeClients.connect(), bodies)


def tpu_names(prefix: str, count: int, first_index: int = 0) -> list[str]:
    return [f"{prefix}-{i:04d}" for i in range(first_index, first_index + count)]


def create_tpus(
    spec_path: Path,
    project: str,
    zone: str,
    count: int,
    queue: str,
    code: str,
    first_index: int = 0,
    consumer: str | None = None,
    spawn_flags: list[str] | None = None,
    dry_run: bool = False,
    clients: tpu.TpuClients | None = None,
    bodies: bool = False,
) -> list[proto.Message]:
    """`count` times `spec.slices` TPU VMs (slices) named SPEC.name-NNNN, each its own queued resource when
    the spec says so (spot, by default), else its own node; `first_index` numbers the first."""
    spec = specs.load_spec(spec_path)
    if not isinstance(spec, specs.TpuSpec):
        raise specs.SpecError(f"{spec_path}: kind {spec.kind!r} is not a TPU spec; give a kind: tpu spec")
    launch = specs.Launch.make(spec, queue, code, consumer, spawn_flags)
    batch: list[proto.Message] = []
    for node_id in tpu_names(spec.name, count * spec.slices, first_index):
        if spec.use_queued_resources:
            qr = specs.queued_resource(spec, launch, project, zone, node_id)
            batch.append(tpu.create_queued_resource(project, zone, node_id, qr))
        else:
            batch.append(tpu.create_node(project, zone, node_id, specs.tpu_node(spec, launch)))
    return _send(batch, dry_run, lambda: clients or tpu.TpuClients.connect(), bodies)

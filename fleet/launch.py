"""What the launch tools do, one function per tool: build the requests, then print them
(`dry_run`) or send them and wait. Clients are passed in by tests and made from Application
Default Credentials (or the FLEET_*_ENDPOINT overrides) otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
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
        raise specs.SpecError(f"{spec_path}: kind {spec.kind!r} is not an instance template; use create_tpus.py")
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
        raise specs.SpecError(f"{spec_path}: kind {spec.kind!r} is not a TPU spec; use create_template.py")
    launch = specs.Launch.make(spec, queue, code, consumer, spawn_flags)
    batch: list[proto.Message] = []
    for node_id in tpu_names(spec.name, count * spec.slices, first_index):
        if spec.use_queued_resources:
            qr = specs.queued_resource(spec, launch, project, zone, node_id)
            batch.append(tpu.create_queued_resource(project, zone, node_id, qr))
        else:
            batch.append(tpu.create_node(project, zone, node_id, specs.tpu_node(spec, launch)))
    return _send(batch, dry_run, lambda: clients or tpu.TpuClients.connect(), bodies)


def _matches(resource_id: str, labels: Mapping[str, str], prefix: str | None, want: Mapping[str, str]) -> bool:
    return (prefix is None or resource_id.startswith(prefix)) and all(labels.get(k) == v for k, v in want.items())


def teardown(
    project: str,
    zone: str | None = None,
    region: str | None = None,
    group: str | None = None,
    template: str | None = None,
    tpu_prefix: str | None = None,
    tpu_labels: Mapping[str, str] | None = None,
    dry_run: bool = False,
    compute_clients: compute.ComputeClients | None = None,
    tpu_clients: tpu.TpuClients | None = None,
    bodies: bool = False,
) -> list[proto.Message]:
    """Delete the group (its VMs go with it), then the template it used, then TPU queued resources
    (force: their nodes go too) and any remaining nodes whose id starts with `tpu_prefix` and/or
    carry `tpu_labels`. Each phase waits for the one before: a template in use cannot be deleted."""
    wants_tpus = tpu_prefix is not None or bool(tpu_labels)
    if wants_tpus and not zone:
        raise ValueError("TPU teardown needs --zone")
    if not (group or template or wants_tpus):
        log.warning("event=teardown_nothing_named hint=give --group, --template, --tpu-prefix or --tpu-label")
    sent: list[proto.Message] = []
    connect_compute = lambda: compute_clients or compute.ComputeClients.connect()  # noqa: E731
    if group:
        sent += _send([compute.delete_group(project, group, zone=zone, region=region)], dry_run, connect_compute, bodies)
    if template:
        sent += _send([compute.delete_template(project, template)], dry_run, connect_compute, bodies)
    if not wants_tpus:
        return sent
    want = dict(tpu_labels or {})
    try:
        tpu_clients = tpu_clients or tpu.TpuClients.connect()
        queued_resources = tpu_clients.list_queued_resources(project, zone)
        nodes = tpu_clients.list_nodes(project, zone)
    except gapi.API_ERRORS as err:
        raise gapi.LaunchError(f"listing TPUs in {tpu.location(project, zone)} failed: {err}") from None
    doomed_nodes = set()
    batch: list[proto.Message] = []
    for qr in queued_resources:
        node_specs = list(qr.tpu.node_spec)
        labels = dict(node_specs[0].node.labels) if node_specs else {}
        if _matches(qr.name.rsplit("/", 1)[-1], labels, tpu_prefix, want):
            batch.append(tpu.delete_queued_resource(qr.name))
            doomed_nodes.update(f"{s.parent}/nodes/{s.node_id}" for s in node_specs)
    doomed_queued = {r.name for r in batch}
    for node in nodes:
        # A node that belongs to a queued resource being deleted goes with it.
        if node.name in doomed_nodes or node.queued_resource in doomed_queued:
            continue
        if _matches(node.name.rsplit("/", 1)[-1], dict(node.labels), tpu_prefix, want):
            batch.append(tpu.delete_node(node.name))
    if not batch:
        log.info("event=teardown_no_tpus project=%s zone=%s prefix=%s labels=%s", project, zone, tpu_prefix, want)
    return sent + _send(batch, dry_run, lambda: tpu_clients, bodies)

"""What the launch tools do, one function per tool: build the requests, then print them
(`dry_run`) or send them and wait. Clients are passed in by tests and made from Application
Default Credentials (or the FLEET_*_ENDPOINT overrides) otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import proto

from fleet import compute, gapi, specs, tpu

log = logging.getLogger(__name__)


def _send(requests: list[proto.Message], dry_run: bool, send) -> list[proto.Message]:
    if dry_run:
        gapi.print_dry_run(requests)
    elif requests:
        gapi.run_all(send, requests)
    return requests


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
) -> list[proto.Message]:
    spec = specs.load_spec(spec_path)
    if not isinstance(spec, specs.VmSpec):
        raise specs.SpecError(f"{spec_path}: kind {spec.kind!r} is not an instance template; use create_tpus.py")
    launch = specs.Launch.make(spec, queue, code, consumer, spawn_flags)
    request = compute.insert_template(project, specs.instance_template(spec, launch, name))
    return _send([request], dry_run, lambda r: (clients or compute.ComputeClients.connect()).send(r))


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
) -> list[proto.Message]:
    """A managed instance group named `name` (default: the template's name), or a resize of it."""
    name = name or template
    if resize:
        request = compute.resize_group(project, name, size, zone=zone, region=region)
    else:
        request = compute.insert_group(project, name, template, size, zone=zone, region=region)
    return _send([request], dry_run, lambda r: (clients or compute.ComputeClients.connect()).send(r))


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
) -> list[proto.Message]:
    """`count` TPU VMs named SPEC.name-NNNN: queued resources when the spec says so (spot, by default), else nodes."""
    spec = specs.load_spec(spec_path)
    if not isinstance(spec, specs.TpuSpec):
        raise specs.SpecError(f"{spec_path}: kind {spec.kind!r} is not a TPU spec; use create_template.py")
    launch = specs.Launch.make(spec, queue, code, consumer, spawn_flags)
    requests: list[proto.Message] = []
    for node_id in tpu_names(spec.name, count, first_index):
        if spec.use_queued_resources:
            qr = specs.queued_resource(spec, launch, project, zone, node_id)
            requests.append(tpu.create_queued_resource(project, zone, node_id, qr))
        else:
            requests.append(tpu.create_node(project, zone, node_id, specs.tpu_node(spec, launch)))
    return _send(requests, dry_run, lambda r: (clients or tpu.TpuClients.connect()).send(r))


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
) -> list[proto.Message]:
    """Delete the group (its VMs go with it), then the template it used, then TPU queued resources
    (force: their nodes go too) and any remaining nodes whose id starts with `tpu_prefix` and/or
    carry `tpu_labels`. Each phase waits for the one before: a template in use cannot be deleted."""
    sent: list[proto.Message] = []
    needs_compute = group or template
    compute_send = lambda r: (compute_clients or compute.ComputeClients.connect()).send(r)  # noqa: E731
    if group:
        sent += _send([compute.delete_group(project, group, zone=zone, region=region)], dry_run, compute_send)
    if template:
        sent += _send([compute.delete_template(project, template)], dry_run, compute_send)
    if tpu_prefix is None and not tpu_labels:
        if not needs_compute:
            log.warning("event=teardown_nothing_named hint=give --group, --template, --tpu-prefix or --tpu-label")
        return sent
    if not zone:
        raise ValueError("TPU teardown needs --zone")
    tpu_clients = tpu_clients or tpu.TpuClients.connect()
    want = dict(tpu_labels or {})
    doomed_nodes = set()
    requests: list[proto.Message] = []
    for qr in tpu_clients.list_queued_resources(project, zone):
        node_specs = list(qr.tpu.node_spec)
        labels = dict(node_specs[0].node.labels) if node_specs else {}
        if _matches(qr.name.rsplit("/", 1)[-1], labels, tpu_prefix, want):
            requests.append(tpu.delete_queued_resource(qr.name))
            doomed_nodes.update(f"{s.parent}/nodes/{s.node_id}" for s in node_specs)
    for node in tpu_clients.list_nodes(project, zone):
        owned = node.queued_resource and any(r.name == node.queued_resource for r in requests)
        if node.name in doomed_nodes or owned:
            continue
        if _matches(node.name.rsplit("/", 1)[-1], dict(node.labels), tpu_prefix, want):
            requests.append(tpu.delete_node(node.name))
    if not requests:
        log.info("event=teardown_no_tpus project=%s zone=%s prefix=%s labels=%s", project, zone, tpu_prefix, want)
    return sent + _send(requests, dry_run, tpu_clients.send)

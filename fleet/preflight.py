"""Pre-flight for the launch tools: before creating machines, check what would make them fail or
idle on the bill, and print it (also in --dry-run).

- The machines' service account has the roles it needs: on the project (self-deletion:
  roles/compute.instanceAdmin.v1 for VMs, roles/tpu.admin for TPU VMs; read through
  projects.getIamPolicy) and on the bucket (objects: roles/storage.objectUser or better, on the
  bucket's IAM policy or the project's). Owner and editor count for everything.
- The region's quotas cover the request (Compute Engine regions.get, `quotas`): CPUs of the
  machine family (or PREEMPTIBLE_CPUS for spot when the region grants it), the GPU family
  (PREEMPTIBLE_... for spot), IN_USE_ADDRESSES for external IPs
  (https://cloud.google.com/compute/resource-usage, https://cloud.google.com/compute/docs/reference/rest/v1/regions/get).
  TPU quotas are not served by that API (https://cloud.google.com/tpu/docs/quota): reported as not checked.
- The bucket is in the machines' region, or a multi-region that contains it: otherwise every read
  and write crosses regions, slower and billed as egress
  (https://cloud.google.com/storage/docs/locations).

`check_*` return Findings; `enforce` raises PreflightError naming each shortfall unless forced.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from google.cloud import compute_v1, storage

from fleet import gapi, iam

log = logging.getLogger(__name__)

OWNERS = {"roles/owner", "roles/editor"}
SELF_DELETE_ROLES = {
    "vm": OWNERS | {"roles/compute.instanceAdmin.v1", "roles/compute.instanceAdmin", "roles/compute.admin"},
    "tpu": OWNERS | {"roles/tpu.admin"},
}
BUCKET_ROLES = OWNERS | {"roles/storage.objectUser", "roles/storage.objectAdmin", "roles/storage.admin"}
MULTI_REGIONS = {"US": ("us-", "northamerica-"), "EU": ("europe-",), "ASIA": ("asia-",)}


class PreflightError(Exception):
    """A pre-flight check found a shortfall; the message names each role, quota or location."""


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str
    status: str  # ok | short | unchecked
    detail: str

    def line(self) -> str:
        return f"preflight {self.status:9s} {self.check}: {self.detail}"


@dataclasses.dataclass(frozen=True)
class Request:
    """What the launch asks for, per machine, times `count`."""

    kind: str  # vm | tpu
    count: int
    region: str
    service_account: str  # an email, or "default"
    bucket: str
    machine_type: str | None = None
    zone: str | None = None
    gpu_type: str | None = None
    gpu_count: int = 0
    spot: bool = True
    external_ip: bool = True


def default_service_account(project: str, compute_args: dict) -> str:
    """The project's default compute service account (Compute projects.get)."""
    return compute_v1.ProjectsClient(**compute_args).get(project=project).default_service_account


def check_roles(project: str, request: Request, email: str, rm: iam.ResourceManager, storage_client: storage.Client) -> list[Finding]:
    member = f"serviceAccount:{email}"
    findings = []
    try:
        project_roles = iam.roles_of(rm.policy(project), member)
    except iam.IamError as err:
        return [Finding("roles", "unchecked", f"cannot read the IAM policy of project {project}: {err}")]
    needed = SELF_DELETE_ROLES[request.kind]
    if project_roles & needed:
        findings.append(Finding("role:self-delete", "ok", f"{email} has {sorted(project_roles & needed)[0]} on {project}"))
    else:
        role = "roles/tpu.admin" if request.kind == "tpu" else "roles/compute.instanceAdmin.v1"
        findings.append(Finding("role:self-delete", "short",
                                f"{email} lacks {role} on project {project}: machines could not delete themselves"))
    if project_roles & BUCKET_ROLES:
        findings.append(Finding("role:bucket", "ok", f"{email} has {sorted(project_roles & BUCKET_ROLES)[0]} on project {project}"))
        return findings
    try:
        policy = storage_client.bucket(request.bucket).get_iam_policy(requested_policy_version=3)
        bucket_roles = {b["role"] for b in policy.bindings if member in b["members"]}
    except gapi.API_ERRORS as err:
        return [*findings, Finding("role:bucket", "unchecked", f"cannot read the IAM policy of bucket {request.bucket}: {err}")]
    if bucket_roles & BUCKET_ROLES:
        findings.append(Finding("role:bucket", "ok", f"{email} has {sorted(bucket_roles & BUCKET_ROLES)[0]} on gs://{request.bucket}"))
    else:
        findings.append(Finding("role:bucket", "short",
                                f"{email} lacks roles/storage.objectUser on gs://{request.bucket} (or the project)"))
    return findings


def check_location(request: Request, storage_client: storage.Client) -> Finding:
    try:
        bucket = storage_client.get_bucket(request.bucket)
    except gapi.API_ERRORS as err:
        return Finding("bucket:location", "unchecked", f"cannot read bucket {request.bucket}: {err}")
    location = (bucket.location or "").upper()
    if location == request.region.upper():
        return Finding("bucket:location", "ok", f"gs://{request.bucket} is in {request.region}")
    if any(request.region.startswith(p) for p in MULTI_REGIONS.get(location, ())):
        return Finding("bucket:location", "ok", f"gs://{request.bucket} is in multi-region {location}, which holds {request.region}")
    return Finding("bucket:location", "short",
                   f"gs://{request.bucket} is in {location}, the machines in {request.region}: move the bucket or the machines")


def _gpu_metric(gpu_type: str) -> str:
    name = gpu_type.removeprefix("nvidia-tesla-").removeprefix("nvidia-")
    return f"NVIDIA_{name.upper().replace('-', '_')}_GPUS"


def check_quotas(project: str, request: Request, compute_args: dict) -> list[Finding]:
    if request.kind == "tpu":
        return [Finding("quota:tpu", "unchecked", "TPU quotas are not in the Compute regions API; see the console's "
                        "Quotas page (https://cloud.google.com/tpu/docs/quota)")]
    try:
        region = compute_v1.RegionsClient(**compute_args).get(project=project, region=request.region)
        zone = request.zone or region.zones[0].rsplit("/", 1)[-1]
        machine = compute_v1.MachineTypesClient(**compute_args).get(project=project, zone=zone, machine_type=request.machine_type)
    except (gapi.API_ERRORS + (IndexError,)) as err:
        return [Finding("quota", "unchecked", f"cannot read region {request.region} or machine type {request.machine_type}: {err}")]
    quotas = {q.metric: q.limit - q.usage for q in region.quotas}
    granted = {q.metric for q in region.quotas if q.limit > 0}
    needs: list[tuple[str, float]] = []
    family = f"{request.machine_type.split('-')[0].upper()}_CPUS"
    cpu_metric = "PREEMPTIBLE_CPUS" if request.spot and "PREEMPTIBLE_CPUS" in granted else (family if family in quotas else "CPUS")
    needs.append((cpu_metric, machine.guest_cpus * request.count))
    gpus = [(request.gpu_type, request.gpu_count)] if request.gpu_count else [
        (a.guest_accelerator_type, a.guest_accelerator_count) for a in machine.accelerators]
    for gpu_type, per_vm in gpus:
        metric = _gpu_metric(gpu_type)
        if request.spot and f"PREEMPTIBLE_{metric}" in granted:
            metric = f"PREEMPTIBLE_{metric}"
        needs.append((metric, per_vm * request.count))
    if request.external_ip:
        needs.append(("IN_USE_ADDRESSES", request.count))
    findings = []
    for metric, need in needs:
        if metric not in quotas:
            findings.append(Finding(f"quota:{metric}", "unchecked", f"region {request.region} lists no quota {metric}"))
        elif quotas[metric] >= need:
            findings.append(Finding(f"quota:{metric}", "ok", f"need {need:g}, {quotas[metric]:g} free in {request.region}"))
        else:
            findings.append(Finding(f"quota:{metric}", "short",
                                    f"need {need:g}, only {quotas[metric]:g} free in {request.region}: request more quota or fewer machines"))
    return findings


STORAGE_ENDPOINT_ENV = "FLEET_STORAGE_ENDPOINT"


def _storage_client(project: str) -> storage.Client:
    """ADC, or FLEET_STORAGE_ENDPOINT (a plain http:// one is a local test server: anonymous)."""
    import os

    endpoint = os.environ.get(STORAGE_ENDPOINT_ENV)
    if endpoint and endpoint.startswith("http://"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project=project, credentials=AnonymousCredentials(), client_options={"api_endpoint": endpoint})
    return storage.Client(project=project, client_options={"api_endpoint": endpoint} if endpoint else None)


def bucket_of(url: str) -> str:
    return url.removeprefix("gs://").split("/", 1)[0]


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def request_for_template(template: compute_v1.InstanceTemplate, count: int, zone: str | None, region: str | None) -> Request:
    """What a group of `count` VMs from `template` asks for (read back from the API)."""
    props = template.properties
    items = {i.key: i.value for i in props.metadata.items}
    accelerators = list(props.guest_accelerators)
    return Request(
        kind="vm",
        count=count,
        region=region or region_of(zone or ""),
        zone=zone,
        service_account=props.service_accounts[0].email if props.service_accounts else "default",
        bucket=bucket_of(items.get("spawn-queue", "")),
        machine_type=props.machine_type.rsplit("/", 1)[-1],
        gpu_type=accelerators[0].accelerator_type.rsplit("/", 1)[-1] if accelerators else None,
        gpu_count=accelerators[0].accelerator_count if accelerators else 0,
        spot=props.scheduling.provisioning_model == "SPOT",
        external_ip=any(len(n.access_configs) for n in props.network_interfaces),
    )


def request_for_tpus(spec, count: int, zone: str, queue: str) -> Request:
    return Request(kind="tpu", count=count, region=region_of(zone), zone=zone, service_account=spec.service_account,
                   bucket=bucket_of(queue), spot=spec.spot, external_ip=spec.external_ip)


def run_checks(
    project: str,
    request: Request,
    compute_args: dict | None = None,
    rm: iam.ResourceManager | None = None,
    storage_client: storage.Client | None = None,
) -> list[Finding]:
    """Every check, each reported; API trouble makes a check `unchecked`, never a crash."""
    compute_args = compute_args if compute_args is not None else gapi.client_args("FLEET_COMPUTE_ENDPOINT")
    try:
        rm = rm or iam.ResourceManager()
        storage_client = storage_client or _storage_client(project)
    except gapi.API_ERRORS as err:
        return [Finding("credentials", "unchecked", f"cannot make API clients: {err}")]
    email = request.service_account
    findings: list[Finding] = []
    if email == "default":
        try:
            email = default_service_account(project, compute_args)
        except gapi.API_ERRORS as err:
            findings.append(Finding("roles", "unchecked", f"cannot find the default service account of {project}: {err}"))
            email = ""
    if email:
        findings += check_roles(project, request, email, rm, storage_client)
    findings.append(check_location(request, storage_client))
    findings += check_quotas(project, request, compute_args)
    return findings


def enforce(findings: Sequence[Finding], force: bool = False) -> None:
    """Print every finding; raise PreflightError naming the shortfalls unless `force`."""
    for finding in findings:
        print(finding.line())
    short = [f for f in findings if f.status == "short"]
    if short and not force:
        raise PreflightError("pre-flight found shortfalls (fix them, or pass --force):\n  " + "\n  ".join(
            f"{f.check}: {f.detail}" for f in short))
    if short:
        log.warning("event=preflight_forced shortfalls=%d", len(short))

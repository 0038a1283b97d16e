"""Pre-flight for the launch tools: before creating machines, check what would make them fail or
idle on the bill, and print it (also in --dry-run).

- The machines' service account has the roles it needs: on the project (self-deletion:
  roles/compute.instanceAdmin.v1 for VMs, roles/tpu.admin for TPU VMs) and on the bucket
  (objects: roles/storage.objectUser or better). Owner and editor count for everything. A role
  may be granted on the resource itself or on any ancestor (project, folders, organization:
  https://cloud.google.com/iam/docs/resource-hierarchy-access-control), directly or through a
  group, a domain or a principal set (https://cloud.google.com/iam/docs/principals-overview).
  The check reads the policies of the bucket, the project (projects.getIamPolicy) and its
  ancestors (projects.getAncestry, then folders/organizations getIamPolicy); a grant it cannot
  see for certain (a binding to a group or a domain, whose members it cannot list; a conditional
  binding; a custom role; an ancestor whose policy it cannot read) makes the finding
  `unverified`, which never stops a launch. Only a role that no readable policy could grant is
  `short`.
- The region's quotas cover the request (Compute Engine regions.get, `quotas`): CPUs of the
  machine family (or PREEMPTIBLE_CPUS for spot when the region grants it), the GPU family
  (PREEMPTIBLE_... for spot), IN_USE_ADDRESSES for external IPs
  (https://cloud.google.com/compute/resource-usage, https://cloud.google.com/compute/docs/reference/rest/v1/regions/get).
  TPU quotas are not served by that API (https://cloud.google.com/tpu/docs/quota): reported as not checked.
- The bucket is in the machines' region, or in a dual-region or multi-region that contains it:
  otherwise every read and write crosses regions, slower and billed as egress
  (https://cloud.google.com/storage/docs/locations).
- Machines without external IPs reach Cloud Storage and the Google APIs only through Private
  Google Access on their subnet (Compute subnetworks.get, `privateIpGoogleAccess`:
  https://cloud.google.com/vpc/docs/private-google-access,
  https://cloud.google.com/compute/docs/reference/rest/v1/subnetworks/get) or through Cloud NAT
  (https://cloud.google.com/nat/docs/overview). The check reads the subnet; a fleet that uses
  Cloud NAT instead passes --force.

`check_*` return Findings; `enforce` (the one rule, for `up` and `add` too) raises PreflightError naming each shortfall unless forced.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence

import requests
from google.cloud import compute_v1, storage

from exitcodes import EX_DATAERR
from fleet import gapi, iam
from objectstore import bucket_of

log = logging.getLogger(__name__)

OWNERS = {"roles/owner", "roles/editor"}
SELF_DELETE_ROLES = {
    "vm": OWNERS | {"roles/compute.instanceAdmin.v1", "roles/compute.instanceAdmin", "roles/compute.admin"},
    "tpu": OWNERS | {"roles/tpu.admin"},
}
BUCKET_ROLES = OWNERS | {"roles/storage.objectUser", "roles/storage.objectAdmin", "roles/storage.admin"}
# Multi-regions by the prefix of the regions they hold (https://cloud.google.com/storage/docs/locations):
# US is data centers in the United States (not northamerica-*, which are in Canada and Mexico).
MULTI_REGIONS = {"US": ("us-",), "EU": ("europe-",), "ASIA": ("asia-",)}
# Predefined dual-regions and the two regions each holds (https://cloud.google.com/storage/docs/locations,
# "Predefined dual-regions"). A configurable dual-region names its regions in the bucket's
# customPlacementConfig.dataLocations instead (https://cloud.google.com/storage/docs/locations#configurable).
DUAL_REGIONS = {
    "ASIA1": ("asia-northeast1", "asia-northeast2"),
    "EUR4": ("europe-north1", "europe-west4"),
    "NAM4": ("us-central1", "us-east1"),
}
# Members whose holders the pre-flight cannot enumerate (https://cloud.google.com/iam/docs/principals-overview).
INDIRECT_MEMBERS = ("group:", "domain:", "principalSet:", "principal:")


class PreflightError(Exception):
    """A pre-flight check found a shortfall; the message names each role, quota or location."""

    exit_code = EX_DATAERR  # what a command that ends on it exits with (gcs_spawner/cli.py)


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str
    status: str  # ok | short | unverified (may be granted where the check cannot see) | unchecked
    detail: str

    def line(self) -> str:
        return f"preflight {self.status:10s} {self.check}: {self.detail}"


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
    network: str = "default"  # a name or a (partial) URL
    subnetwork: str | None = None  # a name or a (partial) URL; None: the network's subnet in `region`


def default_service_account(project: str, compute_args: dict) -> str:
    """The project's default compute service account (Compute projects.get)."""
    return compute_v1.ProjectsClient(**compute_args).get(project=project).default_service_account


@dataclasses.dataclass(frozen=True)
class Policy:
    """One IAM policy the check read (`policy`), or could not read (`error`), and whose it is."""

    resource: str  # e.g. "project proj", "folders/123", "gs://bkt"
    policy: dict | None = None
    error: str | None = None


def grant_finding(check: str, member: str, needed: set[str], policies: Sequence[Policy], missing: str) -> Finding:
    """Whether any of `policies` grants `member` one of `needed`: `ok` for a direct, unconditional
    binding; `unverified` when one may grant it where the check cannot look (see the module
    docstring); `short` only when every policy was read and none can; `missing` says what to grant."""
    doubts = []
    for source in policies:
        if source.policy is None:
            doubts.append(f"cannot read the IAM policy of {source.resource} ({source.error})")
            continue
        for binding in source.policy.get("bindings", []):
            role, members = binding.get("role", ""), binding.get("members", [])
            if member in members and role in needed and not binding.get("condition"):
                return Finding(check, "ok", f"{member.split(':', 1)[1]} has {role} on {source.resource}")
            if role in needed:
                indirect = [m for m in members if m.startswith(INDIRECT_MEMBERS)]
                if indirect:
                    doubts.append(f"{role} is bound to {', '.join(indirect[:3])} on {source.resource}")
                if member in members and binding.get("condition"):
                    doubts.append(f"{role} is bound under a condition on {source.resource}")
            if member in members and not role.startswith("roles/"):
                doubts.append(f"custom role {role} on {source.resource} may hold the permissions")
    if doubts:
        return Finding(check, "unverified", f"{member.split(':', 1)[1]} has no direct grant of {missing}, but "
                       + "; ".join(doubts) + " (check by hand: https://cloud.google.com/policy-intelligence/docs/troubleshoot-access)")
    read = ", ".join(s.resource for s in policies)
    return Finding(check, "short", f"{member.split(':', 1)[1]} lacks {missing} (none of {read} grants it)")


def project_policies(project: str, rm: iam.ResourceManager) -> list[Policy]:
    """The project's IAM policy and its ancestors' (folders, organization), each or its read error.

    Ancestors through Resource Manager v1 projects.getAncestry and v3 folders/organizations
    getIamPolicy (https://cloud.google.com/resource-manager/reference/rest/v1/projects/getAncestry,
    https://cloud.google.com/resource-manager/reference/rest/v3/folders/getIamPolicy,
    https://cloud.google.com/resource-manager/reference/rest/v3/organizations/getIamPolicy)."""
    try:
        policies = [Policy(f"project {project}", rm.policy(project))]
    except iam.IamError as err:
        return [Policy(f"project {project}", error=str(err))]
    try:
        ancestry = _crm_post(rm, f"v1/projects/{project}:getAncestry", {})
    except iam.IamError as err:
        return [*policies, Policy(f"the ancestors of project {project}", error=str(err))]
    for ancestor in ancestry.get("ancestor", []):
        kind, ident = ancestor["resourceId"]["type"], ancestor["resourceId"]["id"]
        if kind == "project":
            continue
        resource = f"{kind}s/{ident}"  # folder -> folders/ID, organization -> organizations/ID
        try:
            policies.append(Policy(resource, _crm_post(rm, f"v3/{resource}:getIamPolicy",
                                                       {"options": {"requestedPolicyVersion": 3}})))
        except iam.IamError as err:
            policies.append(Policy(resource, error=str(err)))
    return policies


def _crm_post(rm: iam.ResourceManager, path: str, body: dict) -> dict:
    """One Resource Manager call on `rm`'s endpoint and session."""
    try:
        resp = rm.session.post(f"{rm.endpoint}/{path}", json=body, timeout=rm.timeout_s)
    except requests.RequestException as err:
        raise iam.IamError(f"{path} could not be sent: {err}") from None
    if resp.status_code != 200:
        raise iam.IamError(f"{path} answered {resp.status_code}: {resp.text[:200]}")
    return resp.json()


def check_roles(project: str, request: Request, email: str, rm: iam.ResourceManager, storage_client: storage.Client) -> list[Finding]:
    member = f"serviceAccount:{email}"
    inherited = project_policies(project, rm)
    role = "roles/tpu.admin" if request.kind == "tpu" else "roles/compute.instanceAdmin.v1"
    findings = [grant_finding("role:self-delete", member, SELF_DELETE_ROLES[request.kind], inherited,
                              f"{role} on project {project}: machines could not delete themselves")]
    try:
        policy = storage_client.bucket(request.bucket).get_iam_policy(requested_policy_version=3)
        bucket = Policy(f"gs://{request.bucket}", {"bindings": [dict(b) for b in policy.bindings]})
    except gapi.API_ERRORS as err:
        bucket = Policy(f"gs://{request.bucket}", error=str(err))
    # A bucket inherits the project's and its ancestors' bindings (https://cloud.google.com/storage/docs/access-control/iam).
    findings.append(grant_finding("role:bucket", member, BUCKET_ROLES, [bucket, *inherited],
                                  f"roles/storage.objectUser on gs://{request.bucket} (or the project)"))
    return findings


def check_location(request: Request, storage_client: storage.Client) -> Finding:
    try:
        bucket = storage_client.get_bucket(request.bucket)
    except gapi.API_ERRORS as err:
        return Finding("bucket:location", "unchecked", f"cannot read bucket {request.bucket}: {err}")
    location, region = (bucket.location or "").upper(), request.region.lower()
    where = f"gs://{request.bucket} is in {location}"
    # A configurable dual-region lists its regions; so may any bucket (the API's customPlacementConfig).
    regions = [r.lower() for r in (bucket.data_locations or [])] or list(DUAL_REGIONS.get(location, ()))
    if location.lower() == region or region in regions:
        kind = f"dual-region {location} ({', '.join(regions)})" if regions else "the same region"
        return Finding("bucket:location", "ok", f"{where}: {kind}, which holds {request.region}")
    if any(region.startswith(p) for p in MULTI_REGIONS.get(location, ())) and not regions:
        return Finding("bucket:location", "ok", f"gs://{request.bucket} is in multi-region {location}, which holds {request.region}")
    if not regions and location not in MULTI_REGIONS and not re.fullmatch(r"[A-Z]+-[A-Z]+[0-9]+", location):
        return Finding("bucket:location", "unchecked", f"{where} ({bucket.location_type or 'location type unknown'}), "
                       f"which this check does not know; make sure it holds {request.region}")
    return Finding("bucket:location", "short", f"{where}, the machines in {request.region}: move the bucket or the machines")


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


def _named(value: str) -> tuple[str | None, str | None, str]:
    """(project, region, name) from a name or a (partial) URL such as projects/P/regions/R/subnetworks/S."""
    parts = value.split("/")
    project = parts[parts.index("projects") + 1] if "projects" in parts[:-1] else None
    region = parts[parts.index("regions") + 1] if "regions" in parts[:-1] else None
    return project, region, parts[-1]


def check_private_access(project: str, request: Request, compute_args: dict) -> list[Finding]:
    """Without external IPs, the machines' subnet must have Private Google Access (or Cloud NAT: --force)."""
    if request.external_ip:
        return []
    client = compute_v1.SubnetworksClient(**compute_args)
    network = _named(request.network)[2]
    try:
        if request.subnetwork:
            # A Shared VPC subnet names its host project in the URL.
            sub_project, sub_region, name = _named(request.subnetwork)
            subnets = [client.get(project=sub_project or project, region=sub_region or request.region, subnetwork=name)]
        else:
            subnets = [s for s in client.list(project=project, region=request.region)
                       if s.network.rsplit("/", 1)[-1] == network]
    except gapi.API_ERRORS as err:
        return [Finding("network:private-access", "unchecked", f"cannot read the subnet of network {network} in "
                        f"{request.region}: {err}")]
    if not subnets:
        return [Finding("network:private-access", "unchecked", f"network {network} has no subnet in {request.region} "
                        f"that project {project} can list; the machines could not be created there")]
    findings = []
    for subnet in subnets:
        if subnet.private_ip_google_access:
            findings.append(Finding("network:private-access", "ok", f"subnet {subnet.name} in {request.region} has "
                                    "Private Google Access: machines without external IPs reach Cloud Storage and the APIs"))
        else:
            findings.append(Finding("network:private-access", "short", (
                f"subnet {subnet.name} in {request.region} has Private Google Access off, and the machines have no "
                "external IP: they could not reach the bucket or the APIs. Run 'gcloud compute networks subnets update "
                f"{subnet.name} --region {request.region} --enable-private-ip-google-access', or pass --force if "
                "Cloud NAT serves the subnet")))
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
        bucket=bucket_of(items.get("spawn-queue", "")) or "",
        machine_type=props.machine_type.rsplit("/", 1)[-1],
        gpu_type=accelerators[0].accelerator_type.rsplit("/", 1)[-1] if accelerators else None,
        gpu_count=accelerators[0].accelerator_count if accelerators else 0,
        spot=props.scheduling.provisioning_model == "SPOT",
        external_ip=any(len(n.access_configs) for n in props.network_interfaces),
        network=props.network_interfaces[0].network if props.network_interfaces else "default",
        subnetwork=(props.network_interfaces[0].subnetwork or None) if props.network_interfaces else None,
    )


def request_for_tpus(spec, count: int, zone: str, queue: str) -> Request:
    return Request(kind="tpu", count=count, region=region_of(zone), zone=zone, service_account=spec.service_account,
                   bucket=bucket_of(queue) or "", spot=spec.spot, external_ip=spec.external_ip, network=spec.network,
                   subnetwork=spec.subnetwork)


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
    findings += check_private_access(project, request, compute_args)
    findings += check_quotas(project, request, compute_args)
    return findings


def enforce(findings: Sequence[Finding], force: bool = False, say=print, fix: str = "pass --force") -> None:
    """Say every finding (`say(line)`); raise PreflightError naming the shortfalls unless `force` (`fix` says how
    to force it: a flag, or the run file's fleet.force)."""
    for finding in findings:
        say(finding.line())
    short = [f for f in findings if f.status == "short"]
    if short and not force:
        raise PreflightError(f"the pre-flight found shortfalls (fix them, or {fix}):\n  " + "\n  ".join(
            f"{f.check}: {f.detail}" for f in short))
    if short:
        log.warning("event=preflight_forced shortfalls=%d", len(short))

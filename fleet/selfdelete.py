"""A machine deleting itself when its queue is empty, so an idle fleet stops costing money.

What to delete depends on how the machine was made, which it learns from the metadata server:

- a managed instance group member (attribute `created-by`) asks its group to delete it
  (`instanceGroupManagers.deleteInstances`, zonal or regional), which also lowers the group's
  target size; a plain `instances.delete` would make the group recreate it;
- a standalone VM deletes its instance;
- a TPU VM (attribute `tpu-env`) deletes the queued resource that made it (with force, which
  takes the node along) when there is one, else its node.

API errors are retried with exponential backoff and jitter, a bounded number of times. A machine
that still cannot delete itself logs why and powers off, which at least stops the VM's
compute charges (its disk, or a stopped TPU VM, may still cost until teardown) -- except a
managed instance group member: a group repairs a stopped member by recreating it
(https://cloud.google.com/compute/docs/instance-groups/about-repairing-vms-in-a-mig), which would
boot, fail to delete, power off, and so on forever. Such a member stays up, idle, with its failed
record in the bucket, until teardown or the template's max_run_duration.

Before any of that can happen, `check_permissions()` runs at boot, before the worker claims
anything (startup.sh: `python -m fleet.selfdelete check`): it asks Cloud Resource Manager
(projects.testIamPermissions) whether this machine's credentials hold the permissions its delete
call needs, so a machine that could never delete itself says so in the bucket and does no work.
Only a definite "not granted" stops the boot; an answer it cannot read lets the worker go on, with
`permissions: unverified` in its machine record (check_permissions).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import proto
import requests
import tenacity
from google.api_core import exceptions as api_exceptions

from fleet import iam
from fleet.gapi import API_ERRORS, target_of
from fleet.metadata import MetadataClient, MetadataError

# fleet.compute, fleet.tpu and fleet.specs import google.cloud.compute_v1, whose import alone is
# most of the boot's permission check (seconds of CPU): they are imported where a delete needs them.
# fleet.specs.ATTR_QUEUED_RESOURCE names this attribute; a test pins the two equal.
ATTR_QUEUED_RESOURCE = "spawn-queued-resource"


def _clouds():
    from fleet import compute, tpu

    return compute, tpu

log = logging.getLogger(__name__)


class SelfDeleteError(Exception):
    """This machine could not work out what it is, so it cannot tell what to delete."""


@dataclasses.dataclass(frozen=True)
class Identity:
    """What this machine is, as far as deleting it goes."""

    project: str
    zone: str
    instance: str
    created_by: str | None = None  # set on managed instance group members
    tpu_node: str | None = None  # NODE_ID from tpu-env on TPU VMs
    queued_resource: str | None = None  # from our own attribute on nodes made by a queued resource


def parse_tpu_env(text: str) -> dict[str, str]:
    """`tpu-env` is one `KEY: 'value'` per line."""
    env = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            env[key.strip()] = value.strip().strip("'\"")
    return env


def read_identity(metadata: MetadataClient) -> Identity:
    project = metadata.text("project/project-id").strip()
    zone = metadata.text("instance/zone").strip().rsplit("/", 1)[-1]  # projects/NUMBER/zones/ZONE
    instance = metadata.text("instance/name").strip()
    tpu_env = metadata.attribute("tpu-env")
    node = None
    if tpu_env is not None:
        env = parse_tpu_env(tpu_env)
        node = env.get("NODE_ID")
        zone = env.get("ZONE", zone)
        if not node:
            raise SelfDeleteError("attribute tpu-env has no NODE_ID; cannot tell which TPU node this is")
    return Identity(
        project=project,
        zone=zone,
        instance=instance,
        created_by=metadata.attribute("created-by"),
        tpu_node=node,
        queued_resource=metadata.attribute(ATTR_QUEUED_RESOURCE),
    )


def _transient(err: BaseException) -> bool:
    # 4xx other than 429 will not change by retrying: permission, not-found, bad request.
    return isinstance(
        err,
        (
            api_exceptions.TooManyRequests,
            api_exceptions.ServerError,
            api_exceptions.RetryError,
            requests.ConnectionError,
            requests.Timeout,
        ),
    )


@dataclasses.dataclass
class SelfDeleter:
    """Works out and performs the one call that deletes this machine. Clients are made on first use
    (from Application Default Credentials, or FLEET_COMPUTE_ENDPOINT / FLEET_TPU_ENDPOINT) unless given."""

    metadata: MetadataClient
    compute_clients: compute.ComputeClients | None = None
    tpu_clients: tpu.TpuClients | None = None
    attempts: int = 6
    max_wait_s: float = 30.0
    # The operation normally ends with this machine; if it is still up after this, power off.
    operation_wait_s: float = 300.0

    def _compute(self) -> compute.ComputeClients:
        compute, _ = _clouds()
        if self.compute_clients is None:
            self.compute_clients = compute.ComputeClients.connect()
        return self.compute_clients

    def _tpu(self) -> tpu.TpuClients:
        _, tpu = _clouds()
        if self.tpu_clients is None:
            self.tpu_clients = tpu.TpuClients.connect()
        return self.tpu_clients

    def _retrying(self) -> tenacity.Retrying:
        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(_transient),
            stop=tenacity.stop_after_attempt(self.attempts),
            wait=tenacity.wait_random_exponential(multiplier=1, max=self.max_wait_s),
            before_sleep=lambda state: log.warning(
                "event=self_delete_retry attempt=%d error=%s", state.attempt_number, state.outcome.exception()
            ),
            reraise=True,
        )

    def queued_resource_of(self, identity: Identity) -> str | None:
        """Full name of the queued resource that made this TPU node, if any.

        Our tool records it in the node's metadata; a node made some other way is asked about
        through the TPU API (Node.queued_resource)."""
        _, tpu = _clouds()
        location = tpu.location(identity.project, identity.zone)
        if identity.queued_resource:
            return f"{location}/queuedResources/{identity.queued_resource}"
        node = self._retrying()(self._tpu().get_node, f"{location}/nodes/{identity.tpu_node}")
        return node.queued_resource or None

    def plan(self, identity: Identity) -> tuple[str, proto.Message, Callable[..., None]]:
        """(kind, request, send): the deletion this machine should ask for."""
        compute, tpu = _clouds()
        if identity.tpu_node:
            queued = self.queued_resource_of(identity)
            if queued:
                return "tpu_queued_resource", tpu.delete_queued_resource(queued), self._tpu().send
            node = f"{tpu.location(identity.project, identity.zone)}/nodes/{identity.tpu_node}"
            return "tpu_node", tpu.delete_node(node), self._tpu().send
        if identity.created_by:
            group = compute.GroupRef.parse(identity.created_by)
            request = compute.remove_group_member(identity.project, group, identity.zone, identity.instance)
            return "group_member", request, self._compute().send
        return "instance", compute.delete_instance(identity.project, identity.zone, identity.instance), self._compute().send

    def run(self) -> None:
        identity = read_identity(self.metadata)
        what, request, send = self.plan(identity)
        log.info(
            "event=self_delete_requested kind=%s project=%s zone=%s instance=%s target=%s",
            what, identity.project, identity.zone, identity.instance, target_of(request),
        )
        self._retrying()(send, request, timeout_s=self.operation_wait_s)
        log.info("event=self_delete_accepted kind=%s target=%s", what, target_of(request))


#: What each kind of self-deletion is checked for at boot, on the project. Only permissions that
#: Google documents are asked (an unknown one is answered 400 or left out, which says nothing): the
#: Compute ones are on each method's reference page (instanceGroupManagers.deleteInstances needs
#: compute.instanceGroupManagers.update, https://cloud.google.com/compute/docs/reference/rest/v1/instanceGroupManagers/deleteInstances;
#: instances.delete needs compute.instances.delete), the TPU ones in roles/tpu.admin
#: (https://cloud.google.com/iam/docs/roles-permissions/tpu), which lists tpu.nodes.* and no
#: queued-resource permission. So a queued resource is checked for tpu.nodes.delete: deleting it with
#: force deletes its node first (queuedResources.delete, `force`), and whatever permission the queued
#: resource itself needs is not published, so it cannot be asked. A plain node also needs
#: tpu.nodes.get: the delete first reads the node to find a queued resource (queued_resource_of).
PERMISSIONS = {
    "group_member": ("compute.instanceGroupManagers.update",),
    "instance": ("compute.instances.delete",),
    "tpu_queued_resource": ("tpu.nodes.delete",),
    "tpu_node": ("tpu.nodes.get", "tpu.nodes.delete"),
}
ROLE_HINT = {
    "group_member": "roles/compute.instanceAdmin.v1",
    "instance": "roles/compute.instanceAdmin.v1",
    "tpu_queued_resource": "roles/tpu.admin",
    "tpu_node": "roles/tpu.admin",
}
#: Where `check` leaves its verdict for the worker's machine records (fleet.machines.machine_identity).
STATE_DIR_ENV = "FLEET_STATE_DIR"
VERDICT_FILE = "permission-check.json"


def deletion_kind(identity: Identity) -> str:
    """Which PERMISSIONS entry applies, from the identity alone (no API call)."""
    if identity.tpu_node:
        return "tpu_queued_resource" if identity.queued_resource else "tpu_node"
    return "group_member" if identity.created_by else "instance"


class PermissionMissing(Exception):
    """This machine's credentials definitely lack a permission its self-deletion needs; the message names it."""


@dataclasses.dataclass(frozen=True)
class PermissionVerdict:
    """The boot's answer when nothing is definitely missing: `granted` (testIamPermissions answered
    that every permission asked is held) or `unverified` (no answer it could read: `detail` says why)."""

    kind: str
    outcome: str
    detail: str = ""

    def line(self) -> str:
        return f"{self.outcome}: {self.kind}" + (f" ({self.detail})" if self.detail else "")


def _iam_transient(err: BaseException) -> bool:
    return isinstance(err, iam.IamError) and (err.status is None or err.status == 429 or err.status >= 500)


def check_permissions(
    metadata: MetadataClient, resource_manager: iam.ResourceManager | None = None, attempts: int = 3, max_wait_s: float = 4.0
) -> PermissionVerdict:
    """Whether this machine may delete itself. Raises PermissionMissing only on a definite "not
    granted": testIamPermissions answered, in the shape it documents, without a permission the delete
    needs. Anything it cannot read (an error status, a connection that fails `attempts` times, an
    answer naming permissions it was not asked about) is `unverified`: a healthy machine is never
    stopped by a check that could not run, and the machine record says so."""
    identity = read_identity(metadata)
    kind = deletion_kind(identity)
    wanted = PERMISSIONS[kind]
    try:
        manager = resource_manager or iam.ResourceManager()
        held = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_iam_transient),
            stop=tenacity.stop_after_attempt(attempts),
            wait=tenacity.wait_random_exponential(multiplier=0.5, max=max_wait_s),
            reraise=True,
        )(manager.held, identity.project, wanted)
    except (iam.IamError, *API_ERRORS) as err:
        detail = str(err).replace("\n", " ")[:300]
        log.warning("event=permission_check outcome=unverified kind=%s permissions=%s error=%s", kind, ",".join(wanted), detail)
        return PermissionVerdict(kind, "unverified", f"cannot check {','.join(wanted)} on project {identity.project}: {detail}")
    missing = [p for p in wanted if p not in held]
    if missing:
        raise PermissionMissing(
            f"missing_permission: {','.join(missing)} on project {identity.project} (needed for self-deletion as "
            f"{kind}); grant the machines' service account {ROLE_HINT[kind]}"
        )
    return PermissionVerdict(kind, "granted")


def verdict_path() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV) or "/var/lib/fleet") / VERDICT_FILE


def save_verdict(verdict: PermissionVerdict) -> None:
    """Leave the verdict where the worker's records pick it up; a record is for people, so a failed
    write is logged, never fatal."""
    path = verdict_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"permissions": verdict.outcome, "permissions_detail": verdict.detail or None}) + "\n")
    except OSError as err:
        log.warning("event=permission_verdict_unsaved path=%s error=%s", path, err)


def saved_verdict() -> dict[str, str]:
    """The fields the boot's permission check adds to every machine record ({} when there is none)."""
    try:
        fields = json.loads(verdict_path().read_text())
    except (OSError, ValueError):
        return {}
    return {k: str(v) for k, v in fields.items() if k in ("permissions", "permissions_detail") and v}


def power_off() -> None:
    """Last resort: stop the machine from inside (argument lists, no shell)."""
    argv = ["systemctl", "poweroff"] if shutil.which("systemctl") else ["shutdown", "-h", "now"]
    log.critical("event=power_off argv=%s", " ".join(argv))
    try:
        subprocess.run(argv, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        log.critical("event=power_off_failed argv=%s error=%s", " ".join(argv), err)


def delete_self(
    metadata: MetadataClient | None = None,
    compute_clients: compute.ComputeClients | None = None,
    tpu_clients: tpu.TpuClients | None = None,
    attempts: int = 6,
    max_wait_s: float = 30.0,
) -> bool:
    """Delete this machine and return True; if that fails for good, log why and power off (a
    group member stays up instead, see the module docstring) and return False."""
    compute, _ = _clouds()
    metadata = metadata or MetadataClient()
    deleter = SelfDeleter(metadata, compute_clients, tpu_clients, attempts=attempts, max_wait_s=max_wait_s)
    try:
        deleter.run()
        return True
    # API_ERRORS includes missing credentials, and an accepted delete that has not finished
    # while this machine still runs (the operation's wait timing out).
    except (MetadataError, SelfDeleteError, compute.GroupRefError, *API_ERRORS) as err:
        in_group = _in_group(metadata)
        log.critical(
            "event=self_delete_failed error_type=%s error=%s action=%s hint=%s",
            type(err).__name__,
            str(err).replace("\n", " "),
            "stay_up reason=a_group_recreates_a_stopped_member" if in_group else "power_off",
            "check the VM's service account roles and scopes (docs/CLOUD.md, IAM)",
        )
        if in_group:
            return False
    power_off()
    return False


def _in_group(metadata: MetadataClient) -> bool:
    try:
        return bool(metadata.attribute("created-by"))
    except (MetadataError, requests.RequestException):
        return False


def main(argv: list[str] | None = None) -> int:
    """`python -m fleet.selfdelete check|delete`, for startup/startup.sh.

    check: exit 3 (the reason on stdout) when a permission the delete needs is definitely not granted;
    else exit 0, printing `granted: KIND` or `unverified: KIND (why)` and saving it for the records.
    delete: exit 0 when the delete was accepted, 1 when it failed (after powering off, unless in a group)."""
    parser = argparse.ArgumentParser(prog="python -m fleet.selfdelete", description=main.__doc__)
    parser.add_argument("action", choices=("check", "delete"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    if args.action == "delete":
        return 0 if delete_self() else 1
    try:
        verdict = check_permissions(MetadataClient())
    except PermissionMissing as err:
        log.error("event=permission_check outcome=missing reason=%s", err)
        print(err)
        return 3
    except (MetadataError, SelfDeleteError, requests.RequestException) as err:
        # This machine cannot tell what it is; that says nothing about what it may do.
        verdict = PermissionVerdict("unknown", "unverified", f"cannot read this machine's identity: {err}")
    save_verdict(verdict)
    log.info("event=permission_check outcome=%s kind=%s detail=%s", verdict.outcome, verdict.kind, verdict.detail or "-")
    print(verdict.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())


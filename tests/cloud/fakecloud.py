"""Fake Compute Engine and Cloud TPU REST endpoints for the real client libraries.

One server answers both APIs: `/compute/v1/...` and `/v2/...` (Cloud TPU v2). Clients reach it
with `client_options={"api_endpoint": server.url}`, `AnonymousCredentials()` and
`transport="rest"`, or, in a subprocess, through FLEET_COMPUTE_ENDPOINT / FLEET_TPU_ENDPOINT.

It keeps the resources it is asked to make (templates, groups with their target size, instances,
TPU nodes, queued resources) so that later calls see them, and every request is recorded in
`requests` for the tests to assert on. Long-running operations are finished when returned:
a Compute Operation with status DONE (so `ExtendedOperation.result()` does not poll) and a
google.longrunning Operation with done=true and its response packed as an Any. The operation
GET endpoints the clients would poll answer DONE as well. Errors use each API's JSON error shape,
so the clients raise the matching google.api_core exception. Unknown calls answer 400 naming the
call (not 5xx, which clients retry), never a silent success.

It also answers the `gcloud compute` commands docs/CLOUD.md shows, through gcloud's
`api_endpoint_overrides/compute` and `.../tpu` (tests/gcloudcli.py): `regions describe`, `routers
create` and `routers nats create` (routers insert, get and patch), `networks subnets update
--enable-private-ip-google-access` (subnetworks.setPrivateIpGoogleAccess), and the TPU listings
(`tpus tpu-vm list`, `tpus queued-resources list`).

With `machines` set, a managed instance group's members are booted (tests/boot/fleet.py); with `tpu_hosts` set,
the hosts of each node a queued resource provisions are (tests/boot/tpu_fleet.py).
"""

from __future__ import annotations

import itertools
import json
import random
import re
import string
from typing import Protocol

from tests.cloud import apischema
from tests.cloud.fakehttp import FakeHTTPServer, Request, Response

COMPUTE = "/compute/v1/"
TPU = "/v2/"
CRM = "/v1/projects/"  # Cloud Resource Manager: testIamPermissions, getIamPolicy, getAncestry
CRM_V3 = "/v3/"  # Cloud Resource Manager v3: folders and organizations getIamPolicy
STORAGE = "/storage/v1/b/"  # bucket metadata and bucket IAM policy (objects are tests/fakegcs's)
# Which of Google's discovery documents (tests/cloud/apischema.py) each path prefix is checked against.
_APIS = ((COMPUTE, "compute.v1"), (TPU, "tpu.v2"), (CRM, "cloudresourcemanager.v1"), (CRM_V3, "cloudresourcemanager.v3"),
         (STORAGE, "storage.v1"))
_STATUS_NAMES = {400: "INVALID_ARGUMENT", 403: "PERMISSION_DENIED", 404: "NOT_FOUND", 409: "ALREADY_EXISTS",
                 412: "FAILED_PRECONDITION", 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}


#: The project number in the `created-by` attribute Compute Engine gives a group's members
#: (https://cloud.google.com/compute/docs/instance-groups/getting-info-about-migs#checking_if_a_vm_is_part_of_a_mig).
PROJECT_NUMBER = "123456789012"


class Machines(Protocol):
    """Whatever runs the instances a fake instance group makes (tests/boot/fleet.py boots each as a
    rehearsal machine). Called with the fake's lock held: start work, never wait for it."""

    def created(self, instance: str, resource: dict) -> None:
        """`instance` ("projects/P/zones/Z/instances/N") exists now: boot it from `resource`."""

    def deleted(self, instance: str) -> None:
        """`instance` was deleted through the API: shut it down."""


class TpuHosts(Protocol):
    """Whatever runs the hosts of the TPU nodes a fake queued resource makes (tests/boot/tpu_fleet.py
    boots each host as a rehearsal machine). Called with the fake's lock held: start work, never wait."""

    def node_created(self, node: str, resource: dict) -> None:
        """`node` ("projects/P/locations/Z/nodes/N") exists now, READY: boot one host per entry of its
        `networkEndpoints` from `resource`."""

    def node_deleted(self, node: str) -> None:
        """`node` is gone (deleted through the API, or its queued resource SUSPENDED): stop its hosts."""


class _ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class FakeCloud(FakeHTTPServer):
    def __init__(self) -> None:
        super().__init__()
        self.resources: dict[str, dict] = {}  # "projects/p/..." -> resource JSON
        self._ids = itertools.count(1)
        #: Permissions the caller holds on every project (testIamPermissions); None: all it asks for.
        self.held_permissions: set[str] | None = None
        self.project_policies: dict[str, dict] = {}  # project -> IAM policy (getIamPolicy)
        #: bucket -> {"location", "bindings", and optionally "locationType", "dataLocations"}
        self.buckets: dict[str, dict] = {}
        #: project -> its ancestors, nearest first, e.g. ["folders/12", "organizations/34"] (getAncestry)
        self.ancestry: dict[str, list[str]] = {}
        #: "folders/12" or "organizations/34" -> IAM policy; absent: 403, as for a caller without the permission
        self.resource_policies: dict[str, dict] = {}
        #: Answers of this fake that Google's schema refuses (tests/cloud/apischema.py); must stay empty.
        self.schema_breaks: list[str] = []
        #: When set, zonal instance groups keep members as a managed instance group does, and each
        #: member's start and end go to it: a group's insert or resize makes members from its template
        #: up to its target size, named `baseInstanceName-xxxx` (the API reference's
        #: instanceGroupManagers.baseInstanceName: a hyphen and four random characters appended);
        #: deleteInstances, a smaller size and the group's delete remove them; a member that stops by
        #: itself (`stopped`, as a preempted spot VM does) is recreated under its name when the group's
        #: defaultActionOnFailure is REPAIR (https://cloud.google.com/compute/docs/instance-groups/about-repairing-vms-in-a-mig).
        #: Without it, groups are a target size and nothing more.
        self.machines: Machines | None = None
        self._members: dict[str, list[str]] = {}  # group path -> its members' instance paths, oldest first
        self._names = random.Random(36)
        #: When set, each node a queued resource provisions is handed to it once READY, with a network of
        #: its own (`networkEndpoints` on 10.<n>.0.0/24, n counting nodes from 1), and each node that goes
        #: (a delete, a SUSPENDED or FAILED queued resource) is reported. Without it, nodes are records only.
        self.tpu_hosts: TpuHosts | None = None
        self._node_networks = itertools.count(1)

    # -- helpers for tests

    def calls(self, method: str | None = None, contains: str = "") -> list[Request]:
        """Recorded requests, minus the operation polls, optionally filtered."""
        with self.lock:
            return [
                r for r in self.requests
                if (method is None or r.method == method) and contains in r.path and "/operations/" not in r.path
            ]

    def mutations(self) -> list[tuple[str, str]]:
        """(method, path) of every recorded request that is not a GET."""
        return [(r.method, r.path) for r in self.calls() if r.method != "GET"]

    def add(self, path: str, resource: dict) -> None:
        with self.lock:
            self.resources[path] = resource

    def failure_response(self, status: int) -> Response:
        return self._error(_ApiError(status, f"injected failure {status}"), tpu=False)

    def members(self, group: str) -> list[str]:
        """The instance paths of `group`'s members (with `machines` set), oldest first."""
        with self.lock:
            return list(self._members.get(group, []))

    def stopped(self, instance: str) -> str | None:
        """`instance` stopped without a delete request (a preempted spot VM whose termination action
        is DELETE): it is gone, and its group, if it repairs, makes it again under the same name.
        Returns the group that recreated it, or None."""
        with self.lock:
            self.resources.pop(instance, None)
            for group, members in self._members.items():
                if instance in members:
                    policy = self.resources.get(group, {}).get("instanceLifecyclePolicy", {})
                    if policy.get("defaultActionOnFailure", "REPAIR") != "REPAIR":
                        members.remove(instance)
                        return None
                    self._make_member(group, instance.rsplit("/", 1)[1], replacing=instance)
                    return group
        return None

    # -- managed instance group members (with `machines`)

    def _template_of(self, group: str) -> dict:
        return self._template_of_body(self.resources[group])

    def _template_of_body(self, group: dict) -> dict:
        path = group["instanceTemplate"].split("/compute/v1/", 1)[-1]
        if path not in self.resources:
            raise _ApiError(404, f"The resource '{path}' was not found (the group's instanceTemplate)")
        return self.resources[path]

    def _fill(self, group: str) -> None:
        """Make members up to the group's target size, or remove the newest beyond it."""
        if self.machines is None:
            return
        if "/zones/" not in group:
            raise _ApiError(400, "the fake keeps members of zonal groups only")
        members = self._members.setdefault(group, [])
        resource = self.resources[group]
        while len(members) < resource["targetSize"]:
            taken = {m.rsplit("/", 1)[1] for ms in self._members.values() for m in ms}
            while True:
                suffix = "".join(self._names.choice(string.ascii_lowercase + string.digits) for _ in range(4))
                name = f"{resource.get('baseInstanceName') or resource['name']}-{suffix}"
                if name not in taken:
                    break
            self._make_member(group, name)
        while len(members) > resource["targetSize"]:
            self._remove_member(group, members[-1])

    def _make_member(self, group: str, name: str, replacing: str | None = None) -> None:
        project, zone, group_name = group.split("/")[1], group.split("/")[3], group.rsplit("/", 1)[1]
        properties = self._template_of(group).get("properties", {})
        path = f"projects/{project}/zones/{zone}/instances/{name}"
        created_by = f"projects/{PROJECT_NUMBER}/zones/{zone}/instanceGroupManagers/{group_name}"
        resource = {
            "kind": "compute#instance", "id": str(next(self._ids)), "name": name, "status": "RUNNING",
            "zone": f"projects/{project}/zones/{zone}",
            "machineType": f"projects/{project}/zones/{zone}/machineTypes/{properties.get('machineType', 'n2-standard-4')}",
            "scheduling": dict(properties.get("scheduling", {})),
            "labels": dict(properties.get("labels", {})),
            "metadata": {"items": [*properties.get("metadata", {}).get("items", []), {"key": "created-by", "value": created_by}]},
        }  # fmt: skip
        self.resources[path] = resource
        members = self._members.setdefault(group, [])
        if replacing is None:
            members.append(path)
        self.machines.created(path, resource)

    def _remove_member(self, group: str, instance: str) -> None:
        self._members[group].remove(instance)
        if self.resources.pop(instance, None) is not None and self.machines is not None:
            self.machines.deleted(instance)

    # -- dispatch

    def handle(self, request: Request) -> Response:
        try:
            checked = self._check_schema(request)
        except apischema.SchemaViolation as violation:
            return self._schema_error(request, violation)
        response = self._answer(request)
        if checked is not None and response.status == 200:
            api, method = checked
            try:
                api.check_response(method, json.loads(response.body))
            except AssertionError as broken:
                # A fault of the fake, not of the code under test: the `cloud` fixture fails the test.
                with self.lock:
                    self.schema_breaks.append(str(broken))
                return Response.json(500, {"error": {"code": 500, "message": str(broken), "status": "INTERNAL"}})
        return response

    def _answer(self, request: Request) -> Response:
        try:
            if request.path.startswith(COMPUTE):
                return self._compute(request, request.path[len(COMPUTE) :])
            if request.path.startswith(TPU):
                return self._tpu(request, request.path[len(TPU) :])
            if request.path.startswith(CRM):
                return self._resource_manager(request, request.path[len(CRM) :])
            if request.path.startswith(CRM_V3):
                return self._resource_policy(request, request.path[len(CRM_V3) :])
            if request.path.startswith(STORAGE):
                return self._bucket(request, request.path[len(STORAGE) :])
            raise _ApiError(404, f"no such API on the fake: {request.method} {request.path}")
        except _ApiError as err:
            return self._error(err, tpu=request.path.startswith(TPU))

    @staticmethod
    def _check_schema(request: Request) -> tuple[apischema.Api, apischema.Method] | None:
        """Refuse, as Google would, any request its published discovery document refuses (tests/cloud/apischema.py)."""
        for prefix, name in _APIS:
            if request.path.startswith(prefix):
                api = apischema.api(name)
                return api, api.check(request.method, request.path, request.query, request.body)
        return None

    @staticmethod
    def _schema_error(request: Request, violation: apischema.SchemaViolation) -> Response:
        payload = apischema.bad_request(violation)
        if request.path.startswith(COMPUTE) or request.path.startswith(STORAGE):
            # Compute Engine and Cloud Storage also answer the older `errors` list
            # (https://cloud.google.com/compute/docs/api/how-tos/api-requests-responses#handling_api_errors).
            payload["error"]["errors"] = [{"domain": "global", "reason": "invalid" if violation.status == 400 else "notFound",
                                           "message": str(violation)}]
        return Response.json(violation.status, payload)

    @staticmethod
    def _error(err: _ApiError, tpu: bool) -> Response:
        status_name = _STATUS_NAMES.get(err.status, "UNKNOWN")
        error = {"code": err.status, "message": str(err), "status": status_name}
        if not tpu:
            error["errors"] = [{"domain": "global", "reason": status_name.lower(), "message": str(err)}]
        return Response.json(err.status, {"error": error})

    @staticmethod
    def _unsupported(request: Request) -> _ApiError:
        return _ApiError(400, f"the fake does not emulate {request.method} {request.path}")

    # -- Compute Engine

    def _compute_operation(self, op_type: str, target: str, scope: str) -> Response:
        op_id = next(self._ids)
        name = f"operation-{op_id}"
        op = {
            "kind": "compute#operation",
            "id": str(op_id),
            "name": name,
            "operationType": op_type,
            "status": "DONE",
            "progress": 100,
            "targetLink": f"{COMPUTE}{target}",
            "selfLink": f"{COMPUTE}{scope}/operations/{name}",
        }
        if "/zones/" in scope:
            op["zone"] = scope.rsplit("/", 1)[-1]
        if "/regions/" in scope:
            op["region"] = scope.rsplit("/", 1)[-1]
        return Response.json(200, op)

    def _compute(self, request: Request, path: str) -> Response:
        method, body = request.method, request.body
        if method == "GET" and re.fullmatch(r"projects/[^/]+(/(?:regions|zones)/[^/]+)?", path):  # zones.get too
            with self.lock:
                if path not in self.resources:
                    raise _ApiError(404, f"The resource '{path}' was not found")
                return Response.json(200, self.resources[path])
        match = re.fullmatch(r"(projects/[^/]+/(?:global|zones/[^/]+|regions/[^/]+))/(.+)", path)
        if not match:
            raise self._unsupported(request)
        scope, rest = match.groups()
        with self.lock:
            served = self._compute_reads(method, scope, rest)
            if served is not None:
                return served
            if (re.fullmatch(r"operations/[^/]+", rest) and method == "GET") or (
                    re.fullmatch(r"operations/[^/]+/wait", rest) and method == "POST"):  # gcloud waits with .../wait
                return Response.json(200, {"kind": "compute#operation", "name": rest.split("/")[1], "status": "DONE"})
            if rest in ("instanceTemplates", "instanceGroupManagers", "routers") and method == "POST":
                target = f"{scope}/{rest}/{body['name']}"
                if target in self.resources:
                    raise _ApiError(409, f"The resource '{target}' already exists")
                resource = dict(body)
                if rest == "instanceGroupManagers":
                    resource["targetSize"] = int(body.get("targetSize", 0))
                    if self.machines is not None:
                        self._template_of_body(body)  # 404 before anything is made, as the API answers
                self.resources[target] = resource
                if rest == "instanceGroupManagers":
                    self._fill(target)
                return self._compute_operation("insert", target, scope)
            item = re.fullmatch(r"(instanceTemplates|instanceGroupManagers|instances|routers|subnetworks)/([^/]+)(?:/(\w+))?",
                                rest)
            if not item:
                raise self._unsupported(request)
            collection, name, verb = item.groups()
            target = f"{scope}/{collection}/{name}"
            if target not in self.resources:
                raise _ApiError(404, f"The resource '{target}' was not found")
            if verb is None and method == "GET":
                return Response.json(200, self.resources[target])
            if verb is None and method == "DELETE":
                if target in self._members:  # a group's delete takes its members along
                    for member in list(self._members[target]):
                        self._remove_member(target, member)
                    del self._members[target]
                del self.resources[target]
                for group, members in self._members.items():
                    if target in members:  # a member deleted by itself: its group makes a new one
                        members.remove(target)
                        if self.machines is not None:
                            self.machines.deleted(target)
                        self._fill(group)
                        break
                return self._compute_operation("delete", target, scope)
            if collection == "routers" and method == "PATCH" and verb is None:
                # routers.patch: the fields sent replace the router's (`gcloud compute routers nats create`
                # sends the router with its nats list grown by one).
                self.resources[target] = {**self.resources[target], **body}
                return self._compute_operation("patch", target, scope)
            if collection == "subnetworks" and method == "POST" and verb == "setPrivateIpGoogleAccess":
                self.resources[target]["privateIpGoogleAccess"] = bool(body.get("privateIpGoogleAccess"))
                return self._compute_operation("setPrivateIpGoogleAccess", target, scope)
            if collection == "instanceGroupManagers" and method == "POST" and verb == "listManagedInstances":
                # https://cloud.google.com/compute/docs/reference/rest/v1/instanceGroupManagers/listManagedInstances
                members = [{"instance": f"https://compute.googleapis.com/compute/v1/{m}", "instanceStatus": "RUNNING", "currentAction": "NONE",
                            "name": m.rsplit("/", 1)[-1]} for m in self._members.get(target, [])]
                return Response.json(200, {"managedInstances": members})
            if collection == "instanceGroupManagers" and method == "POST" and verb == "resize":
                self.resources[target]["targetSize"] = int(request.query["size"])
                self._fill(target)
                return self._compute_operation("compute.instanceGroupManagers.resize", target, scope)
            if collection == "instanceGroupManagers" and method == "POST" and verb == "deleteInstances":
                group = self.resources[target]
                group["targetSize"] = max(0, group["targetSize"] - len(body.get("instances", [])))
                for member in body.get("instances", []):
                    path = f"projects/{scope.split('/')[1]}/{member}"
                    if path in self._members.get(target, []):
                        self._remove_member(target, path)
                    else:
                        self.resources.pop(path, None)
                return self._compute_operation("compute.instanceGroupManagers.deleteInstances", target, scope)
        raise self._unsupported(request)

    # -- Cloud TPU v2

    def _lro(self, location: str, response: dict | None, type_name: str) -> Response:
        op = {"name": f"{location}/operations/operation-{next(self._ids)}", "done": True,
              "response": {"@type": f"type.googleapis.com/{type_name}", **(response or {})}}
        return Response.json(200, op)

    def _tpu(self, request: Request, path: str) -> Response:
        method, body, query = request.method, request.body, request.query
        match = re.fullmatch(r"(projects/[^/]+/locations/[^/]+)/(nodes|queuedResources|operations|acceleratorTypes)"
                             r"(?:/([^/:]+))?", path)
        if not match:
            raise self._unsupported(request)
        location, collection, name = match.groups()
        with self.lock:
            if collection == "acceleratorTypes" and method == "GET" and name is None:
                # https://cloud.google.com/tpu/docs/reference/rest/v2/projects.locations.acceleratorTypes/list
                key = f"{location}/acceleratorTypes/"
                items = [v for k, v in sorted(self.resources.items()) if k.startswith(key)]
                return Response.json(200, {"acceleratorTypes": items})
            if collection == "operations" and method == "GET" and name:
                return Response.json(200, {"name": path, "done": True,
                                           "response": {"@type": "type.googleapis.com/google.protobuf.Empty"}})
            if name is None and method == "GET":
                key = f"{location}/{collection}/"
                items = [v for k, v in sorted(self.resources.items()) if k.startswith(key) and "/" not in k[len(key):]]
                return Response.json(200, {collection: items})
            if name is None and method == "POST":
                resource_id = query.get("nodeId" if collection == "nodes" else "queuedResourceId")
                if not resource_id:
                    raise _ApiError(400, f"missing the {collection} id in the query")
                target = f"{location}/{collection}/{resource_id}"
                if target in self.resources:
                    raise _ApiError(409, f"{target} already exists")
                resource = {**body, "name": target}
                if collection == "nodes":
                    resource["state"] = "READY"
                    self.resources[target] = resource
                    return self._lro(location, resource, "google.cloud.tpu.v2.Node")
                resource["state"] = {"state": "ACTIVE"}
                self.resources[target] = resource
                for spec in body.get("tpu", {}).get("nodeSpec", []):
                    for node_id in queued_node_ids(spec):
                        node_name = f"{spec['parent']}/nodes/{node_id}"
                        subnet = next(self._node_networks) if self.tpu_hosts is not None else 0
                        self.resources[node_name] = {**spec.get("node", {}), "name": node_name, "state": "READY",
                                                     "queuedResource": target,
                                                     "networkEndpoints": network_endpoints(spec.get("node", {}), subnet)}
                        if self.tpu_hosts is not None:
                            self.tpu_hosts.node_created(node_name, self.resources[node_name])
                return self._lro(location, resource, "google.cloud.tpu.v2.QueuedResource")
            target = f"{location}/{collection}/{name}"
            if target not in self.resources:
                raise _ApiError(404, f"{target} not found")
            if method == "GET":
                return Response.json(200, self.resources[target])
            if method == "DELETE":
                if collection == "queuedResources":
                    owned = [k for k, v in self.resources.items() if v.get("queuedResource") == target]
                    if owned and query.get("force", "").lower() != "true":
                        raise _ApiError(400, f"{target} has nodes {owned}; delete them first or pass force=true")
                    for node_name in owned:
                        del self.resources[node_name]
                        self._node_gone(node_name)
                del self.resources[target]
                if collection == "nodes":
                    self._node_gone(target)
                return self._lro(location, None, "google.protobuf.Empty")
        raise self._unsupported(request)

    # -- reads the pre-flight makes: regions (quotas) and machine types

    def _compute_reads(self, method: str, scope: str, rest: str) -> Response | None:
        """regions.get (`projects/P/regions/R` with an empty rest is matched by the caller's regex
        as scope + rest), machineTypes.get, subnetworks.get and .list, served from `resources`."""
        if method != "GET":
            return None
        if rest == "subnetworks":
            key = f"{scope}/subnetworks/"
            items = [v for k, v in sorted(self.resources.items()) if k.startswith(key)]
            return Response.json(200, {"kind": "compute#subnetworkList", "items": items})
        if rest in ("instanceTemplates", "instanceGroupManagers", "machineTypes", "acceleratorTypes"):
            # instanceTemplates.list, instanceGroupManagers.list (zonal and regional), machineTypes.list and
            # acceleratorTypes.list: every item at once, no nextPageToken.
            key = f"{scope}/{rest}/"
            items = [v for k, v in sorted(self.resources.items()) if k.startswith(key) and "/" not in k[len(key):]]
            kind = {"instanceTemplates": "compute#instanceTemplateList",
                    "instanceGroupManagers": "compute#instanceGroupManagerList" if "/zones/" in scope
                    else "compute#regionInstanceGroupManagerList",
                    "machineTypes": "compute#machineTypeList", "acceleratorTypes": "compute#acceleratorTypeList"}[rest]
            return Response.json(200, {"kind": kind, "items": items})
        if re.fullmatch(r"(machineTypes|subnetworks|acceleratorTypes)/[^/]+", rest):
            target = f"{scope}/{rest}"
            if target not in self.resources:
                raise _ApiError(404, f"The resource '{target}' was not found")
            return Response.json(200, self.resources[target])
        return None

    def set_region(self, project: str, region: str, quotas: dict[str, tuple[float, float]]) -> None:
        """A region whose quotas are {metric: (limit, usage)}."""
        self.add(f"projects/{project}/regions/{region}", {
            "name": region, "status": "UP",
            "quotas": [{"metric": m, "limit": limit, "usage": usage} for m, (limit, usage) in quotas.items()],
        })

    # -- Cloud Resource Manager

    def _resource_manager(self, request: Request, path: str) -> Response:
        match = re.fullmatch(r"([^/:]+):(testIamPermissions|getIamPolicy|getAncestry)", path)
        if not match or request.method != "POST":
            raise self._unsupported(request)
        project, verb = match.groups()
        with self.lock:
            if verb == "testIamPermissions":
                asked = request.body.get("permissions", [])
                held = [p for p in asked if self.held_permissions is None or p in self.held_permissions]
                return Response.json(200, {"permissions": held} if held else {})
            if verb == "getAncestry":
                ancestors = [("project", project)] + [tuple(a.split("s/", 1)) for a in self.ancestry.get(project, [])]
                return Response.json(200, {"ancestor": [{"resourceId": {"type": t, "id": i}} for t, i in ancestors]})
            if project not in self.project_policies:
                raise _ApiError(403, f"The caller does not have permission resourcemanager.projects.getIamPolicy on {project}")
            return Response.json(200, self.project_policies[project])

    def _resource_policy(self, request: Request, path: str) -> Response:
        match = re.fullmatch(r"((?:folders|organizations)/[^/:]+):getIamPolicy", path)
        if not match or request.method != "POST":
            raise self._unsupported(request)
        with self.lock:
            if match.group(1) not in self.resource_policies:
                raise _ApiError(403, f"The caller does not have permission getIamPolicy on {match.group(1)}")
            return Response.json(200, self.resource_policies[match.group(1)])

    # -- Cloud Storage buckets (metadata and IAM only)

    def _bucket(self, request: Request, path: str) -> Response:
        match = re.fullmatch(r"([^/]+)(/iam)?", path)
        if not match or request.method != "GET":
            raise self._unsupported(request)
        name, iam = match.groups()
        with self.lock:
            if name not in self.buckets:
                raise _ApiError(404, f"bucket {name} not found")
            bucket = self.buckets[name]
            if iam:
                return Response.json(200, {"kind": "storage#policy", "resourceId": f"projects/_/buckets/{name}",
                                           "version": 1, "bindings": bucket.get("bindings", []), "etag": "CAE="})
            body = {"kind": "storage#bucket", "name": name, "id": name, "location": bucket["location"],
                    "locationType": bucket.get("locationType", "region")}
            if "dataLocations" in bucket:  # a configurable dual-region
                body["customPlacementConfig"] = {"dataLocations": bucket["dataLocations"]}
            return Response.json(200, body)

    # -- queued-resource state transitions

    def set_queued_resource_state(self, name: str, state: str) -> None:
        """Move a queued resource to `state` (ACTIVE, SUSPENDED, FAILED, ...). A spot TPU that is
        preempted leaves its queued resource SUSPENDED and its node gone
        (https://cloud.google.com/tpu/docs/queued-resources)."""
        with self.lock:
            self.resources[name]["state"] = {"state": state}
            if state in ("SUSPENDED", "FAILED"):
                for key in [k for k, v in self.resources.items() if v.get("queuedResource") == name]:
                    del self.resources[key]
                    self._node_gone(key)

    def _node_gone(self, node: str) -> None:
        if self.tpu_hosts is not None:
            self.tpu_hosts.node_deleted(node)

def queued_node_ids(node_spec: dict) -> list[str]:
    """The nodes one nodeSpec of a queued resource provisions: `nodeId`, or for a multislice
    `multisliceParams.nodeCount` nodes named `<nodeIdPrefix>-<i>` (the API's rule for multislice requests)."""
    params = node_spec.get("multisliceParams")
    if params is None:
        if "nodeId" not in node_spec:
            raise _ApiError(400, "nodeSpec needs nodeId or multisliceParams")
        return [node_spec["nodeId"]]
    if "nodeId" in node_spec:
        raise _ApiError(400, "nodeSpec has both nodeId and multisliceParams; give one")
    count = int(params.get("nodeCount", 0))
    if count <= 1:
        raise _ApiError(400, f"multisliceParams.nodeCount must be > 1, got {count}")
    return [f"{params['nodeIdPrefix']}-{i}" for i in range(count)]


def network_endpoints(node: dict, subnet: int = 0) -> list[dict]:
    """One endpoint per host, on 10.0.<subnet>.0/24: v2-v5p types count TensorCores (8 per host), v5e/v6e
    count chips (up to 8 on a single host, 4 per host in a multi-host slice)."""
    kind, _, size = node.get("acceleratorType", "v5litepod-1").rpartition("-")
    size = int(size)
    if kind in ("v5litepod", "v6e"):
        hosts = 1 if size <= 8 else size // 4
    else:
        hosts = max(1, size // 8)
    return [{"ipAddress": f"10.0.{subnet}.{i + 2}", "port": 8470} for i in range(hosts)]

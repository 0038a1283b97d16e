"""Compute Engine requests: instance templates, managed instance groups, and deleting one instance.

Builders return `compute_v1` request messages; `ComputeClients.send` sends one and waits for its
operation. The launch tools and self-deletion both go through here.
"""

from __future__ import annotations

import dataclasses
import re

import proto
from google.cloud import compute_v1

from fleet import gapi

ENDPOINT_ENV = "FLEET_COMPUTE_ENDPOINT"
OPERATION_TIMEOUT_S = 600


class GroupRefError(ValueError):
    """A `created-by` value that does not name an instance group manager."""


@dataclasses.dataclass(frozen=True)
class GroupRef:
    """A managed instance group, zonal (`scope == "zones"`) or regional (`scope == "regions"`)."""

    scope: str
    location: str
    name: str

    _PATTERN = re.compile(r"^projects/[^/]+/(zones|regions)/([^/]+)/instanceGroupManagers/([^/]+)$")

    @classmethod
    def parse(cls, created_by: str) -> "GroupRef":
        """Parse the `created-by` attribute GCE sets on every member of a managed instance group."""
        match = cls._PATTERN.match(created_by.strip())
        if not match:
            raise GroupRefError(
                f"created-by {created_by!r} does not look like "
                "'projects/P/zones/Z/instanceGroupManagers/G' or 'projects/P/regions/R/instanceGroupManagers/G'"
            )
        return cls(*match.groups())

    @property
    def regional(self) -> bool:
        return self.scope == "regions"


@dataclasses.dataclass
class ComputeClients:
    templates: compute_v1.InstanceTemplatesClient
    zonal_groups: compute_v1.InstanceGroupManagersClient
    regional_groups: compute_v1.RegionInstanceGroupManagersClient
    instances: compute_v1.InstancesClient

    @classmethod
    def connect(cls, **client_args) -> "ComputeClients":
        """Clients on Application Default Credentials, or on `client_args` (tests pass an endpoint and
        anonymous credentials), or on FLEET_COMPUTE_ENDPOINT when that is set."""
        args = client_args or gapi.client_args(ENDPOINT_ENV)
        return cls(
            templates=compute_v1.InstanceTemplatesClient(**args),
            zonal_groups=compute_v1.InstanceGroupManagersClient(**args),
            regional_groups=compute_v1.RegionInstanceGroupManagersClient(**args),
            instances=compute_v1.InstancesClient(**args),
        )

    def send(self, request: proto.Message, timeout_s: float = OPERATION_TIMEOUT_S) -> None:
        """Send one request and wait for its operation; API errors propagate as google.api_core exceptions."""
        client_name, method = _METHODS[type(request)]
        operation = getattr(getattr(self, client_name), method)(request=request)
        operation.result(timeout=timeout_s)


_METHODS: dict[type, tuple[str, str]] = {
    compute_v1.InsertInstanceTemplateRequest: ("templates", "insert"),
    compute_v1.DeleteInstanceTemplateRequest: ("templates", "delete"),
    compute_v1.InsertInstanceGroupManagerRequest: ("zonal_groups", "insert"),
    compute_v1.ResizeInstanceGroupManagerRequest: ("zonal_groups", "resize"),
    compute_v1.DeleteInstanceGroupManagerRequest: ("zonal_groups", "delete"),
    compute_v1.DeleteInstancesInstanceGroupManagerRequest: ("zonal_groups", "delete_instances"),
    compute_v1.InsertRegionInstanceGroupManagerRequest: ("regional_groups", "insert"),
    compute_v1.ResizeRegionInstanceGroupManagerRequest: ("regional_groups", "resize"),
    compute_v1.DeleteRegionInstanceGroupManagerRequest: ("regional_groups", "delete"),
    compute_v1.DeleteInstancesRegionInstanceGroupManagerRequest: ("regional_groups", "delete_instances"),
    compute_v1.DeleteInstanceRequest: ("instances", "delete"),
}


def _where(zone: str | None, region: str | None) -> None:
    if bool(zone) == bool(region):
        raise ValueError(f"give exactly one of zone or region for a managed instance group, got zone={zone!r} region={region!r}")


def insert_template(project: str, template: compute_v1.InstanceTemplate) -> compute_v1.InsertInstanceTemplateRequest:
    return compute_v1.InsertInstanceTemplateRequest(project=project, instance_template_resource=template)


def delete_template(project: str, name: str) -> compute_v1.DeleteInstanceTemplateRequest:
    return compute_v1.DeleteInstanceTemplateRequest(project=project, instance_template=name)


ON_FAILURE = ("REPAIR", "DO_NOTHING")


def insert_group(
    project: str,
    name: str,
    template: str,
    size: int,
    zone: str | None = None,
    region: str | None = None,
    on_failure: str = "REPAIR",
) -> proto.Message:
    """A managed instance group of `size` members made from the global instance template `template`.

    `on_failure` is instanceLifecyclePolicy.defaultActionOnFailure: REPAIR (the default) recreates
    a member that stops or fails, which is what brings preempted spot members back; DO_NOTHING
    leaves it (https://cloud.google.com/compute/docs/instance-groups/about-repairing-vms-in-a-mig,
    https://cloud.google.com/compute/docs/reference/rest/v1/instanceGroupManagers). forceUpdateOnRepair
    is YES either way, so a repaired member boots the group's current template (fixed roles or
    code), not the one that failed."""
    _where(zone, region)
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {', '.join(ON_FAILURE)}, got {on_failure!r}")
    group = compute_v1.InstanceGroupManager(
        name=name,
        base_instance_name=name,
        instance_template=f"projects/{project}/global/instanceTemplates/{template}",
        target_size=size,
        instance_lifecycle_policy=compute_v1.InstanceGroupManagerInstanceLifecyclePolicy(
            default_action_on_failure=on_failure, force_update_on_repair="YES"
        ),
    )
    if zone:
        return compute_v1.InsertInstanceGroupManagerRequest(project=project, zone=zone, instance_group_manager_resource=group)
    # A regional group rebalances across zones by deleting busy members; workers must not be
    # killed for symmetry, and a new template must not replace running members either.
    group.update_policy = compute_v1.InstanceGroupManagerUpdatePolicy(
        instance_redistribution_type="NONE", type_="OPPORTUNISTIC"
    )
    return compute_v1.InsertRegionInstanceGroupManagerRequest(
        project=project, region=region, instance_group_manager_resource=group
    )


def resize_group(project: str, name: str, size: int, zone: str | None = None, region: str | None = None) -> proto.Message:
    _where(zone, region)
    if zone:
        return compute_v1.ResizeInstanceGroupManagerRequest(project=project, zone=zone, instance_group_manager=name, size=size)
    return compute_v1.ResizeRegionInstanceGroupManagerRequest(
        project=project, region=region, instance_group_manager=name, size=size
    )


def delete_group(project: str, name: str, zone: str | None = None, region: str | None = None) -> proto.Message:
    _where(zone, region)
    if zone:
        return compute_v1.DeleteInstanceGroupManagerRequest(project=project, zone=zone, instance_group_manager=name)
    return compute_v1.DeleteRegionInstanceGroupManagerRequest(project=project, region=region, instance_group_manager=name)


def remove_group_member(project: str, group: GroupRef, zone: str, instance: str) -> proto.Message:
    """deleteInstances: the member goes and the group's target size drops by one, so it is not recreated.

    Validation errors are not skipped: a member the group does not know must fail loudly, since
    the caller would otherwise believe the machine is going away."""
    members = [f"zones/{zone}/instances/{instance}"]
    if group.regional:
        body = compute_v1.RegionInstanceGroupManagersDeleteInstancesRequest(instances=members)
        return compute_v1.DeleteInstancesRegionInstanceGroupManagerRequest(
            project=project,
            region=group.location,
            instance_group_manager=group.name,
            region_instance_group_managers_delete_instances_request_resource=body,
        )
    return compute_v1.DeleteInstancesInstanceGroupManagerRequest(
        project=project,
        zone=group.location,
        instance_group_manager=group.name,
        instance_group_managers_delete_instances_request_resource=compute_v1.InstanceGroupManagersDeleteInstancesRequest(
            instances=members
        ),
    )


def delete_instance(project: str, zone: str, instance: str) -> compute_v1.DeleteInstanceRequest:
    return compute_v1.DeleteInstanceRequest(project=project, zone=zone, instance=instance)

"""Cloud TPU requests: TPU VM nodes and queued resources (`google.cloud.tpu_v2`).

Spot capacity is asked for through queued resources: the request waits in line for capacity
instead of failing, and deleting the queued resource with `force=True` also deletes its node.
"""

from __future__ import annotations

import dataclasses

import proto
from google.cloud import tpu_v2

from fleet import gapi

ENDPOINT_ENV = "FLEET_TPU_ENDPOINT"
# A node's create operation ends when the node is READY, which takes minutes.
OPERATION_TIMEOUT_S = 1800


def location(project: str, zone: str) -> str:
    return f"projects/{project}/locations/{zone}"


@dataclasses.dataclass
class TpuClients:
    tpu: tpu_v2.TpuClient

    @classmethod
    def connect(cls, **client_args) -> "TpuClients":
        """A client on Application Default Credentials, or on `client_args`, or on FLEET_TPU_ENDPOINT."""
        args = client_args or gapi.client_args(ENDPOINT_ENV)
        return cls(tpu=tpu_v2.TpuClient(**args))

    def send(self, request: proto.Message, timeout_s: float = OPERATION_TIMEOUT_S) -> None:
        operation = getattr(self.tpu, _METHODS[type(request)])(request=request)
        operation.result(timeout=timeout_s)

    def get_node(self, name: str) -> tpu_v2.Node:
        return self.tpu.get_node(name=name)

    def list_nodes(self, project: str, zone: str) -> list[tpu_v2.Node]:
        return list(self.tpu.list_nodes(parent=location(project, zone)))

    def list_queued_resources(self, project: str, zone: str) -> list[tpu_v2.QueuedResource]:
        return list(self.tpu.list_queued_resources(parent=location(project, zone)))


_METHODS: dict[type, str] = {
    tpu_v2.CreateNodeRequest: "create_node",
    tpu_v2.DeleteNodeRequest: "delete_node",
    tpu_v2.CreateQueuedResourceRequest: "create_queued_resource",
    tpu_v2.DeleteQueuedResourceRequest: "delete_queued_resource",
}


def create_node(project: str, zone: str, node_id: str, node: tpu_v2.Node) -> tpu_v2.CreateNodeRequest:
    return tpu_v2.CreateNodeRequest(parent=location(project, zone), node_id=node_id, node=node)


def create_queued_resource(
    project: str, zone: str, queued_resource_id: str, queued_resource: tpu_v2.QueuedResource
) -> tpu_v2.CreateQueuedResourceRequest:
    return tpu_v2.CreateQueuedResourceRequest(
        parent=location(project, zone), queued_resource_id=queued_resource_id, queued_resource=queued_resource
    )


def delete_node(name: str) -> tpu_v2.DeleteNodeRequest:
    return tpu_v2.DeleteNodeRequest(name=name)


def delete_queued_resource(name: str) -> tpu_v2.DeleteQueuedResourceRequest:
    """force=True: delete the queued resource together with the node it provisioned."""
    return tpu_v2.DeleteQueuedResourceRequest(name=name, force=True)

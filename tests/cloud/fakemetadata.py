"""A fake GCE metadata server, reached through GCE_METADATA_HOST.

Serves `/computeMetadata/v1/<path>` from a flat dict of leaf paths to text values, as the real
one does: requests must carry `Metadata-Flavor: Google` (else 403) and answers carry it too;
leaves answer text (`alt=json` gives a JSON string); directories list their children, or with
`recursive=true` answer one JSON object (`alt=text` gives `key value` lines); every answer has an
ETag, and `wait_for_change=true` long-polls until the ETag differs from `last_etag` (or from the
one current when the request came) or `timeout_sec` passes. Tests change values with `set()`,
which wakes the long polls.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Mapping

from tests.cloud.fakehttp import FakeHTTPServer, Request, Response

PREFIX = "/computeMetadata/v1/"
FLAVOR = {"Metadata-Flavor": "Google"}


class FakeMetadata(FakeHTTPServer):
    def __init__(self, values: Mapping[str, str] | None = None):
        super().__init__()
        self.values: dict[str, str] = dict(values or {})
        self.changed = threading.Condition(self.lock)
        self.closing = False

    def set(self, path: str, value: str) -> None:
        with self.changed:
            self.values[path] = value
            self.changed.notify_all()

    def remove(self, path: str) -> None:
        with self.changed:
            self.values.pop(path, None)
            self.changed.notify_all()

    def stop(self) -> None:
        with self.changed:
            self.closing = True
            self.changed.notify_all()
        super().stop()

    def failure_response(self, status: int) -> Response:
        return Response(status, b"injected failure", {"Content-Type": "text/plain", **FLAVOR})

    # -- the metadata API

    def _subtree(self, path: str) -> dict[str, str]:
        return {k[len(path) :]: v for k, v in self.values.items() if k.startswith(path)}

    def _lookup(self, path: str, query: Mapping[str, str]) -> tuple[int, str, str]:
        """(status, content type, body) for `path` as the values stand now."""
        if path in self.values:
            if query.get("alt") == "json":
                return 200, "application/json", json.dumps(self.values[path])
            return 200, "text/plain", self.values[path]
        directory = path if path == "" or path.endswith("/") else path + "/"
        subtree = self._subtree(directory)
        if not subtree:
            return 404, "text/html", "not found"
        if query.get("recursive") == "true":
            if query.get("alt") == "text":
                return 200, "text/plain", "".join(f"{k} {v}\n" for k, v in sorted(subtree.items()))
            nested: dict = {}
            for key, value in subtree.items():
                node = nested
                *parents, leaf = key.split("/")
                for parent in parents:
                    node = node.setdefault(parent, {})
                node[leaf] = value
            return 200, "application/json", json.dumps(nested)
        children = sorted({k.split("/", 1)[0] + ("/" if "/" in k else "") for k in subtree})
        return 200, "text/plain", "".join(f"{c}\n" for c in children)

    @staticmethod
    def _etag(status: int, body: str) -> str:
        return hashlib.sha1(f"{status}:{body}".encode()).hexdigest()[:16]

    def handle(self, request: Request) -> Response:
        if request.headers.get("metadata-flavor") != "Google":
            return Response(403, b"Missing Metadata-Flavor:Google header.", {"Content-Type": "text/plain"})
        if request.method != "GET" or not request.path.startswith(PREFIX):
            return Response(404, b"not found", {"Content-Type": "text/plain", **FLAVOR})
        path = request.path[len(PREFIX) :]
        with self.changed:
            status, kind, body = self._lookup(path, request.query)
            etag = self._etag(status, body)
            if request.query.get("wait_for_change") == "true":
                target = request.query.get("last_etag") or etag
                deadline = time.monotonic() + float(request.query.get("timeout_sec", "300"))
                while etag == target and not self.closing and time.monotonic() < deadline:
                    self.changed.wait(timeout=max(0.0, deadline - time.monotonic()))
                    status, kind, body = self._lookup(path, request.query)
                    etag = self._etag(status, body)
        return Response(status, body.encode(), {"Content-Type": kind, "ETag": etag, **FLAVOR})


def gce_vm(project: str, zone: str, name: str, attributes: Mapping[str, str] | None = None) -> dict[str, str]:
    """The values a GCE VM's metadata server holds (the subset fleet reads)."""
    values = {
        "project/project-id": project,
        "project/numeric-project-id": "123456789012",
        "instance/name": name,
        "instance/hostname": f"{name}.{zone}.c.{project}.internal",
        "instance/zone": f"projects/123456789012/zones/{zone}",
        "instance/id": "4242424242424242",
        "instance/preempted": "FALSE",
        "instance/maintenance-event": "NONE",
    }
    values.update({f"instance/attributes/{k}": v for k, v in (attributes or {}).items()})
    return values


def tpu_vm(project: str, zone: str, node_id: str, attributes: Mapping[str, str] | None = None, hosts: int = 1) -> dict[str, str]:
    """A TPU VM worker: the VM is named t1v-n-..., the node's identity is in `tpu-env`."""
    tpu_env = "\n".join(
        [
            "ACCELERATOR_TYPE: 'v5litepod-8'",
            f"CONSUMER_PROJECT_ID: '{project}'",
            f"NODE_ID: '{node_id}'",
            "WORKER_ID: '0'",
            f"ZONE: '{zone}'",
        ]
    )
    endpoints = ",".join(f"w-{i}:{i}:10.0.0.{i + 2}" for i in range(hosts))
    attrs = {"tpu-env": tpu_env, "agent-worker-number": "0", "worker-network-endpoints": endpoints, **(attributes or {})}
    return gce_vm(project, zone, "t1v-n-5f1e2d3c-w-0", attrs)

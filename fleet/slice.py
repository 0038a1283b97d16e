"""This host's role in a multi-host TPU slice, from the TPU VM's metadata.

Every host of a multi-host slice (e.g. v4-16, v5litepod-16) runs the startup script and the
worker service. The TPU runtime tells each host who it is through instance attributes:

- `agent-worker-number`: this host's index in the slice, 0-based;
- `worker-network-endpoints`: one entry per host, sorted by that index, either
  `name:index:ip` (older images) or a bare address;
- `tpu-env`: `NODE_ID` names the slice (the TPU node); with `slices: K` each slice is its own
  queued resource and node (fleet/specs.py), so each is its own claimant.

Host 0 leads: it runs the claim loop and holds the lease; the others follow
(docs/PROTOCOL.md, "Slices"). The leader's JAX coordination service listens on
`COORDINATOR_PORT` at host 0's address, the same convention JAX's own Cloud TPU cluster
detection uses (the first worker endpoint). Sources: https://cloud.google.com/tpu/docs/system-architecture-tpu-vm
(hosts of a slice), https://cloud.google.com/tpu/docs/multislice-introduction (slices of a multislice),
https://cloud.google.com/tpu/docs/v5e (v5litepod-16 and larger are multi-host).
"""

from __future__ import annotations

import dataclasses

from fleet.metadata import MetadataClient
from fleet.selfdelete import parse_tpu_env

#: Port of the slice's JAX coordination service on host 0 (jax.distributed).
COORDINATOR_PORT = 8482


class SliceMetadataError(ValueError):
    """The TPU metadata describes no consistent slice; the message names the attribute."""


@dataclasses.dataclass(frozen=True)
class HostRole:
    slice_id: str
    hosts: int
    host_index: int
    coordinator: str  # ADDRESS:PORT of host 0

    @property
    def is_leader(self) -> bool:
        return self.host_index == 0

    def spawn_flags(self) -> list[str]:
        """spawn.py's options for this role (taskqueue/cli.py, "multi-host slice")."""
        return ["--slice-id", self.slice_id, "--slice-hosts", str(self.hosts), "--host-index", str(self.host_index),
                "--coordinator", self.coordinator]  # fmt: skip


def endpoint_addresses(value: str) -> list[str]:
    """`worker-network-endpoints` -> host addresses in worker order; both known formats."""
    addresses = []
    for entry in (part.strip() for part in value.split(",")):
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) == 1:
            addresses.append(parts[0])
        elif len(parts) == 3 and parts[2]:
            addresses.append(parts[2])
        else:
            raise SliceMetadataError(
                f"worker-network-endpoints: entry {entry!r} is neither 'name:index:ip' nor an address"
            )
    return addresses


def host_role(metadata: MetadataClient) -> HostRole | None:
    """This host's role, or None on a single-host machine (a VM, or a TPU VM with one worker)."""
    endpoints = metadata.attribute("worker-network-endpoints")
    if endpoints is None:
        return None
    addresses = endpoint_addresses(endpoints)
    if len(addresses) <= 1:
        return None
    number = metadata.attribute("agent-worker-number")
    if number is None or not number.strip().isdigit():
        raise SliceMetadataError(f"agent-worker-number is {number!r}: a multi-host slice host needs its index")
    index = int(number)
    if index >= len(addresses):
        raise SliceMetadataError(f"agent-worker-number {index} is past the {len(addresses)} worker-network-endpoints")
    env = parse_tpu_env(metadata.attribute("tpu-env") or "")
    slice_id = env.get("NODE_ID")
    if not slice_id:
        raise SliceMetadataError("tpu-env has no NODE_ID: cannot name this slice")
    return HostRole(slice_id=slice_id, hosts=len(addresses), host_index=index,
                    coordinator=f"{addresses[0]}:{COORDINATOR_PORT}")  # fmt: skip

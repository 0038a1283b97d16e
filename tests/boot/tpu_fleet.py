"""The TPU fleet, rehearsed: queued resources whose TPU VM hosts boot as rehearsal machines, a 4-host slice that
claims as one and runs one JAX program across its hosts' namespaces, a follower host killed mid-task, a
preempted slice replaced by `keep`, a preemption in the tail that `keep` leaves alone, and every slice
deleting its own queued resource once the queue drains.

    sudo .venv/bin/python -m tests.boot.tpu_fleet [--tasks 6] [--keep]
    make rehearsal-tpu                                 # the same, with its defaults

What is real and what stands in per host is the boot rehearsal's (tests/boot/rehearsal.py, docs/CLOUD.md "The
boot, rehearsed"): the cached Debian root filesystem on a disk of its own in namespaces of its own (network,
PID, mount), the real startup/startup.sh from its own metadata server at 169.254.169.254:80, the real gcloud
and uv, the code, wheels and interpreter in the bucket, spawn.py and consume.py on the tiny model. What this
adds is the TPU side (docs/CLOUD.md, "The TPU fleet, rehearsed"):

- the fake TPU API (tests/cloud/fakecloud.py, `tpu_hosts`) gives each node a queued resource provisions a
  network of its own (`networkEndpoints` on 10.0.<n>.0/24, one per host: 4 for a v5litepod-16, 1 for a
  v5litepod-8) and hands it to `TpuFleet`, which boots one rehearsal machine per endpoint. The hosts of a node
  share a switch: a network namespace the rehearsal makes, holding a bridge, with one veth pair per host (its
  `eth0` in the host's namespace, at its endpoint's address). No address is added outside those namespaces;
- each host's metadata is a TPU VM's (`tpu_vm_metadata`): `accelerator-type`, `agent-worker-number`,
  `worker-network-endpoints` (`name:index:ip` per host, comma-separated) and `tpu-env` (`KEY: 'value'` lines
  with NODE_ID, WORKER_ID, ZONE, ...), read as JAX's own Cloud TPU detection reads them (jax 0.10.2,
  jax/_src/clusters/cloud_tpu_cluster.py: `agent-worker-number` is the process id, each endpoint's third
  `:` field the host address, `tpu-env` lines split at the first ':' and stripped of quotes), with the node's
  metadata from the queued resource (startup-script, spawn-*, spawn-queued-resource) on top;
- one stand-in on purpose: `spawn-accelerator` is `cpu`, so the hosts install the CPU lock, which the
  rehearsal uploads itself (tools/upload_code.py --lock cpu --wheelhouse --python-mirror; the run files have
  `code.upload: false`). The tpu lock's wheelhouse is 521 MB (libtpu), a sync and install for each of the
  5 hosts, and libtpu finds no TPU here: JAX would run on CPU either way;
- a host's end is a guest shutdown: SIGTERM to the worker, up to SHUTDOWN_GRACE_S for it to exit, then every
  process in its namespaces is killed; a node deleted through the API shuts down SHUTDOWN_S later, and a
  preemption (https://cloud.google.com/tpu/docs/preemptible: "shut down", the node's state PREEMPTED; a spot
  queued resource goes SUSPENDED, https://cloud.google.com/tpu/docs/queued-resources) shuts every host down
  and moves the queued resource to SUSPENDED. A killed host (`kill`) gets no shutdown: SIGKILL of its
  namespaces.

The operator drives one run on one queue, each command a process of its own (`python -m gcs_spawner`): the run
`slice16` (templates/tpu.yaml as a v5litepod-16, count 1), and two v5litepod-8s added to it by `gcs-spawner add`
(`by_hand`, the one place a machine is made beside the run's fleet): `slice16-single8-0000` and
`slice16-nocode8-0000`. In order: `up slice16`, `up slice16` again (nothing new), `nocode8` added
with its host refused the code by its bucket listener (tests/boot/machines.refuse_code: a failed boot, which must
record why and delete its queued resource), a follower of the slice killed mid-task, the slice preempted once
its attempt has ended, `keep slice16 --once` (claimable tasks outnumber free workers: it replaces it), the single
host added, the new slice preempted in the tail (nothing claimable, the single host holding the last task,
the slice idle) and `keep slice16 --once` again (nothing made), the queue drained, the single host deleting its
queued resource, `status`, `down`, `merge`. Every host's record, read as it stops, is checked against how it
ended (tests/boot/records.py).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from tests.boot import records
from tests.boot.fleet import FleetRehearsal
from tests.boot.machines import (
    CLAIM, Command, MachineBoot, Machines, drive, first_event, log_time, table, wait,
)  # fmt: skip
from tests.boot.rehearsal import (
    _HOLDER, BUCKET, PROJECT, REPO, ZONE, Disk, Namespaces, RehearsalError, release_host, remove_in_background,
    standin_release,
)  # fmt: skip
from tests.cloud.fakecloud import PROJECT_NUMBER
from tests.cloud.fakemetadata import gce_vm

QUEUE = f"gs://{BUCKET}/jobs/tpu"
CODE = f"gs://{BUCKET}/code/tpu"
SLICE_RUN, SINGLE_RUN = "slice16", "single8"
SLICE_TYPE, SINGLE_TYPE = "v5litepod-16", "v5litepod-8"
#: The Compute Engine machine type under each v5e host (https://cloud.google.com/tpu/docs/v5e: a v5litepod-16's
#: 4 hosts are ct5lp-hightpu-4t, 4 chips each; a v5litepod-8 is one ct5lp-hightpu-8t).
HOST_MACHINE_TYPES = {SLICE_TYPE: "ct5lp-hightpu-4t", SINGLE_TYPE: "ct5lp-hightpu-8t"}
SHUTDOWN_S = 3.0  # from a delete request to the shutdown's start
SHUTDOWN_GRACE_S = 20.0  # from SIGTERM to the kill (a guest shutdown's stand-in)
HEARTBEAT_TIMEOUT_S = 10  # --slice-heartbeat-timeout: how long a slice takes to notice a silent host
#: The bound the docs state for a slice's attempt to end after a follower host is SIGKILLed: its peers' next
#: collective fails at once, and at worst the coordination service's heartbeat timeout, plus the leader's
#: release; 2 x the heartbeat timeout leaves a loaded machine its step.
ATTEMPT_END_BOUND_S = 2 * HEARTBEAT_TIMEOUT_S + 10
SERVICE_ACCOUNT = f"{PROJECT_NUMBER}-compute@developer.gserviceaccount.com"
#: A v5litepod-8 added beside the others whose host is refused the code (tests/boot/machines.refuse_code):
#: the failed boot, whose record must say why.
REFUSED_RUN = "nocode8"
BREAKAGES = 6  # the ways `breakages` breaks a report


def tpu_vm_metadata(node: dict, index: int, vm_name: str, cpu_lock: bool = True) -> dict[str, str]:
    """What host `index` of TPU node `node` (the API's resource) finds on its metadata server: a GCE VM's
    values (tests/cloud/fakemetadata.gce_vm) with the node's metadata and the attributes Cloud TPU sets."""
    node_id = node["name"].rsplit("/", 1)[1]
    accelerator = node["acceleratorType"]
    endpoints = node["networkEndpoints"]
    attributes = dict(node.get("metadata", {}))
    if cpu_lock:
        attributes["spawn-accelerator"] = "cpu"  # the rehearsal's stand-in: the CPU lock (module docstring)
    tpu_env = {"ACCELERATOR_TYPE": accelerator, "CONSUMER_PROJECT_ID": PROJECT, "NODE_ID": node_id,
               "WORKER_ID": str(index), "ZONE": ZONE, "TYPE": accelerator.split("-")[0].upper()}
    attributes.update({
        "accelerator-type": accelerator,
        "agent-worker-number": str(index),
        "worker-network-endpoints": ",".join(f"{vm_prefix(node_id)}-w-{i}:{i}:{e['ipAddress']}"
                                             for i, e in enumerate(endpoints)),
        "tpu-env": "".join(f"{key}: '{value}'\n" for key, value in tpu_env.items()),
    })
    values = gce_vm(PROJECT, ZONE, vm_name, attributes)
    values.update({
        "instance/machine-type": f"projects/{PROJECT_NUMBER}/machineTypes/{HOST_MACHINE_TYPES.get(accelerator, 'ct5lp-hightpu-4t')}",
        "instance/scheduling/provisioning-model": "SPOT",
        "instance/service-accounts/default/token": json.dumps(
            {"access_token": "ya29.rehearsal-token", "expires_in": 3599, "token_type": "Bearer"}),
    })
    return values


def vm_prefix(node_id: str) -> str:
    """A TPU VM's hosts are Compute Engine VMs named t1v-n-<hex>-w-<i>; the hex is the node's, made up here."""
    import hashlib

    return f"t1v-n-{hashlib.sha1(node_id.encode()).hexdigest()[:8]}"


class HostNamespaces(Namespaces):
    """A host's namespaces with a UTS namespace too, holding the TPU VM's hostname: JAX's CPU collectives (gloo)
    resolve the host's own name to find the address to listen on, and every host here would otherwise carry this
    machine's name, which resolves nowhere inside (found by this rehearsal: `gloo/transport/tcp/device.cc:99 rv
    == 0. -3 vs 0`, getaddrinfo's EAI_AGAIN)."""

    def __init__(self, lower: Path, disks: list[Disk], hostname: str):
        super().__init__(lower, disks)
        self.hostname = hostname

    def start(self) -> "HostNamespaces":
        self.holder = subprocess.Popen(
            ["unshare", "--net", "--mount", "--pid", "--uts", "--fork", "--propagation", "private",
             "bash", "-c", _HOLDER, "holder", str(self.lower), *(str(d.path) for d in self.disks)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "REAPER": sys.executable})
        if self.holder.stdout.readline().strip() != "ready":
            self.stop()
            raise RehearsalError(f"the host's namespaces did not come up: {self.holder.stderr.read()[-2000:]}")
        children = Path(f"/proc/{self.holder.pid}/task/{self.holder.pid}/children").read_text().split()
        self.pid = int(children[0])
        subprocess.run(["nsenter", "--target", str(self.pid), "--uts", "hostname", self.hostname], check=True,
                       capture_output=True, timeout=30)
        return self

    def run(self, disk: Disk, argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        command = ["nsenter", "--target", str(self.pid), "--net", "--mount", "--pid", "--uts", "--",
                   "chroot", str(disk.root), "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


class Switch:
    """A slice's network: a namespace of its own holding a bridge, one veth pair per host."""

    def __init__(self, name: str):
        self.name = name
        self.holder = subprocess.Popen(
            ["unshare", "--net", "bash", "-c", "set -euo pipefail; ip link set lo up; "
             "ip link add name br0 type bridge; ip link set br0 up; echo ready; exec sleep infinity"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if self.holder.stdout.readline().strip() != "ready":
            raise RehearsalError(f"the switch of {name} did not come up: {self.holder.stderr.read()[-1000:]}")
        self.links = 0

    def attach(self, host_pid: int, address: str) -> None:
        """A veth pair: one end on the bridge, the other `eth0` at `address`/24 in the namespace of `host_pid`."""
        port = f"p{self.links}"
        self.links += 1
        here = ["nsenter", "--target", str(self.holder.pid), "--net", "--"]
        there = ["nsenter", "--target", str(host_pid), "--net", "--"]
        for command in ([*here, "ip", "link", "add", "name", port, "type", "veth", "peer", "name", "eth0", "netns",
                         str(host_pid)],
                        [*here, "ip", "link", "set", port, "master", "br0", "up"],
                        [*there, "ip", "addr", "add", f"{address}/24", "dev", "eth0"],
                        [*there, "ip", "link", "set", "eth0", "up"]):
            result = subprocess.run(command, capture_output=True, text=True, timeout=30)
            if result.returncode != 0:
                raise RehearsalError(f"{' '.join(command)}: {result.stderr.strip()}")

    def stop(self) -> None:
        if self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait(timeout=30)


@dataclasses.dataclass
class Host(MachineBoot):
    """One TPU VM host of one node (tests/boot/machines.MachineBoot; its name is its record's, machines/<name>.json:
    the node id for worker 0, NODE-wN for the others, as startup.sh's machine_name)."""

    node: str = ""  # projects/P/locations/Z/nodes/N
    index: int = 0
    hosts: int = 1
    address: str = ""
    accelerator: str = ""

    @property
    def node_id(self) -> str:
        return self.node.rsplit("/", 1)[1]

    @property
    def record_name(self) -> str:
        return self.name

    def first_join(self) -> float | None:
        """When a follower first started its share of a task (its consumer joining the slice's program)."""
        return first_event(self.log(), r"event=follower_consumer_start")

    def tasks_run(self) -> int:
        """Tasks it ran to done (the leader's or a single host's `done`), or shares it ran (a follower)."""
        if self.hosts > 1 and self.index > 0:
            return len(re.findall(r"event=follower_consumer_exit task=\S+ exit_code=0", self.log()))
        return self.tasks_done()

    def ending(self) -> tuple[str, str | None] | None:
        """How this host ended, as tests/boot/records.py names it, and the reason it must give where the rehearsal
        expects one more exactly (None: the ending's own); None for an end no host should have."""
        if self.refused:
            return records.FAILED_BOOT, records.CODE_REFUSED
        if self.end.startswith("killed"):
            return records.KILLED, None
        if self.index > 0 and self.end in ("preempted", "self-deleted"):
            return records.FOLLOWER_STOPPED, None
        return {"preempted": (records.SHUT_DOWN, None), "self-deleted": (records.SELF_DELETED, None)}.get(self.end)


class TpuFleet(Machines):
    """Boots the hosts of every node the fake TPU API makes, and shuts them down when it goes. The hosts of a node
    whose id starts with REFUSED_RUN are refused the code: failed boots."""

    def __init__(self, world: "TpuRehearsal"):
        super().__init__(world)
        self.switches: dict[str, Switch] = {}

    @property
    def hosts(self) -> list[Host]:
        return self.boots

    # -- what the fake TPU API calls (its lock held: start work, never wait for it)

    def node_created(self, node: str, resource: dict) -> None:
        endpoints = resource["networkEndpoints"]
        node_id = node.rsplit("/", 1)[1]
        with self.lock:
            made = [Host(node_id if i == 0 else f"{node_id}-w{i}", Disk(self.world.workdir / f"{node_id}-w{i}"),
                         refused=node_id.startswith(f"{SLICE_RUN}-{REFUSED_RUN}-"), node=node, index=i, hosts=len(endpoints),
                         address=e["ipAddress"], accelerator=resource["acceleratorType"])
                    for i, e in enumerate(endpoints)]  # fmt: skip
            self.hosts.extend(made)
        threading.Thread(target=self._boot_node, args=(node, resource, made), name=f"boot-{node}", daemon=True).start()

    def node_deleted(self, node: str) -> None:
        threading.Timer(SHUTDOWN_S, self.shutdown_node, args=(node, "self-deleted")).start()

    # -- the hosts

    def of(self, node_id: str) -> list[Host]:
        with self.lock:
            return [h for h in self.hosts if h.node_id == node_id]

    def _boot_node(self, node: str, resource: dict, hosts: list[Host]) -> None:
        switch = Switch(node)
        with self.lock:
            self.switches[node] = switch
        for host in hosts:
            values = tpu_vm_metadata(resource, host.index, f"{vm_prefix(host.node_id)}-w-{host.index}")
            host.thread = threading.Thread(target=self._boot, args=(host, values, switch), daemon=True,
                                           name=f"boot-{host.record_name}")
            host.thread.start()

    def _boot(self, host: Host, values: dict[str, str], switch: Switch) -> None:
        def wire(machine: MachineBoot) -> None:
            switch.attach(machine.ns.pid, host.address)
            # The slice's hosts by name, as a VPC's internal DNS answers for its VMs
            # (https://cloud.google.com/compute/docs/internal-dns).
            peers = [entry.split(":") for entry in values["instance/attributes/worker-network-endpoints"].split(",")]
            with (machine.ns.view(machine.disk) / "etc/hosts").open("a") as names:
                names.writelines(f"{address} {peer}\n" for peer, _, address in peers)

        self.boot(host, values, lambda: HostNamespaces(self.world.lower, [host.disk], values["instance/name"]), wire)

    def _worker_pids(self, host: Host, program: bytes = b"spawn.py") -> list[int]:
        """`program`'s processes in the host's PID namespace (spawn.py: the worker and, on a slice, nothing else)."""
        if host.ns is None or not host.ns.pid:
            return []
        own = os.readlink(f"/proc/{host.ns.pid}/ns/pid")
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                # the program is the script run (argv[1]), not an argument: spawn.py's --consumer names consume.py
                if os.readlink(entry / "ns/pid") == own and len(argv) > 1 and argv[1].endswith(program):
                    pids.append(int(entry.name))
        return pids

    def signal_consumer(self, host: Host, signum: int) -> list[int]:
        """`signum` to the host's consume.py processes (SIGSTOP, SIGCONT: a long task's stand-in, its worker
        still heartbeating the lease); returns their pids (none: no consumer running)."""
        pids = self._worker_pids(host, b"consume.py")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        return pids

    def shutdown(self, host: Host, why: str) -> None:
        """A guest shutdown: SIGTERM to the worker, up to SHUTDOWN_GRACE_S for it to exit, then the kill."""
        if host.ended is not None:
            return
        for pid in self._worker_pids(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        while time.monotonic() < deadline and self._worker_pids(host):
            time.sleep(0.5)
        self.halt(host, why)

    def shutdown_node(self, node: str, why: str) -> None:
        with self.lock:
            hosts = [h for h in self.hosts if h.node == node and h.ended is None]
        threads = [threading.Thread(target=self.shutdown, args=(h, why), daemon=True) for h in hosts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def preempt(self, queued_resource: str) -> None:
        """Cloud TPU preempts a spot slice: every host shuts down, the queued resource goes SUSPENDED (its node gone)."""
        self.shutdown_node(next((h.node for h in self.hosts if h.node_id == queued_resource.rsplit("/", 1)[1]), ""),
                           "preempted")
        self.world.cloud.set_queued_resource_state(queued_resource, "SUSPENDED")

    def stop_all(self) -> None:
        super().stop_all()
        with self.lock:
            switches = list(self.switches.values())
        for switch in switches:
            switch.stop()


class TpuRehearsal(FleetRehearsal):
    """The operator's side (the fake bucket and TPU API on 127.0.0.1, the commands) and a `TpuFleet`."""

    def __init__(self, workdir: Path):
        super().__init__(workdir)
        self.queue = QUEUE
        self.tpus = TpuFleet(self)
        self.writes: collections.Counter[str] = collections.Counter()

    def start(self) -> "TpuRehearsal":
        super().start()
        self.cloud.machines = None
        self.cloud.tpu_hosts = self.tpus
        self.open_tpu_project()
        commit = self.gcs.storage.commit

        def counted(bucket: str, name: str, *args, **kwargs):  # every object write, to find one written twice
            stored = commit(bucket, name, *args, **kwargs)
            with self.gcs.storage.lock:
                self.writes[name] += 1
            return stored

        self.gcs.storage.commit = counted
        return self

    def stop(self, keep_disks: bool = False) -> None:
        self.tpus.stop_all()
        super().stop(keep_disks)
        if not keep_disks:
            remove_in_background([h.disk.path for h in self.tpus.hosts if h.disk.path.exists()])

    def open_tpu_project(self) -> None:
        """What the pre-flight reads for a TPU fleet: the service account's roles (roles/tpu.admin to delete its
        own queued resource), the bucket's region, the v5e quota."""
        cloud, member, region = self.cloud, f"serviceAccount:{SERVICE_ACCOUNT}", ZONE.rsplit("-", 1)[0]
        cloud.project_policies[PROJECT]["bindings"].append({"role": "roles/tpu.admin", "members": [member]})
        quotas = {metric: (limit, usage) for metric, limit, usage in (
            ("CPUS", 96, 0), ("N2_CPUS", 96, 0), ("TPU_LITE_PODSLICE_V5", 64, 0),
            ("PREEMPTIBLE_TPU_LITE_PODSLICE_V5", 64, 0))}
        cloud.set_region(PROJECT, region, quotas)
        cloud.resources[f"projects/{PROJECT}/regions/{region}"]["zones"] = [f"projects/{PROJECT}/zones/{ZONE}"]
        # The zone and the TPU types it offers, which up's check reads (gcs_spawner/checks.py: zones.get, the TPU
        # API's acceleratorTypes.get, https://cloud.google.com/tpu/docs/reference/rest/v2/projects.locations.acceleratorTypes/get).
        cloud.add(f"projects/{PROJECT}/zones/{ZONE}", {"kind": "compute#zone", "name": ZONE, "status": "UP",
                                                       "region": f"projects/{PROJECT}/regions/{region}"})
        for accelerator in (SLICE_TYPE, SINGLE_TYPE):
            name = f"projects/{PROJECT}/locations/{ZONE}/acceleratorTypes/{accelerator}"
            cloud.add(name, {"name": name, "type": accelerator})

    def operator(self, *argv: str, timeout: float = 1800) -> Command:
        """`gcs-spawner ARGV` in a process of its own; raises RehearsalError unless it exits 0."""
        return self.gcs_spawner(*argv, timeout=timeout)

    def upload_cpu_code(self) -> float:
        """The code with the CPU lock, its wheelhouse and the interpreter (module docstring: why the CPU lock)."""
        started = time.monotonic()
        result = subprocess.run([sys.executable, "tools/upload_code.py", CODE, "--lock", "cpu", "--wheelhouse",
                                 "--python-mirror"], cwd=REPO, env=self.operator_env(), capture_output=True,
                                text=True, timeout=1800)
        if result.returncode != 0:
            raise RehearsalError(f"tools/upload_code.py failed ({result.returncode}):\n{result.stderr[-4000:]}")
        return time.monotonic() - started


SPAWN_FLAGS = ["--on-empty", "delete", "--preemption-watch", "auto", "--lease-ttl", "30", "--max-attempts", "4",
               "--idle-timeout", "40", "--job-wait", "60", "--slice-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)]


def tpu_spec(name: str, accelerator: str) -> dict:
    """templates/tpu.yaml as the rehearsal's: `accelerator`, no external IP, short leases and waits."""
    spec = yaml.safe_load((REPO / "templates" / "tpu.yaml").read_text())
    spec.update({"name": name, "accelerator_type": accelerator, "external_ip": False, "spawn_flags": SPAWN_FLAGS})
    return spec


def write_run(directory: Path, job: Path, tasks: Path, model: Path) -> tuple[Path, dict[str, Path]]:
    """The slice's run file (a queue holds one run, and a run's spec one accelerator type), and the specs of the
    machines added to it (`by_hand`): the single host's and the refused one's, each a
    v5litepod-8."""
    run = {"name": SLICE_RUN, "project": PROJECT, "queue": QUEUE,
           "job": os.path.relpath(job, directory), "tasks": {"file": os.path.relpath(tasks, directory)},
           "model": {"source": os.path.relpath(model, directory)},
           "code": {"url": CODE, "upload": False, "environment": False},  # uploaded with the CPU lock (module docstring)
           "fleet": {"spec": tpu_spec(SLICE_RUN, SLICE_TYPE), "count": 1, "zones": [ZONE]}}  # fmt: skip
    path = directory / f"{SLICE_RUN}.yaml"
    path.write_text("# The TPU fleet rehearsal's run (tests/boot/tpu_fleet.py)\n"
                    + yaml.safe_dump(run, sort_keys=False, default_flow_style=None))
    specs = {}
    for name in (SINGLE_RUN, REFUSED_RUN):
        specs[name] = directory / f"{name}-spec.yaml"
        specs[name].write_text(yaml.safe_dump(tpu_spec(name, SINGLE_TYPE), sort_keys=False, default_flow_style=None))
    return path, specs


def by_hand(world: "TpuRehearsal", run_file: Path, spec: Path) -> Command:
    """One v5litepod-8 more on the run's queue, from `spec`: `gcs-spawner add RUN --spec SPEC --count 1`, the one
    place the rehearsal makes a machine beside its run's fleet (recorded in the run and labelled, so `down` deletes
    it; named RUN-SPEC-0000: `added`)."""
    return world.operator("add", str(run_file), "--spec", str(spec), "--count", "1", "--zone", ZONE, "--yes")


def added(name: str) -> str:
    """The node `by_hand` makes from the spec `name`: `gcs-spawner add` names it after the run and the spec."""
    return f"{SLICE_RUN}-{name}-0000"


# -- the rehearsal


@dataclasses.dataclass
class TpuReport:
    wall_s: float
    tasks: list[str]
    hosts: list[Host]
    commands: list[tuple[str, Command]]
    first_ups: dict[str, Command]
    second_ups: dict[str, Command]
    killed: str  # record name of the follower host killed
    killed_task: str
    killed_token: int  # the fencing token of the attempt the kill ended
    attempt_end_s: float | None  # from the kill to the leader's consumer exit
    lease_after_kill: dict  # the killed task's lease once the attempt ended
    keep_replace: Command
    keep_tail: Command
    tail_work: dict  # status when the tail preemption happened
    done: dict[str, dict]
    index: dict
    writes: dict[str, int]  # object name -> writes, for outputs and done markers
    qr_deletes: list[tuple[str, str]]  # (queued resource, which host's listener sent it)
    left: list[str]
    view: dict
    same_as_one_process: list[str]  # problems comparing a slice's task with a single-process run
    compared_task: str

    def lines(self) -> list[str]:
        out = [f"TPU fleet rehearsal: {len(self.hosts)} hosts of {len({h.node for h in self.hosts})} nodes, "
               f"{len(self.tasks)} tasks, wall {self.wall_s:.1f} s, load average {os.getloadavg()[0]:.1f} "
               f"({os.cpu_count()} cores)"]
        for label, command in self.commands:
            out.append(f"  {label}: {command.seconds:.1f} s")
        out.append(f"  follower {self.killed} killed mid-task {self.killed_task}: the slice's attempt ended "
                   + (f"{self.attempt_end_s:.1f} s later" if self.attempt_end_s is not None else "never")
                   + f" (bound {ATTEMPT_END_BOUND_S} s)")
        rows = []
        for host in self.hosts:
            at = host.first_claim() if host.index == 0 else host.first_join()
            rows.append([host.node_id, host.index, f"{at - host.started:.1f} s" if at and host.started else "-",
                         host.tasks_run(), host.requests, f"{host.end}: {host.final_record()}"])
        out += table(["slice", "host", "boot to first claim/join", "tasks run", "requests", "end: final record"], rows)
        out.append(f"  wall time {self.wall_s:.1f} s")
        return out


def rehearse(workdir: Path, tasks: int = 6, timeout: float = 1800) -> TpuReport:
    began = time.monotonic()
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    try:
        return _rehearse(workdir, tasks, timeout, began)
    finally:
        if emulator is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = emulator


def _holding(log: str) -> int:
    """Tasks a leader or single host holds now, from its log: claims less those settled."""
    return len(re.findall(CLAIM, log)) - len(re.findall(
        r"event=(?:done|released|task_settled|dead_letter) task=", log))


def _read_json(store, name: str) -> dict | None:
    from objectstore import NotFound

    try:
        return json.loads(store.read(name).data)
    except NotFound:
        return None


def _rehearse(workdir: Path, task_count: int, timeout: float, began: float) -> TpuReport:
    from objectstore import open_store
    from reporting.status import snapshot

    with TpuRehearsal(workdir) as world:
        release, listing = standin_release(world.lower)
        world.python_release, stop_release = release_host(release)
        world.python_downloads = listing
        commands: list[tuple[str, Command]] = []

        def command(label: str, *argv: str) -> Command:
            result = world.operator(*argv)
            commands.append((f"gcs-spawner {label}", result))
            return result

        def made_by_hand(name: str) -> Command:
            result = by_hand(world, run_file, specs[name])
            commands.append((f"gcs-spawner add {SLICE_RUN} --spec {name}", result))
            return result

        try:
            job, planned = world.stage_job("tpu", rows=4 * task_count, rows_per_task=8, files=2, upload_model=False)
            lines = planned.read_text().splitlines()
            if len(lines) != task_count:
                raise RehearsalError(f"make_tasks planned {len(lines)} tasks, not {task_count}")
            # batch_size is the slice's global batch: it divides by its 4 hosts.
            job_body = json.loads(job.read_text())
            job_body.update({"batch_size": 4, "shard_size": 4})
            job.write_text(json.dumps(job_body))
            tasks = [json.loads(line)["id"] for line in lines]
            run_file, specs = write_run(workdir, job, planned, job.parent / "model")
            os.environ["STORAGE_EMULATOR_HOST"] = world.gcs.url
            store = open_store(QUEUE)
            world.upload_cpu_code()
            fleet = world.tpus

            first_ups = {SLICE_RUN: command(f"up {SLICE_RUN}", "up", str(run_file), "--yes")}
            second_ups = {SLICE_RUN: command(f"up {SLICE_RUN} again", "up", str(run_file), "--yes")}
            # The failed boot: a v5litepod-8 whose host is refused the code, made while the slice boots.
            made_by_hand(REFUSED_RUN)
            slice_node = f"{SLICE_RUN}-0000"
            single_node = added(SINGLE_RUN)
            # A follower killed mid-task: its consumer has joined the slice's program (jax.distributed.initialize
            # returns once every host has connected) and built its engine.
            victim = wait("a follower of the slice computing its share", lambda: next(
                (h for h in fleet.of(slice_node) if h.index == 2 and "event=engine_ready" in h.log()),
                None), timeout)
            leader = fleet.of(slice_node)[0]
            killed_task, killed_token = re.findall(r"event=follower_consumer_start task=(\S+) token=(\d+)", victim.log())[-1]
            settled = re.compile(rf"event=(?:released|task_settled|dead_letter|done) task={re.escape(killed_task)} ")
            before = len([line for line in leader.log().splitlines() if settled.search(line)])
            killed_at = time.time()
            fleet.halt(victim, "killed (SIGKILL of its namespaces)")
            wait("the slice's attempt to end", lambda: len(
                [line for line in leader.log().splitlines() if settled.search(line)]) > before, ATTEMPT_END_BOUND_S * 3)
            ended = [log_time(line) for line in leader.log().splitlines() if settled.search(line)][before:]
            attempt_end_s = (ended[0] - killed_at) if ended and ended[0] else None
            lease_after_kill = _read_json(store, f"leases/{killed_task}.json") or {}
            # The slice, one host short, could only fail its next attempts: Cloud TPU preempts it now.
            qr_slice = f"projects/{PROJECT}/locations/{ZONE}/queuedResources/{slice_node}"
            fleet.preempt(qr_slice)
            # The tail: nothing claimable, the by-hand single host holding the last task, the run's slice idle (it
            # holds no lease, so its shutdown hands nothing back). The slice is preempted then, and its keeper
            # (gcs-spawner keep, the one keeper since issue 47; it never replaces an added machine) must not replace it:
            # no claimable task outnumbers the free workers. Which machine holds the last task is a race (a run
            # found the single host idle and the slice busy: no such tail), so the single host's first task is
            # made a long one: its consume.py is stopped (SIGSTOP; its worker still heartbeats the lease) until
            # the slice has run every other task and idles, and continued (SIGCONT) after the tail's keep.
            # The single host joins first, and the slice is replaced once the single host is stopped on its task:
            # made beside the new slice, the single host found nothing left to claim in a round at a load of 20
            # (the slice had booted first and run every task), and the rehearsal waited for a tail that never came.
            made_by_hand(SINGLE_RUN)
            single = wait(f"{single_node}'s host", lambda: next(iter(fleet.of(single_node)), None), timeout)
            paused = wait(f"{single_node} running a task", lambda: _holding(single.log()) > 0 and fleet.signal_consumer(
                single, signal.SIGSTOP), timeout)
            keep_replace = command(f"keep {SLICE_RUN} --once", "keep", str(run_file), "--once")
            replacement = f"{SLICE_RUN}-0001"

            def tail() -> tuple[Host, dict] | None:
                view = snapshot(store)
                slice_leader = next(iter(fleet.of(replacement)), None)
                if view.get("complete") or single.ended is not None or (slice_leader and slice_leader.ended):
                    raise RehearsalError(f"the queue drained (or a machine left) before a tail with the single host "
                                         f"working and the run's slice idle: {view}")
                if slice_leader is None or view["pending"] + view["stale"] or not view["leased"]:
                    return None
                if _holding(single.log()) > 0 and _holding(slice_leader.log()) == 0 \
                        and "event=worker_start" in slice_leader.log():
                    return slice_leader, view
                return None

            try:
                idle, tail_view = wait("the tail (nothing claimable, the single host working, the slice idle)", tail,
                                        timeout)
                fleet.preempt(f"projects/{PROJECT}/locations/{ZONE}/queuedResources/{idle.node_id}")
                keep_tail = command(f"keep {SLICE_RUN} --once (tail)", "keep", str(run_file), "--once")
            finally:
                for pid in paused:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
            wait("every task done and every host gone", lambda: (
                len(store.list_page("done/").entries) == len(tasks)
                and all(h.ended for h in fleet.hosts)), timeout)  # fmt: skip
            command("status", "status", str(run_file))
            view = snapshot(store)
            command(f"down {SLICE_RUN}", "down", str(run_file))
            command("merge", "merge", str(run_file))
        finally:
            stop_release()
        for host in fleet.hosts:
            host.count_requests()
        done = {e.name: _read_json(store, e.name) for e in store.list("done/")}
        index = _read_json(store, "index.json") or {}
        writes = {name: n for name, n in world.writes.items()
                  if name.startswith("jobs/tpu/") and ("/out/" in name or "/done/" in name)}
        qr_deletes = [(call.path.rsplit("/", 1)[1], call.headers.get("host", ""))
                      for call in world.cloud.calls("DELETE", "/queuedResources/")]
        left = sorted(k for k in world.cloud.resources if re.search(r"/(nodes|queuedResources)/", k))
        compared, problems = compare_with_one_process(world, store, done, workdir)
        return TpuReport(time.monotonic() - began, tasks, list(fleet.hosts), commands, first_ups, second_ups,
                         victim.record_name, killed_task, int(killed_token), attempt_end_s, lease_after_kill, keep_replace, keep_tail,
                         tail_view, done, index, writes, qr_deletes, left, view, problems, compared)


def safetensors_tensors(blob: bytes) -> dict[str, tuple[str, list[int], bytes]]:
    """Each tensor of a safetensors file as (dtype, shape, its bytes), read from the format's header (an 8-byte
    little-endian length, then JSON naming each tensor's dtype, shape and data_offsets): bf16 included, which
    numpy cannot load."""
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + length])
    base = 8 + length
    return {name: (entry["dtype"], entry["shape"], blob[base + entry["data_offsets"][0]:base + entry["data_offsets"][1]])
            for name, entry in header.items() if name != "__metadata__"}


def compare_with_one_process(world: TpuRehearsal, store, done: dict[str, dict], workdir: Path) -> tuple[str, list[str]]:
    """Run a task that a slice completed again, in one process with 4 CPU devices (the slice's 4 hosts have one
    each, so the automatic layout is the same), and compare every shard: the same names, and each tensor's bytes.
    Returns (the task, its problems)."""
    from taskqueue import layout

    by_slice = sorted(f"done/{task}.json" for h in world.tpus.hosts if h.hosts > 1 and h.index == 0
                      for task in re.findall(r"event=done task=(\S+)", h.log()))
    if not by_slice or by_slice[0] not in done:
        return "", [f"no task done by a slice to compare (the slices' leaders logged {by_slice})"]
    marker = done[by_slice[0]]
    task_id = marker["task"]
    prefix = layout.output_prefix(task_id, int(marker["fencing_token"]))
    scratch = workdir / f"one-process-{task_id}"
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "job.json").write_bytes(store.read(layout.JOB).data)
    (scratch / "task.json").write_bytes(store.read(layout.task_object(task_id)).data)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPAWN_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4", PYTHONUNBUFFERED="1",
               STORAGE_EMULATOR_HOST=world.gcs.url)
    result = subprocess.run([sys.executable, "consume.py", "--job-file", str(scratch / "job.json"), "--task-file",
                             str(scratch / "task.json"), "--output", str(scratch / "out"), "--progress-file",
                             str(scratch / "progress.jsonl")], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=900)
    if result.returncode != 0:
        return task_id, [f"the single-process run of {task_id} exited {result.returncode}: {result.stderr[-2000:]}"]
    local = {str(p.relative_to(scratch / "out")): p.read_bytes() for p in (scratch / "out").rglob("*")
             if p.is_file() and p.suffix == ".safetensors"}
    remote = {e.name[len(prefix) + 1:]: store.read(e.name).data for e in store.list(prefix + "/")
              if e.name.endswith(".safetensors")}
    problems = []
    if not local or sorted(local) != sorted(remote):
        problems.append(f"{task_id}: the slice wrote shards {sorted(remote)}, one process {sorted(local)}")
    for name in sorted(set(local) & set(remote)):
        mine, theirs = safetensors_tensors(local[name]), safetensors_tensors(remote[name])
        if sorted(mine) != sorted(theirs):
            problems.append(f"{task_id} {name}: tensors {sorted(theirs)} from the slice, {sorted(mine)} from one process")
            continue
        differ = [key for key in mine if mine[key] != theirs[key]]
        if differ:
            problems.append(f"{task_id} {name}: tensors {differ} differ from one process's (dtype, shape or bytes)")
    return task_id, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.boot.tpu_fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=6, help="tasks of 8 rows (default 6)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (disks, consoles, logs)")
    args = parser.parse_args(argv)
    return drive("TPU fleet rehearsal", args.keep, lambda workdir: rehearse(workdir, args.tasks), check_and_break)


def check_and_break(report: TpuReport) -> list[str]:
    """`check`'s problems, then the checks tried against the report broken BREAKAGES ways: each not caught is one."""
    uncaught = breakages(report)
    print(f"checks tried against the report broken {BREAKAGES} ways: {BREAKAGES - len(uncaught)} caught"
          + (f"; not caught: {uncaught}" if uncaught else ""))
    return check(report) + [f"the checks did not catch {what}" for what in uncaught]


def check(report: TpuReport) -> list[str]:
    """What must be true of the TPU fleet's life (issue 43); each failure as a line (none: all held)."""
    problems = []
    hosts = report.hosts
    expected = {f"done/{t}.json" for t in report.tasks}
    if set(report.done) != expected:
        problems.append(f"done markers {sorted(report.done)} are not one per task {sorted(expected)}")
    runs_to_done = sum(h.tasks_run() for h in hosts if h.index == 0)
    if runs_to_done != len(report.tasks):
        problems.append(f"the leaders and single hosts ran {runs_to_done} tasks to done, not {len(report.tasks)}")
    totals = report.index.get("totals", {})
    if totals.get("tasks") != len(report.tasks) or {s["task"] for s in report.index.get("shards", [])} != set(report.tasks):
        problems.append(f"the merged index is not complete: totals {totals}")
    twice = {name: n for name, n in report.writes.items() if n > 1}
    if twice or not report.writes:
        problems.append(f"outputs or done markers written more than once: {twice}" if twice else "no output was written")
    # The nodes: exactly those up and keep asked for, each host booted from its own endpoint.
    nodes = sorted({h.node_id for h in hosts})
    if nodes != sorted([added(REFUSED_RUN), added(SINGLE_RUN), f"{SLICE_RUN}-0000", f"{SLICE_RUN}-0001"]):
        problems.append(f"hosts booted for nodes {nodes}: the one up made, the one keep made and the two added "
                        "expected")
    for node in nodes:
        members = [h for h in hosts if h.node_id == node]
        want = 4 if node in (f"{SLICE_RUN}-0000", f"{SLICE_RUN}-0001") else 1
        if sorted(h.index for h in members) != list(range(want)) or len({h.address for h in members}) != want:
            problems.append(f"{node} booted hosts {[(h.index, h.address) for h in members]}, not {want} at addresses of their own")
    # Host 0 claims; every host of a slice computes its share of each task its leader ran to done.
    for host in hosts:
        claims = len(re.findall(CLAIM, host.log()))
        if host.index > 0 and claims:
            problems.append(f"follower {host.record_name} claimed {claims} tasks: only host 0 of a slice claims")
    for leader in (h for h in hosts if h.hosts > 1 and h.index == 0):
        finished = re.findall(r"event=done task=(\S+)", leader.log())
        for follower in (h for h in hosts if h.node == leader.node and h.index > 0 and not h.end.startswith("killed")):
            shares = set(re.findall(r"event=follower_consumer_exit task=(\S+) exit_code=0", follower.log()))
            if not set(finished) <= shares:
                problems.append(f"{follower.record_name} did not compute its share of {sorted(set(finished) - shares)}, "
                                f"which its leader ran to done")
    if not any(re.search(r"event=done task=", h.log()) for h in hosts if h.hosts > 1 and h.index == 0):
        problems.append("no slice ran a task to done")
    if not report.compared_task or report.same_as_one_process:
        problems.append(f"a slice's shards against one process: {report.same_as_one_process}")
    # The killed follower: the attempt ends within the bound, the lease is let go, the task done on a retry.
    if report.attempt_end_s is None or report.attempt_end_s > ATTEMPT_END_BOUND_S:
        problems.append(f"the slice's attempt ended {report.attempt_end_s} s after {report.killed} was killed "
                        f"(bound {ATTEMPT_END_BOUND_S} s)")
    lease = report.lease_after_kill
    if lease.get("state") == "held" and int(lease.get("fencing_token", lease.get("token", 0)) or 0) == report.killed_token:
        problems.append(f"the lease of {report.killed_task} was still held by the killed attempt: {lease}")
    marker = report.done.get(f"done/{report.killed_task}.json") or {}
    if not marker or int(marker.get("fencing_token") or 0) == report.killed_token:
        problems.append(f"{report.killed_task} was not completed on a retry after the kill: its done marker {marker}")
    # The keeper: a replacement while claimable tasks outnumber free workers, none in the tail.
    [replace] = report.keep_replace.events("keeper_step") or [{}]
    if (replace.get("deleted"), replace.get("created")) != ("1", "1") or int(replace.get("claimable", 0)) < 1 \
            or len(report.keep_replace.creates()) != 1:
        problems.append(f"keep after the slice's preemption stepped {replace} and sent {report.keep_replace.creates()}: "
                        "it should delete the suspended queued resource and make one, claimable tasks outnumbering "
                        "free workers")
    [tail] = report.keep_tail.events("keeper_step") or [{}]
    if (tail.get("claimable"), tail.get("deleted"), tail.get("created")) != ("0", "1", "0") or report.keep_tail.creates():
        problems.append(f"keep in the tail stepped {tail} and sent {report.keep_tail.creates()}: it should delete the "
                        "suspended queued resource and make nothing")
    # up twice: the first made the run's queued resource, the second nothing.
    for name, first in report.first_ups.items():
        summary = re.search(r"\((\d+) resources? created now, (\d+) there already\)", first.stdout)
        if not summary or summary.groups() != ("1", "0") or [p.rsplit("/", 1)[1] for _, p in first.creates()] != [
                "queuedResources"]:
            problems.append(f"the first up of {name} said {summary.group(0) if summary else first.stdout[-300:]!r} "
                            f"and sent {first.creates()}: its one queued resource expected")
    for name, again in report.second_ups.items():
        summary = re.search(r"\((\d+) resources? created now, (\d+) there already\)", again.stdout)
        if again.created() or again.creates() or not summary or summary.groups() != ("0", "1"):
            problems.append(f"the second up of {name} created {again.created()}, sent {again.creates()}, said "
                            f"{summary.group(0) if summary else again.stdout[-300:]!r}: it should make nothing")
    # Self-deletion: the machine alive when the queue drained (the single host, a one-host slice) deletes its queued
    # resource once, from host 0; so does a failed boot. Only the hosts' deletes count: `down` later sends its own
    # for every resource its run records (the added v5litepod-8s too), answered 404 once a host has deleted it.
    listeners = {_address(h) for h in hosts}
    drained = [h for h in hosts if h.index == 0 and h.end == "self-deleted"]
    if not [h for h in drained if not h.refused]:
        problems.append("no slice deleted itself when the queue drained")
    for leader in drained:
        sent = [via for qr, via in report.qr_deletes if qr == leader.node_id and via in listeners]
        own = _address(leader)
        if sent != [own]:
            problems.append(f"{leader.node_id}'s queued resource was deleted through {sent}, not once from its host 0 ({own})")
    # Every host's final record, read as it stopped, says how it ended (tests/boot/records.py): a self-deleted host 0
    # `deleting` (queue drained or idle), a host 0 shut down by a preemption `exited` (stopped (SIGTERM)), a follower
    # of either `exited` (follower stopped, leader_exit or idle), the killed follower its last `idle`, the refused
    # host `failed` naming the code sync and the refusal.
    endings, odd = [], []
    for host in hosts:
        how = host.ending()
        if how is None:
            odd.append(f"{host.record_name} ({host.end!r})")
            continue
        endings.append(records.Ending(host.record_name, 1, how[0], host.record, host.started, host.ended or time.time(),
                                      how[1]))
    if odd:
        problems.append(f"hosts that ended otherwise than by a delete, a preemption, the kill or a failed boot: {odd}")
    problems += records.problems(endings)
    if sum(h.refused for h in hosts) != 1 or any(h.first_claim() for h in hosts if h.refused):
        problems.append(f"failed boots {[(h.record_name, h.end, h.final_record()) for h in hosts if h.refused]}: "
                        f"one expected ({REFUSED_RUN}), claiming nothing")
    if report.left:
        problems.append(f"down left {report.left}")
    if not report.view.get("complete"):
        problems.append("status does not say complete")
    return problems


def _address(host: Host) -> str:
    """host:port of the cloud APIs' listener a host's requests go through ("?" for a host that has none)."""
    return host.api.url.split("//", 1)[1] if host.api else "?"


def breakages(report: TpuReport) -> list[str]:
    """The checks, tried against the report broken in the ways issue 43 names (and two of issue 48's): each breakage
    must fail `check`. Returns the breakages that did not (none: every one was caught)."""
    again = report.second_ups[SLICE_RUN]
    created_again = dataclasses.replace(
        again, stdout=again.stdout.replace("(0 resources created now, 1 there already)",
                                           "(1 resource created now, 1 there already)"),
        mutations=[*again.mutations, ("POST", f"/v2/projects/{PROJECT}/locations/{ZONE}/queuedResources")])
    name = next(iter(report.writes), "")

    def with_record(pick, record) -> TpuReport:
        """The report with the record of the first host `pick` accepts replaced by `record(host)`; the report
        unchanged (so the breakage counts as not caught) where no host is such."""
        at = next((i for i, h in enumerate(report.hosts) if pick(h)), None)
        if at is None:
            return report
        hosts = list(report.hosts)
        hosts[at] = dataclasses.replace(hosts[at], record=record(hosts[at]))
        return dataclasses.replace(report, hosts=hosts)

    drained = lambda h: h.end == "self-deleted" and not h.refused and h.index == 0  # noqa: E731
    broken = {
        "a host that never wrote its final record": with_record(lambda h: h.record is not None, lambda h: None),
        "a self-deleted host whose last record is a stale idle": with_record(
            drained, lambda h: {**(h.record or {}), "state": "idle", "reason": ""}),
        "a failed boot whose record does not say why": with_record(
            lambda h: h.refused, lambda h: {**(h.record or {}), "reason": "code_sync_failed: exit 1 at line 564"}),
        "a second up that creates again": dataclasses.replace(report, second_ups={SLICE_RUN: created_again}),
        "an output written twice": dataclasses.replace(report, writes={**report.writes, name: 2}),
        "a task without its done marker": dataclasses.replace(
            report, done={k: v for k, v in report.done.items() if k != f"done/{report.tasks[0]}.json"}),
    }
    found = set(check(report))
    uncaught = [what for what, bad in broken.items() if not set(check(bad)) - found]
    for what in uncaught:  # what the broken report's hosts were, to see why
        print(f"not caught: {what}: {[(h.record_name, h.refused, h.end, h.final_record()) for h in broken[what].hosts]}")
    return uncaught


if __name__ == "__main__":
    sys.exit(main())

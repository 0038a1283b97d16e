"""The first boot, rehearsed: a stock Debian machine with no network but its link to the (fake) Google
APIs boots the real startup/startup.sh from its metadata, syncs the code that the real
tools/upload_code.py put in the bucket through the real gcloud, installs uv, the interpreter and the
locked wheels from the bucket, and runs spawn.py and consume.py on a task until it deletes itself.

    .venv/bin/python -m tests.boot.rehearsal [--warm]     # one boot (and a reboot), phases printed

The pieces, and where each differs from a GCE VM (docs/CLOUD.md, "The boot, rehearsed"):
- the disk: an overlay on a cached root filesystem of Debian 12 minbase + curl + python3
  (tests/boot/rootfs.py), with this machine's Google Cloud CLI bind-mounted read-only;
- the network: a network namespace with loopback only (`unshare --net`), so the package index and
  everything else is unreachable; the fake metadata server listens on the metadata server's own
  address (169.254.169.254:80, named metadata.google.internal in /etc/hosts as on GCE), the fake GCS
  and Compute/TPU/Resource Manager servers on 127.0.0.1 inside it. This process's threads open those
  sockets inside the namespace (setns), so the tests read the fakes' state directly; the uploader
  (a developer's machine, with the package index) reaches the same bucket through a second listener
  outside it;
- the machine's own processes: a PID and mount namespace (everything in it dies with it) and a chroot;
  its /sys/class holds only the DMI product name a Compute Engine VM's firmware reports;
- what stands in: systemd (tests/boot/image/systemctl: a chroot has no init), the guest agent's
  startup-script runner (tests/boot/image/google-startup-script), gcloud's credentials (its
  configuration has credentials off and the endpoints overridden), the Python clients' endpoints
  (STORAGE_EMULATOR_HOST, FLEET_*_ENDPOINT in the machine's environment), and the interpreter archive
  (tests/boot/standin_python.py: the image's own CPython in python-build-standalone's layout).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tests.boot import rootfs, standin_python
from tests.cloud.fakecloud import FakeCloud
from tests.cloud.fakemetadata import FakeMetadata, gce_vm
from tests.fakegcs.server import FakeGCS
from tests.gcloudcli import write_config

REPO = Path(__file__).resolve().parents[2]
IMAGE = Path(__file__).resolve().parent / "image"
METADATA_ADDRESS = ("169.254.169.254", 80)
PROJECT, ZONE, GROUP = "rehearsal-project", "us-central1-a", "spawn-worker"
BUCKET = "rehearsal-bucket"
MACHINE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TOKEN = "ya29.rehearsal-token"
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


class RehearsalError(Exception):
    """The rehearsal could not be set up or a step did not finish; the message names which."""


def _in_netns(pid: int, action: Callable[[], T]) -> T:
    """Run `action` on a thread that has joined the network namespace of process `pid`: sockets it
    opens (and threads it starts) live in that namespace, whoever uses them later."""
    libc = ctypes.CDLL(None, use_errno=True)
    outcome: dict[str, Any] = {}

    def run() -> None:
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                outcome["error"] = OSError(ctypes.get_errno(), "setns into the machine's network namespace")
                return
            outcome["value"] = action()
        except Exception as err:  # handed to the caller's thread below
            outcome["error"] = err
        finally:
            os.close(fd)

    thread = threading.Thread(target=run, name="netns")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# The namespaces' first process: loopback up, the metadata address on it, the disks mounted, then
# init's one duty (reaping orphans) until it is killed, which ends every process in the namespaces.
_HOLDER = r"""
set -euo pipefail
ip link set lo up
ip addr add 169.254.169.254/32 dev lo
lower="$1"; shift
for disk in "$@"; do
  mkdir -p "$disk/upper" "$disk/work" "$disk/merged"
  mount -t overlay overlay -o "lowerdir=$lower,upperdir=$disk/upper,workdir=$disk/work" "$disk/merged"
  mount -t proc proc "$disk/merged/proc"
  mount --rbind /dev "$disk/merged/dev"
  mount --rbind /sys "$disk/merged/sys"
  # The VM's firmware: fleet.machines.maybe_on_gce reads the DMI product name, as Google documents
  # for detecting Compute Engine; this machine's /sys/class says otherwise (or has no DMI at all).
  mount -t tmpfs tmpfs "$disk/merged/sys/class"
  mkdir -p "$disk/merged/sys/class/dmi/id"
  echo "Google Compute Engine" >"$disk/merged/sys/class/dmi/id/product_name"
  mount -t tmpfs tmpfs "$disk/merged/tmp"
  mount -t tmpfs tmpfs "$disk/merged/run"
  mount --bind /usr/lib/google-cloud-sdk "$disk/merged/usr/lib/google-cloud-sdk"
  mount -o remount,bind,ro "$disk/merged/usr/lib/google-cloud-sdk"
done
echo ready
exec "$REAPER" -c 'import os, time
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.2)'
"""


@dataclasses.dataclass
class Disk:
    """One machine's disk: an overlay whose lower layer is the cached root filesystem."""

    path: Path

    @property
    def root(self) -> Path:
        return self.path / "merged"


class Namespaces:
    """A network (loopback only), mount and PID namespace, held by one process and its disks."""

    def __init__(self, lower: Path, disks: list[Disk]):
        self.lower, self.disks = lower, disks
        self.holder: subprocess.Popen | None = None
        self.pid = 0

    def start(self) -> "Namespaces":
        for tool in ("unshare", "nsenter", "ip", "chroot"):
            if shutil.which(tool) is None:
                raise RehearsalError(f"{tool} is not installed (util-linux, iproute2, coreutils): make rehearsal-tools")
        self.holder = subprocess.Popen(
            ["unshare", "--net", "--mount", "--pid", "--fork", "--propagation", "private",
             "bash", "-c", _HOLDER, "holder", str(self.lower), *(str(d.path) for d in self.disks)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "REAPER": sys.executable})
        line = self.holder.stdout.readline().strip()
        if line != "ready":
            self.stop()
            raise RehearsalError(f"the machine's namespaces did not come up: {self.holder.stderr.read()[-2000:]}")
        children = Path(f"/proc/{self.holder.pid}/task/{self.holder.pid}/children").read_text().split()
        self.pid = int(children[0])
        return self

    def stop(self) -> None:
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()  # unshare; its child, the namespaces' init, dies with its PID namespace
            if self.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, 9)
            self.holder.wait(timeout=30)

    def run(self, disk: Disk, argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """`argv` as root inside the machine: its namespaces, chrooted into `disk`, with `env` only."""
        command = ["nsenter", "--target", str(self.pid), "--net", "--mount", "--pid", "--",
                   "chroot", str(disk.root), "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)

    def in_netns(self, action: Callable[[], T]) -> T:
        return _in_netns(self.pid, action)

    def view(self, disk: Disk) -> Path:
        """The machine's disk as its mount namespace shows it, readable from here."""
        return Path(f"/proc/{self.pid}/root") / str(disk.root).lstrip("/")


@dataclasses.dataclass
class Boot:
    """What one boot printed and how long each phase took (from startup.sh's `at=` fields)."""

    name: str
    status: int
    console: str
    marks: dict[str, float]

    def phases(self) -> list[tuple[str, float]]:
        order = [("startup_script_start", "metadata and the booting record"), ("code_sync", "code sync (gcloud storage rsync)"),
                 ("uv", "uv from the bucket, interpreter from the mirror, virtualenv"),
                 ("installing", "locked install from the wheelhouse"),
                 ("install_skipped", "permission check"),  # a reboot: the install stamp is unchanged
                 ("installed", "permission check"),
                 ("worker_started", "worker start to first claim"), ("first_claim", "")]
        present = [(key, what) for key, what in order if key in self.marks]
        return [(what, self.marks[nxt] - self.marks[key]) for (key, what), (nxt, _) in zip(present, present[1:])]


class Rehearsal:
    """The world of the rehearsal: namespaces, disks, fake servers, the uploader's view of the bucket."""

    def __init__(self, workdir: Path, disks: int = 2):
        self.workdir = workdir
        self.lower = rootfs.ensure()
        self.disks = [Disk(workdir / f"disk{i}") for i in range(disks)]
        self.ns = Namespaces(self.lower, self.disks)
        self.gcs = self.cloud = self.metadata = self.uploader = None
        self.timings: dict[str, float] = {}

    # -- set-up

    def start(self) -> "Rehearsal":
        started = time.monotonic()
        self.ns.start()
        self.gcs = self.ns.in_netns(lambda: FakeGCS().start())
        self.gcs.create_bucket(BUCKET)
        self.cloud = self.ns.in_netns(lambda: FakeCloud().start())
        self.metadata = self.ns.in_netns(lambda: FakeMetadata().start(METADATA_ADDRESS))
        # The uploader's way in: a second listener, outside the namespace, on the same storage.
        self.uploader = FakeGCS()
        self.uploader.storage, self.uploader.faults = self.gcs.storage, self.gcs.faults
        self.uploader.start()
        for disk in self.disks:
            self._prepare(disk)
        self.timings["namespaces_s"] = time.monotonic() - started
        return self

    def stop(self, keep_disks: bool = False) -> None:
        for server in (self.metadata, self.cloud, self.gcs, self.uploader):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()
        self.ns.stop()
        if not keep_disks:
            remove_in_background([disk.path for disk in self.disks if disk.path.exists()])

    def __enter__(self) -> "Rehearsal":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _prepare(self, disk: Disk) -> None:
        prepare_disk(self.ns.view(disk), self.gcs.url, self.cloud.url)

    def machine_env(self) -> dict[str, str]:
        return machine_env(self.gcs.url, self.cloud.url)

    def uploader_env(self, scratch: Path) -> dict[str, str]:
        config = write_config(scratch / "uploader-gcloud", storage=self.uploader.url, project=PROJECT)
        return {**os.environ, "CLOUDSDK_CONFIG": str(config), "STORAGE_EMULATOR_HOST": self.uploader.url,
                "PYTHONPATH": str(REPO)}

    # -- the uploader's side (a developer's machine: the package index is reachable)

    def upload_code(self, code: str, release_url: str, downloads_json: Path, extra: list[str] = ()) -> float:
        """tools/upload_code.py with --wheelhouse and --python-mirror through the real gcloud."""
        env = {**self.uploader_env(self.workdir), "UV_PYTHON_INSTALL_MIRROR": release_url,
               "UV_PYTHON_DOWNLOADS_JSON_URL": downloads_json.as_uri()}
        started = time.monotonic()
        result = subprocess.run([sys.executable, "tools/upload_code.py", f"gs://{BUCKET}/{code}", "--lock", "cpu",
                                 "--wheelhouse", "--python-mirror", *extra], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=1200)
        if result.returncode != 0:
            raise RehearsalError(f"tools/upload_code.py failed ({result.returncode}):\n{result.stderr[-4000:]}")
        return time.monotonic() - started

    def tool(self, *argv: str) -> subprocess.CompletedProcess:
        result = subprocess.run([sys.executable, *argv], cwd=REPO, env=self.uploader_env(self.workdir),
                                capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise RehearsalError(f"{argv[0]} failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
        return result

    def submit_job(self, job_name: str, rows: int = 8) -> list[str]:
        """A tiny Qwen model and a FineWeb-like parquet file into the bucket, planned and submitted as one task."""
        job, tasks = self.stage_job(job_name, rows, rows)
        self.tool("tools/submit.py", f"gs://{BUCKET}/jobs/{job_name}", "--job", str(job), "--tasks", str(tasks))
        return [json.loads(line)["id"] for line in tasks.read_text().splitlines()]

    def stage_job(self, job_name: str, rows: int, rows_per_task: int, files: int = 1,
                  upload_model: bool = True) -> tuple[Path, Path]:
        """A tiny Qwen model and FineWeb-like parquet files in the bucket (through the real gcloud), the
        job.json that names them and its tasks planned by tools/make_tasks.py: (job.json, tasks.jsonl).
        The model is written beside job.json (`model/`); `upload_model=False` leaves its mirror in the
        bucket to whoever runs the job (`gcs-spawner up` mirrors a run's model.source)."""
        from extract.tiny import write_fineweb_like_parquet, write_tiny_qwen

        scratch = self.workdir / f"job-{job_name}"
        model = write_tiny_qwen(scratch / "model", "qwen2", hidden=32, layers=2, heads=4, kv_heads=2, vocab=320)
        data = write_fineweb_like_parquet(scratch / "data", files, rows, seed=1)
        gcloud = shutil.which("gcloud")
        env = self.uploader_env(self.workdir)
        uploads = [(model, f"models/tiny-{job_name}")] if upload_model else []
        for local, remote in (*uploads, (scratch / "data", f"data/{job_name}")):
            subprocess.run([gcloud, "storage", "rsync", "--recursive", str(local), f"gs://{BUCKET}/{remote}"],
                           env=env, check=True, capture_output=True, timeout=300)
        job = {"model": f"gs://{BUCKET}/models/tiny-{job_name}",
               "data_files": [f"gs://{BUCKET}/data/{job_name}/{Path(p).name}" for p in data],
               "layers": [1, -1], "max_seq_len": 48, "batch_size": 4, "shard_size": 4, "buckets": [16, 48]}
        (scratch / "job.json").write_text(json.dumps(job))
        self.tool("tools/make_tasks.py", str(scratch / "job.json"), "--rows-per-task", str(rows_per_task), "-o",
                  str(scratch / "tasks.jsonl"))
        return scratch / "job.json", scratch / "tasks.jsonl"

    # -- the machine's side

    def set_machine(self, name: str, code: str, job: str, queue: str | None = None, spawn_flags: list[str] = (),
                    drop: tuple[str, ...] = ()) -> None:
        """The metadata of a member of managed instance group GROUP, launched from templates/vm.yaml
        as tools/create_template.py would (fleet.specs.Launch), with a CPU lock; `queue` (a gs:// URL)
        replaces jobs/JOB, `spawn_flags` go after the spec's, the attributes in `drop` are left out."""
        from fleet.specs import Launch, load_spec

        spec = load_spec(REPO / "templates" / "vm.yaml")
        launch = Launch.make(spec, queue or f"gs://{BUCKET}/jobs/{job}", f"gs://{BUCKET}/{code}",
                             spawn_flags=[*spec.spawn_flags, *spawn_flags])
        attributes = {**launch.metadata(spec, "cpu"),
                      "created-by": f"projects/123456789012/zones/{ZONE}/instanceGroupManagers/{GROUP}"}
        values = instance_metadata(name, {k: v for k, v in attributes.items() if k not in drop},
                                   spec.machine_type, spot=True)
        with self.metadata.changed:
            self.metadata.values.clear()
            self.metadata.values.update(values)
        group = f"projects/{PROJECT}/zones/{ZONE}/instanceGroupManagers/{GROUP}"
        if group not in self.cloud.resources:
            self.cloud.add(group, {"name": GROUP, "targetSize": 2})
        self.cloud.add(f"projects/{PROJECT}/zones/{ZONE}/instances/{name}", {"name": name})

    def boot(self, disk: Disk, name: str, timeout: float = 900) -> Boot:
        """Run the guest agent's startup-script runner as root, as a VM's boot does."""
        started = time.time()
        result = self.ns.run(disk, ["/usr/local/sbin/google-startup-script"], self.machine_env(), timeout)
        console = result.stdout + result.stderr
        (self.workdir / f"console-{name}.log").write_text(console)
        marks = {"boot": started}
        for line in console.splitlines():
            fields = dict(field.split("=", 1) for field in line.split() if "=" in field)
            event, at = fields.get("event"), fields.get("at")
            if not event or not at:
                continue
            if event == "machine_record" and fields.get("state") in ("booting", "installing"):
                event = fields["state"]
            marks.setdefault(event, float(at))
        return Boot(name, result.returncode, console, marks)

    def wait_for_delete(self, name: str, timeout: float) -> Any:
        """The MIG deleteInstances request naming `name`, once it has arrived."""
        deadline = time.monotonic() + timeout
        wanted = f"zones/{ZONE}/instances/{name}"
        while time.monotonic() < deadline:
            for call in self.cloud.calls("POST", "/deleteInstances"):
                if wanted in (call.body or {}).get("instances", []):
                    return call
            time.sleep(0.2)
        return None

    def objects(self, prefix: str) -> dict[str, Any]:
        bucket = self.gcs.storage.buckets[BUCKET]
        with self.gcs.storage.lock:
            return {name: bucket.objects[name] for name in bucket.names if name.startswith(prefix)}

    def worker_log(self, disk: Disk) -> str:
        path = self.ns.view(disk) / "var/log/spawn-worker.service.log"
        return path.read_text(errors="replace") if path.exists() else ""


def prepare_disk(root: Path, gcs_url: str, cloud_url: str) -> None:
    """What the image has that the root filesystem lacks: the guest environment's pieces (stood in),
    /etc/hosts naming the metadata server as GCE's does, and gcloud configured for these endpoints."""
    for name in ("systemctl", "google-startup-script"):
        shutil.copy(IMAGE / name, root / "usr/local/sbin" / name)
    with (root / "etc/hosts").open("a") as hosts:
        hosts.write("169.254.169.254 metadata.google.internal metadata\n")
    write_config(root / "root/.config/gcloud", storage=gcs_url, compute=cloud_url, tpu=cloud_url, project=PROJECT)


def machine_env(gcs_url: str, cloud_url: str) -> dict[str, str]:
    """The startup-script runner's environment: the Python clients' endpoints (a real unit would not
    inherit them), shorter backoffs, and the systemctl stand-in's restart pause in seconds."""
    return {"PATH": MACHINE_PATH, "HOME": "/root", "LANG": "C.UTF-8",
            "STORAGE_EMULATOR_HOST": gcs_url, "FLEET_COMPUTE_ENDPOINT": cloud_url,
            "FLEET_TPU_ENDPOINT": cloud_url, "FLEET_CRM_ENDPOINT": cloud_url,
            "STARTUP_RETRY_DELAY_S": "1", "STANDIN_RESTART_SEC": "1"}


def instance_metadata(name: str, attributes: dict[str, str], machine_type: str, spot: bool) -> dict[str, str]:
    """What a GCE VM's metadata server holds for instance `name`, with the service account's token."""
    values = gce_vm(PROJECT, ZONE, name, attributes)
    values.update({"instance/machine-type": f"projects/123456789012/machineTypes/{machine_type.rsplit('/', 1)[-1]}",
                   "instance/scheduling/provisioning-model": "SPOT" if spot else "STANDARD",
                   "instance/service-accounts/default/token": json.dumps(
                       {"access_token": TOKEN, "expires_in": 3599, "token_type": "Bearer"})})
    return values


class LateGcloud:
    """gcloud as a snap that snapd seeds after the boot has begun (Ubuntu 24.04, the TPU and ML images;
    GoogleCloudPlatform/guest-agent#84), on a machine's disk seen from outside (`root`): the image's
    /usr/bin/gcloud is gone, `snap` is the stand-in (tests/boot/image/snap), and `seed()` puts gcloud at
    /snap/bin/gcloud and marks the seeding done, as snapd would. `restore()` puts the disk back."""

    def __init__(self, root: Path):
        self.root = root
        for tool in ("gcloud", "gsutil"):
            (root / "usr/bin" / tool).unlink()
        shutil.copy(IMAGE / "snap", root / "usr/bin/snap")

    def seed(self) -> None:
        (self.root / "snap/bin").mkdir(parents=True, exist_ok=True)
        (self.root / "snap/bin/gcloud").symlink_to("/usr/lib/google-cloud-sdk/bin/gcloud")
        (self.root / "var/lib/snapd").mkdir(parents=True, exist_ok=True)
        (self.root / "var/lib/snapd/seeded").touch()

    def restore(self) -> None:
        shutil.rmtree(self.root / "snap", ignore_errors=True)
        shutil.rmtree(self.root / "var/lib/snapd", ignore_errors=True)
        (self.root / "usr/bin/snap").unlink(missing_ok=True)
        for tool in ("gcloud", "gsutil"):
            (self.root / "usr/bin" / tool).symlink_to(f"../lib/google-cloud-sdk/bin/{tool}")


def missing_tools() -> list[str]:
    """What this machine lacks for a rehearsal, each said as what to do about it."""
    missing = [tool for tool in ("mmdebstrap", "gcloud", "unshare", "nsenter", "ip") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root")
    elif shutil.which("unshare"):
        probe = subprocess.run(["unshare", "--net", "--mount", "--pid", "--fork", "true"], capture_output=True,
                               text=True, timeout=60)
        if probe.returncode != 0:
            missing.append(f"the right to make namespaces (unshare: {probe.stderr.strip()[-200:]})")
    try:
        rootfs.host_release()
    except rootfs.RootfsError as err:
        missing.append(f"a Debian host ({err})")
    return missing


def tools_verdict() -> tuple[str, bool] | None:
    """None when this machine can rehearse; else one line saying what it lacks, and whether that is a
    failure (CI: BOOT_REHEARSAL=required or CI set) rather than a skip."""
    missing = missing_tools()
    if not missing:
        return None
    message = (f"the boot rehearsal needs {'; '.join(missing)} (`make rehearsal-tools` installs the tools; "
               f"the namespaces need root with CAP_SYS_ADMIN)")
    if os.environ.get("BOOT_REHEARSAL") == "required" or os.environ.get("CI"):
        return f"{message}; CI must run it (BOOT_REHEARSAL=required or CI is set)", True
    return f"{message}; skipped on this machine", False


def skip_or_fail_without_the_tools() -> None:
    """A rehearsal test's first line: skip saying what is missing, except in CI (BOOT_REHEARSAL=required
    or CI set), where a missing piece fails it."""
    import pytest

    verdict = tools_verdict()
    if verdict is None:
        return
    message, fails = verdict
    if fails:
        pytest.fail(message)
    pytest.skip(message)


def remove_in_background(paths: list[Path]) -> None:
    """Remove the machines' disks (a gigabyte and more each: venv, uv's cache, wheels, code; tens of
    thousands of files, minutes on a loaded machine) without holding up the caller: a test worker
    goes on with other tests meanwhile. Their console logs, beside them, stay."""
    if paths:
        subprocess.Popen(["rm", "-rf", "--one-file-system", "--", *map(str, paths)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def release_host(directory: Path) -> tuple[str, Callable[[], None]]:
    """A local HTTP server standing in for the interpreter's release host: (base URL, stop)."""
    import functools
    import http.server

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server.shutdown


def standin_release(lower: Path) -> tuple[Path, Path]:
    """The stand-in interpreter archive of the root filesystem's CPython, cached beside it: (release dir, list)."""
    release = lower.parent / f"{lower.name}.python-release"
    listing = release / standin_python.TAG / "downloads.json"
    with rootfs.locked(lower.parent):
        if not listing.exists():
            building = Path(tempfile.mkdtemp(prefix=f"{release.name}.building-", dir=lower.parent))
            standin_python.write(lower, building / standin_python.TAG)
            shutil.rmtree(release, ignore_errors=True)
            building.rename(release)
    return release, listing


def first_claim_time(rehearsal: Rehearsal, disk: Disk, after: float = 0.0) -> float | None:
    """When the worker first claimed a task after `after`: its fencing token is the lease's generation,
    which the fake GCS takes from the clock (microseconds since the epoch; tests/fakegcs/server.py)."""
    claims = [int(token) / 1e6 for token in re.findall(r"event=claimed task=\S+ token=(\d+)", rehearsal.worker_log(disk))]
    return min((at for at in claims if at >= after), default=None)


def report(boot: Boot) -> str:
    total = boot.marks["first_claim"] - boot.marks["startup_script_start"]
    lines = [f"{boot.name}: boot to first claim {total:.1f} s"]
    lines += [f"  {what:58s} {seconds:6.1f} s  {100 * seconds / total:5.1f}%" for what, seconds in boot.phases()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.boot.rehearsal", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (disks, logs)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="boot-rehearsal-"))
    try:
        with Rehearsal(workdir, disks=1) as world:
            release, listing = standin_release(world.lower)
            url, stop_release = release_host(release)
            try:
                upload_s = world.upload_code("code/run1", url, listing)
            finally:
                stop_release()
            wheels = world.objects("code/run1/wheelhouse/cpu/")
            mirror = world.objects("code/run1/python-mirror/")
            print(f"load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
            print(f"upload_code.py --lock cpu --wheelhouse --python-mirror: {upload_s:.1f} s; wheelhouse/cpu "
                  f"{len(wheels)} wheels, {sum(len(o.data) for o in wheels.values()) / 1e6:.0f} MB; python-mirror "
                  f"{sum(len(o.data) for o in mirror.values()) / 1e6:.0f} MB")
            for label, job in (("cold boot (new disk)", "cold"), ("warm boot (reboot, same disk)", "warm")):
                [task] = world.submit_job(job)
                world.set_machine("spawn-worker-0001", "code/run1", job)
                boot = world.boot(world.disks[0], label)
                deleted = world.wait_for_delete("spawn-worker-0001", 600) if boot.status == 0 else None
                claim = first_claim_time(world, world.disks[0], after=boot.marks["boot"])
                if boot.status != 0 or claim is None or deleted is None:
                    print(boot.console[-4000:], world.worker_log(world.disks[0])[-4000:], sep="\n")
                    return 1
                boot.marks["first_claim"] = claim
                print(report(boot))
                world.cloud.requests.clear()
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

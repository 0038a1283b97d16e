"""startup/startup.sh: shellcheck-clean, and executed for real in a temporary root with stub
gcloud, uv, python3, apt-get and systemctl on PATH, the fake metadata server behind curl, and the
fake Compute and TPU APIs that its REST fallback deletes the machine with."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cloud.conftest import StubBin
from tests.cloud.fakecloud import FakeCloud
from tests.workers import wait_for
from tests.cloud.fakemetadata import FakeMetadata, gce_vm, tpu_vm
from tests.fakegcs.server import FakeGCS

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "startup" / "startup.sh"
UNIT = REPO / "startup" / "spawn-worker.service"
SHELLCHECK = REPO / ".venv" / "bin" / "shellcheck"
# The only real programs the script may run; everything else it calls is a stub, so a real
# gcloud, uv, python or apt-get on this machine can never be reached.
REAL_TOOLS = ("bash", "curl", "cat", "sha256sum", "mkdir", "rm", "install", "cp", "tee", "tail", "date", "tr",
              "sleep", "env", "flock", "dirname", "chmod", "timeout")
TOKEN = "ya29.machine-token"
# The stub gcloud's rsync: copy SRC to DEST but for the relative paths that the regular expression
# matches from their start.
RSYNC_COPY = """
import pathlib, re, shutil, sys
src, dest, exclude = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), re.compile(sys.argv[3])
for f in src.rglob("*"):
    rel = f.relative_to(src).as_posix()
    if f.is_file() and not exclude.match(rel):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dest / rel)
"""
ATTRS = {"spawn-code": "gs://bkt/code/run1", "spawn-queue": "gs://bkt/jobs/j1", "spawn-consumer": "python consume.py"}


def test_startup_script_is_shellcheck_clean():
    result = subprocess.run([str(SHELLCHECK), "--severity=style", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


class Boot:
    """One machine's disk (root/) and tools (stubs), booted by running the script."""

    def __init__(self, tmp_path: Path, stubs: StubBin, metadata: FakeMetadata, cloud: FakeCloud, storage: FakeGCS):
        self.root = tmp_path / "root"
        self.storage = storage  # the JSON API the records' REST fallback writes to (bucket `bkt`)
        self.root.mkdir()
        self.stubs = stubs
        self.metadata = metadata
        self.cloud = cloud
        # What the metadata server hands the machine's service account (authenticate-workloads).
        metadata.values["instance/service-accounts/default/token"] = json.dumps(
            {"access_token": TOKEN, "expires_in": 3599, "token_type": "Bearer"})
        bucket = tmp_path / "bucket-code"
        (bucket / "startup").mkdir(parents=True)
        shutil.copy(UNIT, bucket / "startup" / UNIT.name)
        for name in ("setup.cfg", "pyproject.toml"):
            shutil.copy(REPO / name, bucket / name)
        self.bucket = bucket
        self.records = tmp_path / "bucket-records"
        self.records.mkdir()
        self.dpkg_lock = tmp_path / "dpkg-lock-frontend"
        self.dpkg_lock.touch()
        self.extra_env: dict[str, str] = {}
        (stubs.dir / "rsync_copy.py").write_text(RSYNC_COPY)
        # gcloud storage rsync [--exclude=REGEX] SRC DEST: the "bucket" is a local directory here (failing
        # the first $RSYNC_FAILURES times), copied but for the paths the Python regular expression
        # matches from their start, as gcloud does; gcloud storage cp - URL keeps a machine record.
        stubs.add("gcloud", """
            if [[ "$1 $2" == "storage rsync" ]]; then
              n=$(( $(cat "$STUB_DIR/.rsyncs" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$STUB_DIR/.rsyncs"
              if (( n <= ${RSYNC_FAILURES:-0} )); then echo "${RSYNC_ERROR:-rsync: 503 from the bucket}" >&2; exit 1; fi
              exclude='$^'; for a in "$@"; do case "$a" in --exclude=*) exclude="${a#*=}";; esac; done
              {PYTHON} "$STUB_DIR/rsync_copy.py" "$FAKE_BUCKET_CODE" "${@: -1}" "$exclude"
            elif [[ "$1 $2" == "storage cp" ]]; then
              if [[ -n "${RECORD_FAILS:-}" ]]; then echo "ERROR: (gcloud.storage.cp) $RECORD_FAILS" >&2; exit 1; fi
              url="${@: -1}"; cat > "$FAKE_RECORDS/${url##*/}"
              printf '%s\n' "$url" >> "$FAKE_RECORDS/.history"; for a in "$@"; do case "$a" in --custom-metadata=*) printf '%s\n' "${a#*=}" >> "$FAKE_RECORDS/.history";; esac; done
            fi
        """.replace("{PYTHON}", sys.executable))
        # The virtualenv's python: `-m fleet.selfdelete check` answers as $PERMISSION_VERDICT says.
        stubs.add("venv-python", """
            if [[ "$*" == "-m fleet.selfdelete check" && -n "${PERMISSION_VERDICT:-}" ]]; then echo "$PERMISSION_VERDICT"; exit 3; fi
        """)
        stubs.add("uv-stub", """
            if [[ "$1" == venv ]]; then mkdir -p "${@: -1}/bin"; cp "$STUB_DIR/venv-python" "${@: -1}/bin/python"; fi
            if [[ "$1 $2" == "pip install" && -n "${UV_PIP_FAILS:-}" ]]; then echo "error: no matching distribution for jax" >&2; exit 1; fi
        """)
        shutil.copy(stubs.dir / "uv-stub", stubs.dir / "uv")
        # The image's python3 can make a venv only once python3-venv is installed; its pip installs uv.
        stubs.add("pip", """if [[ " $* " == *" uv "* ]]; then cp "$STUB_DIR/uv-stub" "$(dirname "$0")/uv"; fi
""")
        stubs.add("python3", """
            if [[ "$1 $2" == "-m venv" ]]; then
              [[ -f "$STUB_DIR/.python3-venv" ]] || { echo "ensurepip is not available" >&2; exit 1; }
              mkdir -p "$3/bin"; cp "$STUB_DIR/pip" "$3/bin/pip"
            fi
        """)
        # apt-get as Debian's: without -o DPkg::Lock::Timeout it fails at once while the lock is held.
        stubs.add("apt-get", """
            wait_s=0
            for a in "$@"; do case "$a" in DPkg::Lock::Timeout=*) wait_s="${a#*=}";; esac; done
            exec 9>"$DPKG_LOCK"
            if ! flock -w "$wait_s" 9; then echo "E: Could not get lock $DPKG_LOCK" >&2; exit 100; fi
            for p in "$@"; do if [[ "$p" == python3-venv ]]; then : > "$STUB_DIR/.python3-venv"; fi; done
        """)
        stubs.add("systemctl")
        stubs.add("journalctl", "echo 'Traceback (most recent call last):'; echo 'ImportError: no module named jax'\n")
        self.tools = tmp_path / "real-tools"
        self.tools.mkdir()
        for tool in REAL_TOOLS:
            (self.tools / tool).symlink_to(shutil.which(tool))

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        full_env = {
            "PATH": f"{self.stubs.dir}{os.pathsep}{self.tools}",
            "HOME": str(self.root),
            "STARTUP_ROOT": str(self.root),
            "STARTUP_RETRY_DELAY_S": "0",
            "GCE_METADATA_HOST": self.metadata.host,
            "FLEET_COMPUTE_ENDPOINT": self.cloud.url,
            "FLEET_TPU_ENDPOINT": self.cloud.url,
            "STORAGE_EMULATOR_HOST": self.storage.url,
            "FAKE_BUCKET_CODE": str(self.bucket),
            "FAKE_RECORDS": str(self.records),
            "DPKG_LOCK": str(self.dpkg_lock),
            "STUB_DIR": str(self.stubs.dir),
            **self.extra_env,
            **env,
        }
        self.stubs.log.write_text("")
        return subprocess.run(["bash", str(SCRIPT), *args], env=full_env, capture_output=True, text=True, timeout=60)

    def without_uv(self) -> None:
        (self.stubs.dir / "uv").unlink()

    def record(self, name: str) -> dict:
        return json.loads((self.records / f"{name}.json").read_text())

    def states(self) -> list[str]:
        history = (self.records / ".history").read_text().splitlines() if (self.records / ".history").exists() else []
        return [line.split("state=")[1].split(",")[0] for line in history if line.startswith("state=")]

    @property
    def unit(self) -> Path:
        return self.root / "etc/systemd/system/spawn-worker.service"

    @property
    def venv(self) -> str:
        return f"{self.root}/opt/fleet/venv"

    @property
    def code(self) -> str:
        return f"{self.root}/opt/fleet/code"


@pytest.fixture
def boot(tmp_path: Path, stubs: StubBin, metadata_server: FakeMetadata, cloud: FakeCloud) -> Boot:
    storage = FakeGCS().start()
    storage.create_bucket("bkt")
    try:
        yield Boot(tmp_path, stubs, metadata_server, cloud, storage)
    finally:
        storage.stop()


def _record_call(name: str) -> list[str]:
    return ["gcloud", "storage", "cp", "--content-type=application/json"]


def _without_records(calls: list[list[str]]) -> list[list[str]]:
    return [c for c in calls if c[:3] != ["gcloud", "storage", "cp"]]


def test_gpu_vm_boot_syncs_provisions_python_installs_cuda_jax_and_starts_the_unit_and_reboot_reinstalls_nothing(boot: Boot):
    boot.metadata.values.update(gce_vm("p", "us-central1-a", "w-1", {**ATTRS, "spawn-accelerator": "gpu", "spawn-extras": "extract"}))
    rsync = ["gcloud", "storage", "rsync", "--recursive", "--delete-unmatched-destination-objects",
             "--exclude=wheelhouse/(?!cuda12/)", "gs://bkt/code/run1", boot.code]
    check = ["python", "-m", "fleet.selfdelete", "check"]
    start = [["systemctl", "daemon-reload"], ["systemctl", "start", "spawn-worker.service"]]

    first = boot.run()
    assert first.returncode == 0, first.stderr
    assert _without_records(boot.stubs.calls()) == [
        rsync,
        ["uv", "python", "install", "3.11"],
        ["uv", "venv", "--managed-python", "--python", "3.11", boot.venv],
        ["uv", "pip", "install", "--python", f"{boot.venv}/bin/python", "--editable", f"{boot.code}[extract]", "jax[cuda12]"],
        check,
        *start,
    ]
    assert boot.states() == ["booting", "installing"]
    record = boot.record("w-1")
    assert (record["state"], record["accelerator"], record["code"]) == ("installing", "gpu", "gs://bkt/code/run1")
    unit = boot.unit.read_text()
    assert unit == UNIT.read_text()
    assert "ExecStart=/opt/fleet/venv/bin/python -m fleet.service" in unit
    assert "ExecStopPost=-/bin/bash /opt/fleet/code/startup/startup.sh worker-stopped" in unit

    second = boot.run()
    assert second.returncode == 0, second.stderr
    assert _without_records(boot.stubs.calls()) == [rsync, check, *start]
    assert "event=install_skipped" in second.stderr
    assert boot.unit.read_text() == unit


def test_locked_install_takes_exactly_the_lock_from_its_own_wheelhouse_with_no_index(boot: Boot):
    (boot.bucket / "locks").mkdir()
    (boot.bucket / "locks" / "tpu.txt").write_text("jax[tpu]==0.10.0\n")
    for lock, wheel in (("tpu", "libtpu-0.0.42.1-cp311-cp311-manylinux_2_31_x86_64.whl"),
                        ("cuda12", "nvidia_cudnn_cu12-9.10.2.21-py3-none-manylinux_2_27_x86_64.whl"),
                        ("cpu", "jaxlib-0.10.2-cp311-cp311-manylinux_2_27_x86_64.whl")):
        (boot.bucket / "wheelhouse" / lock).mkdir(parents=True)
        (boot.bucket / "wheelhouse" / lock / wheel).write_text("wheel")
    boot.metadata.values.update(tpu_vm("p", "us-west4-a", "spawn-tpu-0000", {**ATTRS, "spawn-accelerator": "tpu", "spawn-python": "python3.11"}))
    result = boot.run()
    assert result.returncode == 0, result.stderr
    wheelhouse, python = f"{boot.code}/wheelhouse/tpu", f"{boot.venv}/bin/python"
    pip_calls = [c for c in boot.stubs.calls() if c[:3] == ["uv", "pip", "install"]]
    assert pip_calls == [
        ["uv", "pip", "install", "--python", python, "--no-index", "--find-links", wheelhouse, "--requirement", f"{boot.code}/locks/tpu.txt"],
        ["uv", "pip", "install", "--python", python, "--no-index", "--find-links", wheelhouse, "--no-deps", "--editable", boot.code],
    ]
    assert boot.record("spawn-tpu-0000")["accelerator"] == "tpu"
    # A TPU VM copies the TPU wheelhouse alone: never cuda12's gigabytes.
    assert [p.name for p in (boot.root / "opt/fleet/code/wheelhouse").iterdir()] == ["tpu"]


def test_image_without_uv_waits_for_the_dpkg_lock_bootstraps_uv_and_boots_twice(boot: Boot):
    boot.without_uv()
    boot.metadata.values.update(gce_vm("p", "us-central1-a", "w-2", ATTRS))
    holder = subprocess.Popen(["flock", str(boot.dpkg_lock), "sleep", "2"])  # unattended-upgrades, say
    try:
        wait_for(lambda: subprocess.run(["flock", "-n", str(boot.dpkg_lock), "true"]).returncode != 0, 5,
                 "the holder to take the dpkg lock")
        started = time.monotonic()
        first = boot.run()
        waited = time.monotonic() - started
    finally:
        holder.wait(timeout=10)
    assert first.returncode == 0, first.stderr
    calls = boot.stubs.calls()
    apt = [c for c in calls if c[0] == "apt-get"]
    assert apt and all("DPkg::Lock::Timeout=900" in c for c in apt)
    assert ["apt-get", "-o", "DPkg::Lock::Timeout=900", "install", "-y", "-q", "--no-install-recommends", "python3-venv"] in apt
    assert waited >= 1.5  # it waited for the lock instead of failing
    assert ["pip", "install", "--quiet", "uv"] in calls
    assert (boot.root / "opt/fleet/uv/bin/uv").exists()
    assert calls[-1] == ["systemctl", "start", "spawn-worker.service"]

    second = boot.run()
    assert second.returncode == 0, second.stderr
    assert not [c for c in boot.stubs.calls() if c[0] in ("apt-get", "pip", "python3")]
    assert boot.stubs.calls()[-1] == ["systemctl", "start", "spawn-worker.service"]


def test_code_sync_is_retried_with_backoff(boot: Boot):
    boot.metadata.values.update(gce_vm("p", "z", "w-3", ATTRS))
    result = boot.run(RSYNC_FAILURES="2")
    assert result.returncode == 0, result.stderr
    assert sum(c[:3] == ["gcloud", "storage", "rsync"] for c in boot.stubs.calls()) == 3
    assert result.stderr.count("event=retry") == 2


def test_a_code_sync_refused_by_the_bucket_records_the_permission_the_object_and_the_account(boot: Boot):
    """A 403 on the code sync is the recorded reason, in one line: the account, the permission and the
    bucket, as Cloud Storage words them (it said `code_sync_failed: exit 1 at line 564`, issue 48)."""
    account = "spawn-worker@p.iam.gserviceaccount.com"
    boot.metadata.values.update(gce_vm("p", "z", "w-403", ATTRS))
    result = boot.run(RSYNC_FAILURES="9", RSYNC_ERROR=(
        f"ERROR: (gcloud.storage.rsync) HTTPError 403: {account} does not have storage.objects.list access to the "
        f"Google Cloud Storage bucket. Permission 'storage.objects.list' denied on resource (or it may not exist)."))
    assert result.returncode == 1, result.stderr
    record = boot.record("w-403")
    assert record["state"] == "failed" and record["reason"] == (
        f"code_sync_failed: permission denied: {account} does not have storage.objects.list access to the Google "
        f"Cloud Storage bucket {ATTRS['spawn-code']} (grant the machines' service account roles/storage.objectUser "
        f"on the bucket)"), record["reason"]  # fmt: skip


def test_every_host_of_a_multi_host_slice_starts_the_worker(boot: Boot):
    # Roles (leader, followers) are chosen by fleet/service.py from the same metadata, not here.
    boot.metadata.values.update(tpu_vm("p", "us-west4-a", "big-slice", {**ATTRS, "spawn-accelerator": "tpu"}, hosts=4))
    result = boot.run()
    assert result.returncode == 0, result.stderr
    assert boot.stubs.calls()[-1] == ["systemctl", "start", "spawn-worker.service"]
    assert boot.unit.exists()


@pytest.mark.parametrize(
    "attrs, named",
    [
        ({"spawn-accelerator": "rocm"}, "spawn-accelerator=rocm"),
        ({"spawn-python": "python3; reboot"}, "spawn-python=3; reboot"),
        ({"spawn-code": "/local/dir"}, "spawn-code=/local/dir"),
        ({"spawn-code": None}, "spawn-code= "),
    ],
)
def test_bad_attribute_records_the_failure_and_deletes_the_machine_before_anything_runs(boot: Boot, attrs: dict, named: str):
    values = {**ATTRS, **attrs}
    boot.metadata.values.update(gce_vm("p", "us-central1-a", "w-bad", {k: v for k, v in values.items() if v is not None}))
    result = boot.run()
    assert result.returncode == 1
    assert named in result.stderr
    record = boot.record("w-bad")
    assert record["state"] == "failed" and record["reason"].startswith("bad_attribute: ") and named.strip() in record["reason"]
    assert "event=bad_attribute" in record["log_tail"]
    # No virtualenv yet: one REST call deletes the VM, nothing else ran.
    assert _without_records(boot.stubs.calls()) == []
    assert boot.cloud.mutations() == [("DELETE", "/compute/v1/projects/p/zones/us-central1-a/instances/w-bad")]


def test_install_failure_records_reason_and_log_tail_then_the_machine_deletes_itself(boot: Boot):
    boot.metadata.values.update(gce_vm("p", "us-central1-a", "w-4", {**ATTRS, "created-by": "projects/1/zones/us-central1-a/instanceGroupManagers/grp"}))
    result = boot.run(UV_PIP_FAILS="1")
    assert result.returncode == 1
    record = boot.record("w-4")
    assert record["state"] == "failed" and record["phase"] == "install"
    assert record["reason"].startswith("install_failed: exit 1")
    assert "no matching distribution for jax" in record["log_tail"]
    calls = boot.stubs.calls()
    assert sum(c[:3] == ["uv", "pip", "install"] for c in calls) == 4  # retried
    assert calls[-1] == ["python", "-m", "fleet.selfdelete", "delete"]
    assert not boot.unit.exists()


def test_boot_records_carry_what_the_cost_needs_and_a_failed_boot_keeps_its_spells(boot: Boot):
    """Machine type and provisioning model from the metadata server, the kernel's boot time, and the
    spells per state, in the body and in the listed metadata (reporting/cost.py prices them)."""
    boot.metadata.values.update(gce_vm("p", "us-central1-a", "w-9", ATTRS))
    boot.metadata.values.update({"instance/machine-type": "projects/1/machineTypes/g2-standard-8",
                                 "instance/scheduling/provisioning-model": "SPOT"})  # fmt: skip
    result = boot.run(UV_PIP_FAILS="1")
    assert result.returncode == 1
    record = boot.record("w-9")
    assert (record["machine_type"], record["provisioning"]) == ("g2-standard-8", "spot")
    assert set(record["spent"]) == {"booting", "installing"} and record["spent"]["booting"] >= 0
    assert record["boot_at"] <= record["since"] <= record["at"]
    listed = [line for line in (boot.records / ".history").read_text().splitlines() if line.startswith("state=")]
    assert listed[0].startswith("state=booting,") and "spent_" not in listed[0]
    assert f"since={record['boot_at']}," in listed[0]  # booting counts from the kernel's boot
    last = dict(item.split("=", 1) for item in listed[-1].split(","))
    assert (last["state"], last["machine_type"], last["provisioning"]) == ("failed", "g2-standard-8", "spot")
    assert last["spent_booting"] == str(record["spent"]["booting"]) and "spent_installing" in last


def test_broken_virtualenv_falls_back_to_rest_to_leave_the_group(boot: Boot):
    boot.metadata.values.update(gce_vm("p", "us-central1-a", "w-5", {**ATTRS, "created-by": "projects/1/regions/us-central1/instanceGroupManagers/grp"}))
    boot.cloud.add("projects/p/regions/us-central1/instanceGroupManagers/grp", {"name": "grp", "targetSize": 3})
    boot.stubs.add("venv-python", "exit 1\n")  # the venv exists but cannot run anything
    result = boot.run()
    assert result.returncode == 1
    assert boot.record("w-5")["reason"].startswith("permission_check_failed")
    assert boot.stubs.calls()[-1] == ["python", "-m", "fleet.selfdelete", "delete"]
    [call] = boot.cloud.calls()
    assert (call.method, call.path) == ("POST", "/compute/v1/projects/p/regions/us-central1/instanceGroupManagers/grp/deleteInstances")
    assert call.body == {"instances": ["zones/us-central1-a/instances/w-5"]}
    assert boot.cloud.resources["projects/p/regions/us-central1/instanceGroupManagers/grp"]["targetSize"] == 2


def test_missing_permission_stops_the_boot_before_the_worker_claims_anything(boot: Boot):
    boot.metadata.values.update(gce_vm("p", "us-central1-a", "w-6", {**ATTRS, "created-by": "projects/1/zones/us-central1-a/instanceGroupManagers/grp"}))
    verdict = "missing_permission: compute.instanceGroupManagers.update on project p"
    result = boot.run(PERMISSION_VERDICT=verdict)
    assert result.returncode == 1
    record = boot.record("w-6")
    assert (record["state"], record["reason"], record["phase"]) == ("failed", verdict, "permissions")
    assert ["systemctl", "start", "spawn-worker.service"] not in boot.stubs.calls()
    assert not boot.unit.exists()
    # The listing shows the reason without reading the object.
    assert f"reason={verdict}" in (boot.records / ".history").read_text()


def test_worker_crash_loop_ends_in_a_failed_record_and_a_delete(boot: Boot):
    boot.metadata.values.update(gce_vm("p", "us-central1-a", "w-7", ATTRS))
    assert boot.run().returncode == 0
    assert boot.run("worker-stopped", SERVICE_RESULT="success").returncode == 0
    for _ in range(4):
        stopped = boot.run("worker-stopped", SERVICE_RESULT="exit-code", EXIT_CODE="exited", EXIT_STATUS="1")
        assert stopped.returncode == 0, stopped.stderr
        assert _without_records(boot.stubs.calls()) == []
    assert boot.record("w-7")["state"] == "installing"
    last = boot.run("worker-stopped", SERVICE_RESULT="exit-code", EXIT_CODE="exited", EXIT_STATUS="1")
    assert last.returncode == 0, last.stderr
    record = boot.record("w-7")
    assert record["state"] == "failed" and record["reason"].startswith("worker_crash_loop: 5 failures")
    assert "ImportError: no module named jax" in record["log_tail"]
    calls = boot.stubs.calls()
    assert ["systemctl", "disable", "--now", "--no-block", "spawn-worker.service"] in calls
    assert calls[-1] == ["python", "-m", "fleet.selfdelete", "delete"]


def test_metadata_server_error_inside_a_substitution_deletes_the_machine_once(boot: Boot):
    boot.metadata.values.update(gce_vm("p", "us-central1-a", "w-8", ATTRS))
    boot.metadata.fail_next(100, 500, path_contains="attributes/spawn-extras")
    result = boot.run()
    assert result.returncode == 1
    assert "event=metadata_failed path=instance/attributes/spawn-extras status=500" in result.stderr
    record = boot.record("w-8")
    assert record["state"] == "failed" and record["reason"].startswith("metadata_failed: ")
    assert boot.cloud.mutations() == [("DELETE", "/compute/v1/projects/p/zones/us-central1-a/instances/w-8")]


def test_boot_runs_the_buckets_static_uv_without_python3_venv_or_apt(boot: Boot):
    # A stock image: no uv, no python3-venv, no mirror to apt-get from (the stubs would record it).
    boot.without_uv()
    (boot.bucket / "uv").mkdir()
    shutil.copy(boot.stubs.dir / "uv-stub", boot.bucket / "uv" / "uv")
    (boot.bucket / "uv" / "uv").chmod(0o644)  # as gcloud storage leaves it: no modes in the bucket
    (boot.bucket / "uv" / "VERSION").write_text("0.13.9\n")
    boot.metadata.values.update(gce_vm("p", "us-central1-a", "w-9", ATTRS))
    result = boot.run()
    assert result.returncode == 0, result.stderr
    assert "event=uv source=bucket version=0.13.9" in result.stderr
    calls = boot.stubs.calls()
    assert not [c for c in calls if c[0] in ("python3", "apt-get", "pip")]
    assert ["uv", "python", "install", "3.11"] in calls and calls[-1] == ["systemctl", "start", "spawn-worker.service"]


def test_an_unverified_permission_check_is_recorded_and_the_worker_starts(boot: Boot):
    boot.stubs.add("venv-python", """
        if [[ "$*" == "-m fleet.selfdelete check" ]]; then echo "unverified: tpu_queued_resource (answered 400)"; fi
    """)
    boot.metadata.values.update(tpu_vm("p", "us-west4-a", "t-9", {**ATTRS, "spawn-accelerator": "tpu"}))
    result = boot.run()
    assert result.returncode == 0, result.stderr
    assert boot.stubs.calls()[-1] == ["systemctl", "start", "spawn-worker.service"]
    record = boot.record("t-9")
    assert (record["state"], record["permissions"]) == ("installing", "unverified")
    assert "permissions=unverified" in (boot.records / ".history").read_text()


QR = "projects/p/locations/us-west4-a/queuedResources"
NODES = "projects/p/locations/us-west4-a/nodes"


@pytest.mark.parametrize("machine, resources, calls, gone", [
    (tpu_vm("p", "us-west4-a", "t-1", {"spawn-queued-resource": "t-1"}),
     {f"{QR}/t-1": {}, f"{NODES}/t-1": {"queuedResource": f"{QR}/t-1"}},
     [("DELETE", f"/v2/{QR}/t-1", "true")], [f"{QR}/t-1", f"{NODES}/t-1"]),
    (tpu_vm("p", "us-west4-a", "t-2"),  # made by some other tool: the node names its queued resource
     {f"{QR}/qr-2": {}, f"{NODES}/t-2": {"queuedResource": f"{QR}/qr-2"}},
     [("GET", f"/v2/{NODES}/t-2", None), ("DELETE", f"/v2/{QR}/qr-2", "true")], [f"{QR}/qr-2", f"{NODES}/t-2"]),
    (tpu_vm("p", "us-west4-a", "t-3"), {f"{NODES}/t-3": {}},
     [("GET", f"/v2/{NODES}/t-3", None), ("DELETE", f"/v2/{NODES}/t-3", None)], [f"{NODES}/t-3"]),
    (gce_vm("p", "us-central1-a", "g-1", {"created-by": "projects/1/zones/us-central1-a/instanceGroupManagers/grp"}),
     {"projects/p/zones/us-central1-a/instanceGroupManagers/grp": {"targetSize": 2}, "projects/p/zones/us-central1-a/instances/g-1": {}},
     [("POST", "/compute/v1/projects/p/zones/us-central1-a/instanceGroupManagers/grp/deleteInstances", None)],
     ["projects/p/zones/us-central1-a/instances/g-1"]),
    (gce_vm("p", "us-central1-a", "solo"), {"projects/p/zones/us-central1-a/instances/solo": {}},
     [("DELETE", "/compute/v1/projects/p/zones/us-central1-a/instances/solo", None)],
     ["projects/p/zones/us-central1-a/instances/solo"]),
])
def test_a_boot_that_fails_without_gcloud_or_virtualenv_deletes_the_machine_over_rest(
    boot: Boot, machine: dict, resources: dict, calls: list, gone: list
):
    (boot.stubs.dir / "gcloud").unlink()  # gcloud missing: the code sync fails, and no virtualenv exists
    boot.metadata.values.update({**machine, **{f"instance/attributes/{k}": v for k, v in ATTRS.items()}})
    for name, resource in resources.items():
        boot.cloud.add(name, {"name": name, **resource})
    result = boot.run()
    assert result.returncode == 1
    assert "event=boot_failed phase=code_sync" in result.stderr and "event=self_delete_fallback method=rest" in result.stderr
    made = boot.cloud.calls()
    assert [(c.method, c.path, c.query.get("force")) for c in made] == calls
    assert all(c.headers["authorization"] == f"Bearer {TOKEN}" for c in made)
    assert not set(gone) & set(boot.cloud.resources)
    assert TOKEN not in result.stderr  # the token is never logged
    # The machine did not vanish without a word: its records went through the JSON API (multipart
    # objects.insert with the token), the last one `failed`, with the reason in the listing too.
    [stored] = [o for n, o in boot.storage.storage.buckets["bkt"].objects.items() if n.startswith("jobs/j1/machines/")]
    record = json.loads(stored.data)
    assert (record["state"], record["phase"]) == ("failed", "code_sync") and record["reason"].startswith("gcloud_missing: ")
    # No snap here: it waited for nothing, and says so (it said "after waiting 600s for snap seeding").
    assert record["reason"].startswith("gcloud_missing: no gcloud on PATH, no snap to seed it"), record["reason"]
    assert "event=gcloud_missing" in record["log_tail"] and stored.metadata["state"] == "failed"
    assert stored.metadata["reason"].startswith("gcloud_missing: ") and stored.content_type == "application/json"
    assert "state=booting method=rest" in result.stderr and "state=failed method=rest" in result.stderr


def test_a_snap_gcloud_that_arrives_late_is_waited_for_and_the_boot_goes_on(boot: Boot):
    """Ubuntu 24.04 and the TPU images seed gcloud as a snap after the startup script has begun
    (GoogleCloudPlatform/guest-agent#84): the boot waits for the seeding, bounded, then uses it."""
    shutil.move(boot.stubs.dir / "gcloud", boot.stubs.dir / "gcloud-snap")  # not there yet
    # snapd: `snap wait system seed.loaded` returns once seeding is done, here 2 s in, and the seeding
    # is what puts gcloud on PATH.
    boot.stubs.add("snap", """
        [[ "$*" == "wait system seed.loaded" ]] || { echo "snap stub: $*" >&2; exit 1; }
        sleep 2; cp "$STUB_DIR/gcloud-snap" "$STUB_DIR/gcloud"
    """)
    boot.metadata.values.update(gce_vm("p", "us-central1-a", "w-snap", ATTRS))
    result = boot.run()
    assert result.returncode == 0, result.stderr
    calls = boot.stubs.calls()
    assert calls[0] == ["snap", "wait", "system", "seed.loaded"]
    assert boot.states() == ["booting", "installing"] and calls[-1] == ["systemctl", "start", "spawn-worker.service"]
    assert "event=snap_seed_wait timeout_s=600" in result.stderr and "event=gcloud path=" in result.stderr


def test_a_snap_that_never_seeds_ends_the_boot_with_a_record_over_rest_after_the_bound(boot: Boot):
    (boot.stubs.dir / "gcloud").unlink()
    boot.stubs.add("snap", "sleep 30\n")  # seeding hangs
    boot.metadata.values.update(gce_vm("p", "us-central1-a", "w-hang", ATTRS))
    boot.cloud.add("projects/p/zones/us-central1-a/instances/w-hang", {"name": "w-hang"})
    started = time.monotonic()
    result = boot.run(STARTUP_SNAP_SEED_TIMEOUT_S="1")
    assert result.returncode == 1 and time.monotonic() - started < 20, result.stderr
    record = json.loads(boot.storage.storage.buckets["bkt"].objects["jobs/j1/machines/w-hang.json"].data)
    assert record["state"] == "failed" and re.match(  # (whole seconds: a 1 s wait may straddle two ticks)
        r"gcloud_missing: no gcloud on PATH, after waiting [12]s for snap seeding \(bound 1s\)", record["reason"]), record["reason"]
    assert boot.cloud.mutations() == [("DELETE", "/compute/v1/projects/p/zones/us-central1-a/instances/w-hang")]


def test_a_queue_bucket_that_does_not_exist_ends_the_boot_before_the_install(boot: Boot):
    """A typo in spawn-queue's bucket: no record can land (the bucket is not there), so the reason
    goes to the console, and the machine deletes itself before the sync, the install or a worker."""
    boot.metadata.values.update(gce_vm("p", "us-central1-a", "w-nob", {**ATTRS, "spawn-queue": "gs://bkt-typo/jobs/j1"}))
    boot.cloud.add("projects/p/zones/us-central1-a/instances/w-nob", {"name": "w-nob"})
    result = boot.run(RECORD_FAILS="HTTPError 404: The specified bucket does not exist.")
    assert result.returncode == 1, result.stderr
    assert ("event=boot_failed phase=queue reason=queue_bucket_missing: bucket gs://bkt-typo of "
            "spawn-queue=gs://bkt-typo/jobs/j1 does not exist (check the queue URL)") in result.stderr
    assert boot.cloud.mutations() == [("DELETE", "/compute/v1/projects/p/zones/us-central1-a/instances/w-nob")]
    assert not [c for c in boot.stubs.calls() if c[:3] == ["gcloud", "storage", "rsync"] or c[0] in ("uv", "systemctl")]
    assert not boot.unit.exists()

"""startup/startup.sh: shellcheck-clean, and executed for real in a temporary root with stub
gcloud, python3, apt-get and systemctl on PATH and the fake metadata server behind curl."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cloud.conftest import StubBin
from tests.cloud.fakemetadata import FakeMetadata, gce_vm, tpu_vm

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "startup" / "startup.sh"
UNIT = REPO / "startup" / "spawn-worker.service"
SHELLCHECK = REPO / ".venv" / "bin" / "shellcheck"
# The only real programs the script may run; everything else it calls is a stub, so a real
# gcloud, python or apt-get on this machine can never be reached.
REAL_TOOLS = ("bash", "curl", "cat", "sha256sum", "mkdir", "rm", "install", "cp")
ATTRS = {"spawn-code": "gs://bkt/code/run1", "spawn-queue": "gs://bkt/jobs/j1", "spawn-consumer": "python consume.py"}


def test_startup_script_is_shellcheck_clean():
    result = subprocess.run([str(SHELLCHECK), "--severity=style", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


class Boot:
    """One machine's disk (root/) and tools (stubs), booted by running the script."""

    def __init__(self, tmp_path: Path, stubs: StubBin, metadata: FakeMetadata):
        self.root = tmp_path / "root"
        self.root.mkdir()
        self.stubs = stubs
        self.metadata = metadata
        bucket = tmp_path / "bucket-code"
        (bucket / "startup").mkdir(parents=True)
        shutil.copy(UNIT, bucket / "startup" / UNIT.name)
        for name in ("setup.cfg", "pyproject.toml"):
            shutil.copy(REPO / name, bucket / name)
        self.bucket = bucket
        # gcloud storage rsync SRC DEST: the "bucket" is a local directory here.
        stubs.add("gcloud", 'cp -R "$FAKE_BUCKET_CODE/." "${@: -1}"\n')
        stubs.add("venv-python")
        stubs.add("python3", 'if [[ "$1 $2" == "-m venv" ]]; then mkdir -p "$3/bin"; cp "$STUB_DIR/venv-python" "$3/bin/python"; fi\n')
        # Installing python3.X makes a python3.X that behaves like the python3 stub.
        stubs.add("apt-get", 'for p in "$@"; do if [[ "$p" == python3.* && "$p" != *-venv ]]; then cp "$STUB_DIR/python3" "$STUB_DIR/$p"; fi; done\n')
        stubs.add("systemctl")
        self.tools = tmp_path / "real-tools"
        self.tools.mkdir()
        for tool in REAL_TOOLS:
            (self.tools / tool).symlink_to(shutil.which(tool))

    def run(self) -> subprocess.CompletedProcess:
        env = {
            "PATH": f"{self.stubs.dir}{os.pathsep}{self.tools}",
            "HOME": str(self.root),
            "STARTUP_ROOT": str(self.root),
            "GCE_METADATA_HOST": self.metadata.host,
            "FAKE_BUCKET_CODE": str(self.bucket),
            "STUB_DIR": str(self.stubs.dir),
        }
        self.stubs.log.write_text("")
        return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)

    @property
    def unit(self) -> Path:
        return self.root / "etc/systemd/system/spawn-worker.service"


@pytest.fixture
def boot(tmp_path: Path, stubs: StubBin, metadata_server: FakeMetadata) -> Boot:
    return Boot(tmp_path, stubs, metadata_server)


def test_gpu_vm_boot_syncs_installs_cuda_jax_and_starts_the_unit_and_reboot_reinstalls_nothing(boot: Boot):
    boot.metadata.values.update(gce_vm("p", "us-central1-a", "w-1", {**ATTRS, "spawn-accelerator": "gpu", "spawn-extras": "extract"}))
    code, venv = f"{boot.root}/opt/fleet/code", f"{boot.root}/opt/fleet/venv"
    rsync = ["gcloud", "storage", "rsync", "--recursive", "--delete-unmatched-destination-objects", "gs://bkt/code/run1", code]
    start = [["systemctl", "daemon-reload"], ["systemctl", "start", "spawn-worker.service"]]

    first = boot.run()
    assert first.returncode == 0, first.stderr
    assert boot.stubs.calls() == [
        rsync,
        ["python3", "-m", "venv", venv],
        ["python", "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
        ["python", "-m", "pip", "install", "--quiet", "--editable", f"{code}[extract]", "jax[cuda12]"],
        *start,
    ]
    unit = boot.unit.read_text()
    assert unit == UNIT.read_text()
    assert "ExecStart=/opt/fleet/venv/bin/python -m fleet.service" in unit
    assert "Restart=on-failure" in unit and "StandardOutput=journal+console" in unit

    second = boot.run()
    assert second.returncode == 0, second.stderr
    assert boot.stubs.calls() == [rsync, *start]
    assert "event=install_skipped" in second.stderr
    assert boot.unit.read_text() == unit


def test_tpu_vm_boot_installs_missing_python_and_tpu_jax(boot: Boot):
    boot.metadata.values.update(
        tpu_vm("p", "us-west4-a", "spawn-tpu-0000", {**ATTRS, "spawn-accelerator": "tpu", "spawn-python": "python3.11"})
    )
    result = boot.run()
    assert result.returncode == 0, result.stderr
    calls = boot.stubs.calls()
    assert ["apt-get", "install", "-y", "-q", "--no-install-recommends", "python3.11", "python3.11-venv"] in calls
    assert ["python3.11", "-m", "venv", f"{boot.root}/opt/fleet/venv"] in calls
    assert calls[-3] == ["python", "-m", "pip", "install", "--quiet", "--editable", f"{boot.root}/opt/fleet/code", "jax[tpu]"]
    assert calls[-1] == ["systemctl", "start", "spawn-worker.service"]
    assert boot.unit.exists()


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
        ({"spawn-python": "python3; reboot"}, "spawn-python=python3; reboot"),
        ({"spawn-code": "/local/dir"}, "spawn-code=/local/dir"),
    ],
)
def test_bad_attribute_stops_the_boot_before_anything_runs(boot: Boot, attrs: dict, named: str):
    boot.metadata.values.update(gce_vm("p", "z", "w", {**ATTRS, **attrs}))
    result = boot.run()
    assert result.returncode == 1
    assert named in result.stderr
    assert boot.stubs.calls() == []


def test_missing_code_attribute_fails_naming_the_metadata_path(boot: Boot):
    boot.metadata.values.update(gce_vm("p", "z", "w", {"spawn-queue": "gs://bkt/jobs/j1"}))
    result = boot.run()
    assert result.returncode != 0
    assert "path=instance/attributes/spawn-code status=404" in result.stderr
    assert boot.stubs.calls() == []

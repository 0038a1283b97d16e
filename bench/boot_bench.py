"""Boot to first claim, on this machine: the real startup/startup.sh, the real uv making a real
virtualenv and installing the locked core requirements from a local wheelhouse with --no-index,
the real `python -m fleet.selfdelete check` against the fake Resource Manager, and a real spawn.py
claiming its first task. Only the cloud is stubbed: gcloud (rsync = a local copy of this checkout,
records to a directory), the metadata server and the APIs (tests/cloud fakes), `uv python install`
(this machine's interpreter stands in for the downloaded one) and systemctl (`start` runs spawn.py).

    .venv/bin/python -m bench.boot_bench [--boots 2]

Prints each phase of a cold boot (new virtualenv, full install) and a warm one (reboot: install
skipped), and what dominates. The wheelhouse is built once (pip download of the lock, which needs
the package index or pip's cache) into ~/.cache/gcs-spawner-bench and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from fleet import codesync
from tests.cloud.fakecloud import FakeCloud
from tests.cloud.fakemetadata import FakeMetadata, gce_vm

REPO = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "gcs-spawner-bench"
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
# Landmarks in boot order (stub stamps and startup.sh's `at=` log fields), and the phase each starts.
PHASES = [
    ("start", "metadata + booting record"),
    ("code_sync", "code sync"),
    ("uv-venv", "interpreter + virtualenv"),
    ("uv-pip", "locked install from the wheelhouse"),
    ("install_skipped", "permission check (testIamPermissions)"),  # warm boots
    ("installed", "permission check (testIamPermissions)"),  # cold boots
    ("worker_started", "worker start to first claim"),
    ("claimed", ""),
]
LOGGED = ("code_sync", "installed", "install_skipped", "worker_started")


def wheelhouse() -> tuple[Path, Path]:
    """The core lock (install_requires; the extract extra and JAX left out: the bench measures the
    boot, not JAX's size) and its wheels for the machines' platform, built once by upload_code's own
    functions."""
    lock, wheels = CACHE / f"core-{PY}.txt", CACHE / f"wheels-{PY}"
    if lock.exists() and wheels.is_dir() and any(wheels.glob("*.whl")):
        return lock, wheels
    CACHE.mkdir(parents=True, exist_ok=True)
    reqs = codesync.requirements_of(REPO, [], "pyyaml")
    codesync.compile_lock(reqs, lock, PY, platform=None)
    codesync.download_wheelhouse(lock, wheels, PY)
    return lock, wheels


def stubs(bin_dir: Path, events: Path, queue: Path, python: str) -> None:
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    stamp = f'printf "%s %s\\n" "$({python} -c "import time; print(time.time())")"'

    def add(name: str, body: str) -> None:
        path = bin_dir / name
        path.write_text("#!/usr/bin/env bash\nset -euo pipefail\n" + textwrap.dedent(body))
        path.chmod(0o755)

    add("gcloud", f"""
        if [[ "$1 $2" == "storage rsync" ]]; then {stamp} rsync >> {events}; cp -R "$FAKE_BUCKET_CODE/." "${{@: -1}}"
        elif [[ "$1 $2" == "storage cp" ]]; then url="${{@: -1}}"; cat > "$FAKE_RECORDS/${{url##*/}}"; fi
    """)
    add("uv", f"""
        if [[ "$1 $2" == "python install" ]]; then exit 0; fi
        if [[ "$1" == venv ]]; then {stamp} uv-venv >> {events}; exec {uv} venv --quiet --python {sys.executable} "${{@: -1}}"; fi
        if [[ "$1 $2" == "pip install" && "$*" == *--requirement* ]]; then {stamp} uv-pip >> {events}; fi
        exec {uv} "$@"
    """)
    add("systemctl", f"""
        if [[ "$1" == start ]]; then
          {stamp} systemctl-start >> {events}
          cd "$STARTUP_ROOT/opt/fleet/code"
          nohup "$STARTUP_ROOT/opt/fleet/venv/bin/python" spawn.py {queue} --consumer true --max-tasks 1 \\
            --preemption-watch off --machine-record off --idle-timeout 1 > "$STARTUP_ROOT/worker.log" 2>&1 &
        fi
    """)


def boot_once(root: Path, env: dict, events: Path, queue: Path) -> dict[str, float]:
    from objectstore import open_store
    from taskqueue.submit import submit

    events.write_text("")
    store = open_store(str(queue))
    task = f"t{time.time_ns()}"
    submit(store, None, [(task, json.dumps({"id": task}).encode())])
    started = time.time()
    result = subprocess.run(["bash", str(REPO / "startup" / "startup.sh")], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"startup.sh failed:\n{result.stderr}")
    while not any(e.name.endswith(f"{task}.json") for prefix in ("leases/", "done/") for e in store.list(prefix)):
        if time.time() - started > 300:
            raise SystemExit(f"no claim after 300 s; worker log:\n{(root / 'worker.log').read_text()}")
        time.sleep(0.02)
    marks = {"start": started, "claimed": time.time()}
    for line in events.read_text().splitlines():
        at, name = line.split()
        marks.setdefault(name, float(at))
    for line in result.stderr.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("event") in LOGGED and fields.get("at"):
            marks.setdefault(fields["event"], float(fields["at"]))

    return marks


def report(label: str, marks: dict[str, float]) -> None:
    present = [(name, what) for name, what in PHASES if name in marks]
    total = marks["claimed"] - marks["start"]
    rows = []
    for (name, what), (nxt, _) in zip(present, present[1:]):
        rows.append((what, marks[nxt] - marks[name]))
    print(f"{label}: boot to first claim {total:.2f} s")
    for what, seconds in rows:
        print(f"  {what:36s} {seconds:7.2f} s  {100 * seconds / total:5.1f}%")
    top = max(rows, key=lambda r: r[1])
    print(f"  dominated by: {top[0]} ({top[1] / total:.0%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--boots", type=int, default=2, help="boots in a row on the same disk (1 cold, the rest warm)")
    args = parser.parse_args()
    lock, wheels = wheelhouse()
    with tempfile.TemporaryDirectory(prefix="boot-bench-") as tmp:
        tmp_path = Path(tmp)
        root, bucket, records, queue, bin_dir = (tmp_path / d for d in ("root", "bucket", "records", "queue", "bin"))
        for d in (root, records, bin_dir):
            d.mkdir()
        # The bucket: this checkout as upload_code would mirror it, with the lock and wheelhouse next to it.
        for rel, path in codesync.local_files(REPO, codesync.DEFAULT_EXCLUDES, [*codesync.git_ignored(REPO), *codesync.GENERATED]).items():
            (bucket / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, bucket / rel)
        (bucket / "locks").mkdir()
        shutil.copy(lock, bucket / "locks" / "cpu.txt")
        shutil.copytree(wheels, bucket / "wheelhouse" / "cpu")
        events = tmp_path / "events"
        stubs(bin_dir, events, queue, sys.executable)
        metadata, cloud = FakeMetadata().start(), FakeCloud().start()
        try:
            metadata.values.update(gce_vm("bench", "us-central1-a", "bench-1", {
                "spawn-code": "gs://bench/code", "spawn-queue": "gs://bench/jobs/j", "spawn-consumer": "true",
                "spawn-accelerator": "cpu", "spawn-python": PY}))
            env = {
                "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                "HOME": str(root), "STARTUP_ROOT": str(root), "GCE_METADATA_HOST": metadata.host,
                "FLEET_CRM_ENDPOINT": cloud.url, "FAKE_BUCKET_CODE": str(bucket), "FAKE_RECORDS": str(records),
                "UV_CACHE_DIR": str(tmp_path / "uv-cache"),  # a new machine has no cache
            }
            for i in range(args.boots):
                report("cold boot (new virtualenv, locked install from the wheelhouse)" if i == 0 else "warm boot (reboot: install skipped)",
                       boot_once(root, env, events, queue))
        finally:
            metadata.stop()
            cloud.stop()
    print(f"wheelhouse: {sum(1 for _ in wheels.glob('*.whl'))} wheels, {sum(p.stat().st_size for p in wheels.glob('*.whl')) / 1e6:.0f} MB; lock {lock}")


if __name__ == "__main__":
    main()

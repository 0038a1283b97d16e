"""The stock machine the boot rehearsal boots: a clean root filesystem of this machine's Debian release,
built by mmdebstrap from Debian's packages and cached outside the clone, keyed on its recipe.

    python -m tests.boot.rootfs [--print]     # build (or find) it; print its path

The recipe is the `minbase` variant (essential packages and apt only) plus what a stock GCE image of
Debian 12 (`debian-12`) has that the boot uses: curl, CA certificates and python3. It has no uv, no
python3-venv and no virtualenv of the project. The Google Cloud CLI is not installed into it: the
rehearsal bind-mounts this machine's (`/usr/lib/google-cloud-sdk`), and the recipe adds the
`/usr/bin/gcloud` link a package would. The packages come from this machine's apt sources (its own
configuration, so no mirror is named here).

The cache lives outside the clone (CI clones afresh): $XDG_CACHE_HOME/gcs-spawner/rootfs/KEY, else
~/.cache/gcs-spawner/rootfs/KEY. KEY hashes the recipe: the release, variant, packages and apt
sources, and the text of the files that build what is cached (this file, and
tests/boot/standin_python.py for the interpreter archive cached beside it), so that editing any of
them builds afresh; a new build removes the older ones.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gcs-spawner" / "rootfs"
PACKAGES = ("ca-certificates", "curl", "python3")
VARIANT = "minbase"
SDK = Path("/usr/lib/google-cloud-sdk")
BUILDERS = (Path(__file__), Path(__file__).with_name("standin_python.py"))  # their text is part of the key


class RootfsError(Exception):
    """The root filesystem could not be built; the message names the tool or step."""


def host_release() -> str:
    """This machine's Debian codename (bookworm for Debian 12), from /etc/os-release."""
    fields = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
    if fields.get("ID") != "debian" or not fields.get("VERSION_CODENAME"):
        raise RootfsError(f"the rehearsal builds a root filesystem of this machine's Debian release; "
                          f"/etc/os-release says ID={fields.get('ID')} VERSION_CODENAME={fields.get('VERSION_CODENAME')}")
    return fields["VERSION_CODENAME"].strip('"')


def apt_sources() -> list[Path]:
    """This machine's apt sources, handed to mmdebstrap as files (it pastes them into the chroot)."""
    found = [p for p in (Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*")))
             if p.is_file() and p.suffix in (".list", ".sources") and p.read_text().strip()]
    if not found:
        raise RootfsError("no apt sources in /etc/apt/sources.list or /etc/apt/sources.list.d/*.sources")
    return found


def recipe() -> dict:
    return {"suite": host_release(), "variant": VARIANT, "packages": list(PACKAGES),
            "sources": {str(p): p.read_text() for p in apt_sources()},
            "builders": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in BUILDERS}}


def key(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def ensure(cache: Path = CACHE) -> Path:
    """The cached root filesystem for the current recipe, built first if need be (a minute or two)."""
    if os.geteuid() != 0:
        raise RootfsError("building and booting the root filesystem needs root (mmdebstrap, chroot, mounts)")
    mmdebstrap = shutil.which("mmdebstrap")
    if mmdebstrap is None:
        raise RootfsError("mmdebstrap is not installed: `make rehearsal-tools` installs it (apt-get install mmdebstrap)")
    spec = recipe()
    target = cache / key(spec)
    if (target / ".complete").is_file():
        return target
    with locked(cache):
        if (target / ".complete").is_file():
            return target
        return _build(mmdebstrap, spec, target, cache)


@contextlib.contextmanager
def locked(cache: Path) -> Iterator[None]:
    """One builder at a time in `cache` (two test workers, two runs): the others wait, then find its work."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build(mmdebstrap: str, spec: dict, target: Path, cache: Path) -> Path:
    building = Path(tempfile.mkdtemp(prefix=f"{target.name}.building-", dir=cache))
    started = time.monotonic()
    argv = [mmdebstrap, "--quiet", "--mode=root", f"--variant={VARIANT}", f"--include={','.join(PACKAGES)}",
            spec["suite"], str(building), *map(str, apt_sources())]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        shutil.rmtree(building, ignore_errors=True)
        raise RootfsError(f"mmdebstrap exited {result.returncode}: {result.stderr.strip()[-2000:]}")
    # What the image's google-cloud-cli package would leave; the SDK itself is bind-mounted at boot.
    (building / "usr/lib/google-cloud-sdk").mkdir(parents=True, exist_ok=True)
    for tool in ("gcloud", "gsutil"):
        (building / "usr/bin" / tool).symlink_to(f"../lib/google-cloud-sdk/bin/{tool}")
    (building / ".recipe.json").write_text(json.dumps(spec, indent=1, sort_keys=True))
    (building / ".complete").write_text("")
    shutil.rmtree(target, ignore_errors=True)
    building.rename(target)
    print(f"event=rootfs_built path={target} seconds={time.monotonic() - started:.1f}", file=sys.stderr)
    for stale in cache.iterdir():  # older recipes, what they were built with, and interrupted builds
        if stale.is_dir() and not stale.name.startswith(target.name):
            shutil.rmtree(stale, ignore_errors=True)
        elif stale.is_dir() and stale.name.startswith(f"{target.name}.building-"):
            shutil.rmtree(stale, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.boot.rootfs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    try:
        print(ensure())
    except RootfsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

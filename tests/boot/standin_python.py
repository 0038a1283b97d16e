"""A stand-in for the python-build-standalone archive that `uv python install` downloads, which this
machine cannot reach: a Debian CPython (the stock image's own /usr/bin/python3.X and its standard
library) repackaged in the release's `install_only` layout (`python/bin/python3.X`,
`python/lib/python3.X/`), and a uv downloads list (UV_PYTHON_DOWNLOADS_JSON_URL, uv's setting for
custom builds) that names it under uv's release URL, so that a UV_PYTHON_INSTALL_MIRROR serves it.

What it stands in for, and what not: the path through uv (listing, mirror URL, percent-decoding,
sha256 check, extraction, `uv venv --managed-python`) is uv's own. The interpreter is Debian's, which
links the image's libz and libexpat and loads its libssl and libffi, where the real builds carry theirs.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tarfile
from pathlib import Path

#: Where uv's own downloads list points, and what a UV_PYTHON_INSTALL_MIRROR replaces (uv refuses a
#: mirror for any other URL).
RELEASES = "https://github.com/astral-sh/python-build-standalone/releases/download"
TAG = "20990101"  # no real release has it
# Debian's, not the interpreter's: a link into /etc, the pip guard, and the test suite (another package).
LEFT_OUT = {"sitecustomize.py", "EXTERNALLY-MANAGED", "__pycache__", "test"}


def archive_name(version: str) -> str:
    return f"cpython-{version}+{TAG}-x86_64-unknown-linux-gnu-install_only_stripped.tar.gz"


def build(root: Path, out_dir: Path) -> tuple[Path, str]:
    """The stand-in archive of the CPython 3 of the root filesystem `root` (/ for this machine),
    written into `out_dir` under its release name; returns (archive, version X.Y.Z)."""
    binary = max((root / "usr/bin").glob("python3.[0-9]*[0-9]"), key=lambda p: int(p.name.split(".")[1]))
    stdlib = root / "usr/lib" / binary.name
    command = ["chroot", str(root), f"/usr/bin/{binary.name}"] if root.resolve() != Path("/") else [str(binary)]
    version = subprocess.run([*command, "-S", "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True, check=True).stdout.strip()
    out = out_dir / archive_name(version)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz", compresslevel=1) as archive:
        archive.add(binary, f"python/bin/{binary.name}")
        for alias in ("python3", "python"):
            link = tarfile.TarInfo(f"python/bin/{alias}")
            link.type, link.linkname, link.mode = tarfile.SYMTYPE, binary.name, 0o777
            archive.addfile(link)
        for path in sorted(stdlib.rglob("*")):
            relative = path.relative_to(stdlib)
            if LEFT_OUT & set(relative.parts[:1] + relative.parts[-1:]) or "__pycache__" in relative.parts:
                continue
            if path.is_symlink() and os.readlink(path).startswith("/"):
                path = root / os.readlink(path).lstrip("/")  # uv refuses absolute links: take the file
            if path.is_dir():
                continue  # tar creates directories as it extracts their files
            info = archive.gettarinfo(path, f"python/lib/{binary.name}/{relative.as_posix()}")
            with path.open("rb") as data:
                archive.addfile(info, data)
    return out, version


def downloads_list(archive: Path, version: str) -> dict:
    """A uv downloads list (the format of UV_PYTHON_DOWNLOADS_JSON_URL) with the stand-in alone."""
    major, minor, patch = (int(part) for part in version.split("."))
    quoted = archive.name.replace("+", "%2B")  # as the release URLs spell it
    return {f"cpython-{version}-linux-x86_64-gnu": {
        "name": "cpython", "arch": {"family": "x86_64", "variant": None}, "os": "linux", "libc": "gnu",
        "major": major, "minor": minor, "patch": patch, "prerelease": "", "variant": None,
        "url": f"{RELEASES}/{TAG}/{quoted}", "sha256": hashlib.sha256(archive.read_bytes()).hexdigest()}}


def write(root: Path, out_dir: Path) -> tuple[Path, Path, str]:
    """The archive and its downloads list (downloads.json) in `out_dir`: (archive, list, version)."""
    archive, version = build(root, out_dir)
    listing = out_dir / "downloads.json"
    listing.write_text(json.dumps(downloads_list(archive, version), indent=1))
    return archive, listing, version

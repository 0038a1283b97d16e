"""The locked environment the machines install: a lock per platform, uv, and for firewalled fleets the wheels.

Next to the code (fleet/codesync.py mirrors it) go `locks/<lock>.txt` (cpu, cuda12, tpu: every pin,
compiled by `uv pip compile` for the fleet's Python and manylinux x86_64) and, for firewalled fleets,
`wheelhouse/<lock>/` (those exact wheels, and uv and the build backend, from `pip download`), so that
every machine installs the same versions, with no index at all if need be (startup/startup.sh).
`upload_code` does both halves: the checkout, then this environment.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from fleet.codesync import GENERATED, CodeSyncError, mirror, sync_code

log = logging.getLogger(__name__)

#: What each lock installs beside the package and its extras (startup.sh maps spawn-accelerator to it).
LOCKS = {"cpu": "jax", "cuda12": "jax[cuda12]", "tpu": "jax[tpu]"}
#: The lock a machine installs, by its spawn-accelerator (startup/startup.sh's `case "$ACCELERATOR"`).
LOCK_OF_PLATFORM = {"cpu": "cpu", "gpu": "cuda12", "tpu": "tpu"}
#: The static uv binary startup.sh runs, under the code prefix (stage_uv).
UV_OBJECT = "uv/uv"
#: The machines' glibc. Every image the templates name is Ubuntu 22.04, whose libc6 is glibc 2.35
#: (https://packages.ubuntu.com/jammy/libc6): the TPU VM runtimes (`v2-alpha-tpuv5-lite`,
#: `v2-alpha-tpuv6e`, `tpu-ubuntu2204-base`; https://cloud.google.com/tpu/docs/runtimes) and
#: templates/vm.yaml's `ubuntu-accelerator-2204-amd64-with-nvidia-550` family. An image with an older
#: glibc (a Debian 11 Deep Learning VM has 2.31) needs `tools/upload_code.py --glibc 2.31`.
MACHINE_GLIBC = (2, 35)
#: Python 3.11's `packaging.tags` / PEP 600: a glibc 2.N machine accepts manylinux_2_5 .. manylinux_2_N,
#: and the legacy aliases manylinux1 (2.5), manylinux2010 (2.12) and manylinux2014 (2.17).
LEGACY_MANYLINUX = {"manylinux1": 5, "manylinux2010": 12, "manylinux2014": 17}


def uv_platform(glibc: tuple[int, int] = MACHINE_GLIBC) -> str:
    """uv's `--python-platform` for the machines: uv takes the newest glibc and accepts every older tag."""
    return f"x86_64-manylinux_{glibc[0]}_{glibc[1]}"


def pip_platforms(glibc: tuple[int, int] = MACHINE_GLIBC) -> tuple[str, ...]:
    """Every platform tag a glibc `glibc` x86_64 machine accepts, newest first. pip matches
    `--platform` tags exactly (https://pip.pypa.io/en/stable/cli/pip_download/#cmdoption-platform),
    so all of them are passed: a wheel tagged manylinux_2_31 only is found only if that tag is named."""
    major, minor = glibc
    if major != 2 or minor < 17:
        raise CodeSyncError(f"glibc {major}.{minor}: the machines must have glibc 2.17 or newer")
    tags = [f"manylinux_2_{n}_x86_64" for n in range(minor, 4, -1)]
    tags += [f"{alias}_x86_64" for alias in LEGACY_MANYLINUX]  # all at or below 2.17
    return tuple(tags)


UV_PLATFORM = uv_platform()
PIP_PLATFORMS = pip_platforms()

def requirements_of(source: Path, extras: Sequence[str], accelerator_req: str) -> list[str]:
    """What a machine installs: install_requires, the extras' requirements, and the JAX variant.
    Read from setup.cfg, the package's one schema of its dependencies."""
    import configparser

    config = configparser.ConfigParser()
    if not config.read(source / "setup.cfg"):
        raise CodeSyncError(f"{source / 'setup.cfg'} is missing; the locks are compiled from it")

    def lines(section: str, key: str) -> list[str]:
        raw = config.get(section, key, fallback="")
        return [line.strip() for line in raw.splitlines() if line.strip() and not line.strip().startswith("#")]

    reqs = lines("options", "install_requires")
    for extra in extras:
        if not config.has_option("options.extras_require", extra):
            raise CodeSyncError(f"setup.cfg has no extra {extra!r} (options.extras_require)")
        reqs += lines("options.extras_require", extra)
    return [*reqs, accelerator_req]


def uv_command() -> list[str]:
    uv = shutil.which("uv")
    if uv:
        return [uv]
    import sys

    return [sys.executable, "-m", "uv"]


def uv_version() -> str:
    """The version of the uv that compiles the locks here: the one the machines get, by default."""
    out = subprocess.run([*uv_command(), "--version"], capture_output=True, text=True, check=False)
    match = re.match(r"uv (\d+\.\d+\.\d+)", out.stdout)
    if out.returncode != 0 or not match:
        raise CodeSyncError(f"`uv --version` answered {out.returncode}: {(out.stdout + out.stderr).strip()[:200]}")
    return match.group(1)


def _run(argv: Sequence[str], what: str, cwd: Path | None = None) -> str:
    log.info("event=%s argv=%s", what, " ".join(argv))
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False, cwd=cwd)
    if result.returncode != 0:
        raise CodeSyncError(f"{what}: {' '.join(argv[:4])} ... exited with {result.returncode}: {result.stderr.strip()[-2000:]}")
    return result.stdout


def compile_lock(
    requirements: Sequence[str],
    out: Path,
    python_version: str,
    platform: str | None = UV_PLATFORM,
    index_args: Sequence[str] = (),
) -> Path:
    """`uv pip compile` the requirements into a complete, pinned lock for the machines' Python and
    platform (https://docs.astral.sh/uv/reference/cli/#uv-pip-compile--python-platform). The same
    requirements give the same bytes wherever `out` is: uv annotates each pin with the requirements
    file it came from (`# via -r FILE`), so the file is named relative to the lock's directory, not
    by the scratch directory's path (which would make every upload a new lock, and a new install on
    every machine that reboots: startup.sh keys its install on the lock's hash)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    source = out.with_suffix(".in")
    source.write_text("\n".join(requirements) + "\n")
    argv = [*uv_command(), "pip", "compile", source.name, "--output-file", out.name, "--no-header",
            "--python-version", python_version, *index_args]
    if platform:
        argv += ["--python-platform", platform]
    _run(argv, "lock_compile", cwd=out.parent)
    source.unlink()
    return out


def pins(lock: Path) -> dict[str, str]:
    """Normalised project name -> pinned version, from a lock's `name==version` lines."""
    found = {}
    for line in lock.read_text().splitlines():
        requirement = line.split("#", 1)[0].split(";", 1)[0].strip()
        name, sep, version = requirement.partition("==")
        if sep:
            found[re.sub(r"[-_.]+", "-", name.split("[", 1)[0]).lower()] = version.strip()
    return found


def _pip_for_machines(subcommand: str, python_version: str, platforms: Sequence[str], index_args: Sequence[str]) -> list[str]:
    """`pip SUBCOMMAND` with the options that pick wheels for the machines rather than for this one."""
    import sys

    argv = [sys.executable, "-m", "pip", subcommand, "--quiet", "--only-binary=:all:", "--python-version", python_version,
            *index_args]
    for platform in platforms:
        argv += ["--platform", platform]
    return argv


def check_wheels(
    lock: Path, python_version: str, glibc: tuple[int, int] = MACHINE_GLIBC, index_args: Sequence[str] = ()
) -> None:
    """Raise CodeSyncError unless every pin of `lock` has a wheel that a glibc `glibc` x86_64 machine
    accepts: `uv pip install --dry-run --only-binary :all:` for that platform, which downloads no
    wheel (https://docs.astral.sh/uv/reference/cli/#uv-pip-install--dry-run). Seconds, for any lock."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="check-wheels-") as scratch:
        # --target: an install into no environment at all, for another platform.
        _run([*uv_command(), "pip", "install", "--quiet", "--dry-run", "--no-deps", "--only-binary", ":all:",
              "--python-version", python_version, "--python-platform", uv_platform(glibc), *index_args,
              "--target", scratch, "--requirement", str(lock)], "wheel_check")


def download_wheelhouse(
    lock: Path,
    dest: Path,
    python_version: str,
    also: Sequence[str] = ("setuptools>=68", "wheel"),
    platforms: Sequence[str] = PIP_PLATFORMS,
    index_args: Sequence[str] = (),
) -> Path:
    """Every wheel of `lock` (and `also`: the build backend for the editable install) for the
    machines' platform and Python, with `pip download --only-binary=:all:`."""
    dest.mkdir(parents=True, exist_ok=True)
    download = [*_pip_for_machines("download", python_version, platforms, index_args), "--dest", str(dest)]
    # The lock is complete: its pins alone. `also` is not locked: its dependencies come along
    # (wheel needs packaging, for one).
    _run([*download, "--no-deps", "--requirement", str(lock)], "wheelhouse_download")
    if also:
        _run([*download, *also], "wheelhouse_download")
    return dest


#: uv's statically linked build (musl, `static-pie`): it runs on any x86_64 Linux, whatever its glibc,
#: and is published on the package index as uv's musllinux wheel (https://docs.astral.sh/uv/getting-started/installation/).
UV_WHEEL_PLATFORM = "musllinux_1_1_x86_64"


def stage_uv(staging: Path, version: str, python_version: str = "3.11", index_args: Sequence[str] = ()) -> Path:
    """`uv/uv` (the static binary of uv `version`) and `uv/VERSION` under `staging`: what startup.sh
    runs instead of bootstrapping uv with the image's python3 -m venv (which needs python3-venv)."""
    import tempfile
    import zipfile

    dest = staging / "uv"
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="uv-wheel-") as scratch:
        _run([*_pip_for_machines("download", python_version, (UV_WHEEL_PLATFORM,), index_args), "--dest", scratch,
              "--no-deps", f"uv=={version}"], "uv_download")
        [wheel] = Path(scratch).glob("uv-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            member = f"uv-{version}.data/scripts/uv"
            if member not in archive.namelist():
                raise CodeSyncError(f"{wheel.name} has no {member}; cannot stage the uv binary")
            (dest / "uv").write_bytes(archive.read(member))
    (dest / "uv").chmod(0o755)
    (dest / "VERSION").write_text(version + "\n")
    log.info("event=uv_staged version=%s path=%s", version, dest / "uv")
    return dest


#: The interpreter the machines provision (startup.sh: `uv python install`, `uv venv --managed-python`):
#: a python-build-standalone CPython for x86_64 Linux with glibc, as uv lists its downloads.
MACHINE_PYTHON = {"implementation": "cpython", "os": "linux", "arch": "x86_64", "libc": "gnu", "variant": "default"}


def stage_python_mirror(staging: Path, python_version: str, uv: Sequence[str]) -> Path:
    """`python-mirror/TAG/FILE` under `staging`: the archive that `uv` (the machines' uv) downloads for
    CPython `python_version` on the machines, laid out as uv reads a `file://` UV_PYTHON_INSTALL_MIRROR.

    uv replaces its download prefix with the mirror and keeps `TAG/FILE`; for a file:// mirror it
    percent-decodes the path, so `cpython-3.11.14%2B20251031-...` must be saved as `cpython-3.11.14+...`
    (where `curl -LO` would keep the `%2B`). The archive comes from wherever this uv downloads it
    (its default, or the UV_PYTHON_INSTALL_MIRROR and UV_PYTHON_DOWNLOADS_JSON_URL of this environment:
    uv's own settings, https://docs.astral.sh/uv/reference/environment/). A downloads list given by
    UV_PYTHON_DOWNLOADS_JSON_URL goes into the mirror as downloads.json, which startup.sh hands to uv.
    The mirror is then checked the way a machine uses it: `uv python install` from it into a scratch
    directory, which also checks the archive against uv's sha256."""
    import json
    import tempfile
    import urllib.parse
    import urllib.request

    listing = _run([*uv, "python", "list", python_version, "--only-downloads", "--show-urls", "--all-platforms",
                    "--output-format", "json"], "python_downloads")
    found = [entry for entry in json.loads(listing)
             if all(entry.get(key) == value for key, value in MACHINE_PYTHON.items()) and entry.get("url")]
    if not found:
        raise CodeSyncError(f"uv lists no CPython {python_version} download for x86_64 Linux (glibc); "
                            f"check --python or the downloads list (UV_PYTHON_DOWNLOADS_JSON_URL)")
    entry = max(found, key=lambda e: tuple(e["version_parts"].get(k, 0) for k in ("major", "minor", "patch")))
    relative = urllib.parse.unquote("/".join(entry["url"].split("/")[-2:]))  # TAG/FILE, as uv decodes it
    mirror = staging / "python-mirror"
    archive = mirror / relative
    archive.parent.mkdir(parents=True, exist_ok=True)
    log.info("event=python_download version=%s url=%s", entry["version"], entry["url"])
    try:
        with urllib.request.urlopen(entry["url"], timeout=300) as response, archive.open("wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
    except OSError as err:
        raise CodeSyncError(f"could not download {entry['url']} ({err}); set UV_PYTHON_INSTALL_MIRROR to a mirror "
                            f"this machine reaches, or make the python mirror on a machine that reaches it") from err
    downloads_json = os.environ.get("UV_PYTHON_DOWNLOADS_JSON_URL")
    if downloads_json:
        with urllib.request.urlopen(downloads_json if "://" in downloads_json else Path(downloads_json).resolve().as_uri(),
                                    timeout=60) as response:
            (mirror / "downloads.json").write_bytes(response.read())
    with tempfile.TemporaryDirectory(prefix="python-mirror-check-") as scratch:
        env = {**os.environ, "UV_PYTHON_INSTALL_MIRROR": mirror.resolve().as_uri(),
               "UV_PYTHON_INSTALL_DIR": scratch, "UV_CACHE_DIR": f"{scratch}/cache"}
        if downloads_json:
            env["UV_PYTHON_DOWNLOADS_JSON_URL"] = (mirror / "downloads.json").resolve().as_uri()
        check = subprocess.run([*uv, "python", "install", "--no-bin", entry["version"]], env=env,
                               capture_output=True, text=True, check=False)
        if check.returncode != 0:
            raise CodeSyncError(f"uv could not install CPython {entry['version']} from the mirror {mirror}: "
                                f"{check.stderr.strip()[-1000:]}")
    log.info("event=python_mirrored version=%s archive=python-mirror/%s bytes=%d", entry["version"], relative,
             archive.stat().st_size)
    return mirror


def build_environment(
    source: Path,
    staging: Path,
    python_version: str,
    extras: Sequence[str] = ("extract",),
    locks: Sequence[str] = tuple(LOCKS),
    wheelhouse: bool = False,
    index_args: Sequence[str] = (),
    glibc: tuple[int, int] = MACHINE_GLIBC,
    uv: str | None = None,
    python_mirror: bool = False,
) -> list[Path]:
    """locks/<lock>.txt (and wheelhouse/<lock>/) under `staging`, to upload next to the code, plus
    uv/ (the static uv binary, version `uv`) when `uv` is given, and python-mirror/ (the fleet's
    CPython, as that uv downloads it) when `python_mirror`. Each lock is resolved for the machines'
    glibc and checked to have a wheel they accept for every pin, so that a fleet never finds out at boot."""
    made = []
    for name in locks:
        if name not in LOCKS:
            raise CodeSyncError(f"unknown lock {name!r}; choose from {', '.join(LOCKS)}")
        lock = compile_lock(requirements_of(source, extras, LOCKS[name]), staging / "locks" / f"{name}.txt",
                            python_version, uv_platform(glibc), index_args)
        made.append(lock)
        check_wheels(lock, python_version, glibc, index_args)
        log.info("event=lock_compiled lock=%s pins=%d", name, len(pins(lock)))
        if wheelhouse:
            made.append(download_wheelhouse(lock, staging / "wheelhouse" / name, python_version,
                                            platforms=pip_platforms(glibc), index_args=index_args))
    if uv:
        made.append(stage_uv(staging, uv, python_version, index_args))
    if python_mirror:
        machines_uv = [str(staging / "uv" / "uv")] if uv else uv_command()
        made.append(stage_python_mirror(staging, python_version, machines_uv))
    return made


def upload_generated(staging: Path, dest_url: str, client=None, use_gcloud: bool | None = None, on_file=None) -> None:
    """Mirror each generated directory (locks/, wheelhouse/, python-mirror/, uv/) to dest_url/<dir>,
    deleting stale objects. Whole: the checkout's exclusions are not theirs (GENERATED's `uv` names the
    binary uv/uv too, and a wheel may be called anything)."""
    for name in GENERATED:
        directory = staging / name
        if directory.is_dir():
            mirror(directory, f"{dest_url.rstrip('/')}/{name}", client=client, use_gcloud=use_gcloud, on_file=on_file)


def environment_missing(store, platform: str) -> list[str]:
    """What a code prefix (an `objectstore` store opened on it) lacks for machines of `platform` (cpu, gpu, tpu):
    of `uv/uv` and `locks/<lock>.txt`, the names it does not hold. A prefix made by `upload_code` holds both;
    one made with `--no-locks` holds neither, and its machines install unpinned."""
    if platform not in LOCK_OF_PLATFORM:
        raise CodeSyncError(f"platform {platform!r}: expected one of {', '.join(LOCK_OF_PLATFORM)}")
    wanted = [UV_OBJECT, f"locks/{LOCK_OF_PLATFORM[platform]}.txt"]
    return [name for name in wanted if not any(e.name == name for e in store.list_page(name, page_size=1).entries)]


def upload_code(
    source: Path,
    dest_url: str,
    excludes: Sequence[str] = (),
    *,
    python_version: str = "3.11",
    extras: Sequence[str] = ("extract",),
    locks: Sequence[str] | None = tuple(LOCKS),
    wheelhouse: bool = False,
    glibc: tuple[int, int] = MACHINE_GLIBC,
    uv: str | None = None,
    python_mirror: bool = False,
    use_gcloud: bool | None = None,
    client=None,
    on_file=None,
) -> None:
    """What tools/upload_code.py and `gcs-spawner up` do: mirror the checkout (`sync_code`), then, unless `locks`
    is None, build the environment (the locks, uv/uv, and the wheelhouse and python mirror if asked) in a scratch
    directory and mirror it next to the code (`upload_generated`). Both halves delete what is stale, so running
    it again after an interruption finishes the job."""
    import tempfile

    sync_code(source, dest_url, excludes, client=client, use_gcloud=use_gcloud, on_file=on_file)
    if locks is None:
        return
    with tempfile.TemporaryDirectory(prefix="upload-code-") as staging:
        build_environment(source, Path(staging), python_version, extras=extras, locks=locks, wheelhouse=wheelhouse,
                          glibc=glibc, uv=uv or uv_version(), python_mirror=python_mirror)
        upload_generated(Path(staging), dest_url, client=client, use_gcloud=use_gcloud, on_file=on_file)

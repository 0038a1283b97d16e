"""tools/upload_code.py and fleet.codesync: the Python sync against the fake GCS server, the gcloud
path through a stub gcloud that records its argv and through the real gcloud against the fake
server, and the interpreter mirror through the real uv."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fleet import codesync, environment
from tests.cloud.conftest import StubBin
from tests.gcloudcli import require_gcloud, write_config

REPO = Path(__file__).resolve().parents[2]


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


CHECKOUT = {
    "spawn.py": "print('spawn')\n",
    "fleet/__init__.py": '"""fleet"""\n',
    ".git/config": "[core]\n",
    ".github/workflows/ci.yml": "on: push\n",
    ".venv/bin/python": "binary",
    "fleet/__pycache__/x.cpython-311.pyc": "bytecode",
    ".pytest_cache/v/cache": "{}",
    "gcs_spawner.egg-info/PKG-INFO": "Name: x\n",
    "data/train.parquet": "rows",
    "notes.tmp": "scratch",
    "tools/data/keep.json": "{}",
}
SYNCED = [".github/workflows/ci.yml", "fleet/__init__.py", "spawn.py", "tools/data/keep.json"]


@pytest.mark.parametrize(
    "path, excluded",
    [
        (".git/config", True), (".github/workflows/ci.yml", False), ("pkg/__pycache__/m.pyc", True),
        ("gcs_spawner.egg-info/PKG-INFO", True), ("a/b/.pytest_cache/x", True), (".venv", True),
        ("data/train.parquet", True), ("tools/data/keep.json", False), ("notes.tmp", True), ("spawn.py", False),
    ],
)
def test_exclude_regex_skips_caches_and_user_globs_only(path: str, excluded: bool):
    regex = codesync.exclude_regex([*codesync.DEFAULT_EXCLUDES, "data/*", "*.tmp"])
    assert "," not in regex  # gcloud splits --exclude at commas
    assert bool(re.match(regex, path)) is excluded


def _listing(client, bucket: str, prefix: str) -> dict[str, bytes]:
    return {b.name[len(prefix) + 1 :]: b.download_as_bytes() for b in client.list_blobs(bucket, prefix=prefix + "/")}


def test_python_sync_uploads_changes_only_and_deletes_what_is_gone(tmp_path: Path, gcs_bucket: str, gcs_client):
    src = _tree(tmp_path / "checkout", CHECKOUT)
    dest = f"gs://{gcs_bucket}/code/run1"
    bucket = gcs_client.bucket(gcs_bucket)
    bucket.blob("code/run10/spawn.py").upload_from_string(b"a sibling prefix, not ours")
    bucket.blob("code/run1/data/remote-only.parquet").upload_from_string(b"excluded, so left alone")

    first = codesync.sync_code(src, dest, ["data/*", "*.tmp"], client=gcs_client, use_gcloud=False)
    assert first.uploaded == SYNCED and first.deleted == [] and first.unchanged == 0
    listing = _listing(gcs_client, gcs_bucket, "code/run1")
    assert sorted(listing) == sorted([*SYNCED, "data/remote-only.parquet"])
    assert listing["spawn.py"] == CHECKOUT["spawn.py"].encode()

    second = codesync.sync_code(src, dest, ["data/*", "*.tmp"], client=gcs_client, use_gcloud=False)
    assert (second.uploaded, second.deleted, second.unchanged) == ([], [], len(SYNCED))

    (src / "spawn.py").write_text("print('spawn v2')\n")
    (src / "fleet" / "__init__.py").unlink()
    (src / "fleet" / "new.py").write_text("x = 1\n")
    third = codesync.sync_code(src, dest, ["data/*", "*.tmp"], client=gcs_client, use_gcloud=False)
    assert third.uploaded == ["fleet/new.py", "spawn.py"]
    assert third.deleted == ["fleet/__init__.py"]
    listing = _listing(gcs_client, gcs_bucket, "code/run1")
    assert listing["spawn.py"] == b"print('spawn v2')\n" and "fleet/__init__.py" not in listing
    assert "data/remote-only.parquet" in listing
    assert bucket.blob("code/run10/spawn.py").exists()


def test_upload_tool_without_gcloud_syncs_through_the_client(tmp_path: Path, gcs_bucket: str, gcs_client, no_gcloud_path: str):
    src = _tree(tmp_path / "checkout", CHECKOUT)
    env = {**os.environ, "PATH": no_gcloud_path, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "tools/upload_code.py", f"gs://{gcs_bucket}/code/x", "--source", str(src), "--exclude", "data/*",
         "--exclude", "*.tmp", "--no-locks"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "method=python" in result.stderr
    assert sorted(_listing(gcs_client, gcs_bucket, "code/x")) == SYNCED


def test_upload_tool_uses_gcloud_rsync_when_gcloud_is_on_path(tmp_path: Path, stubs: StubBin):
    stubs.add("gcloud")
    src = _tree(tmp_path / "checkout", {"spawn.py": "x\n"})
    env = {**os.environ, "PATH": f"{stubs.dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "tools/upload_code.py", "gs://bkt/code/run1/", "--source", str(src), "--exclude", "data/*",
         "--no-locks"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    [argv] = stubs.calls()
    regex = codesync.exclude_regex([*codesync.DEFAULT_EXCLUDES, "data/*"], codesync.GENERATED)
    assert argv == ["gcloud", "storage", "rsync", "--recursive", "--delete-unmatched-destination-objects",
                    "--checksums-only", f"--exclude={regex}", str(src), "gs://bkt/code/run1"]


@pytest.mark.parametrize("path", ["gcloud", "client"])
def test_upload_tool_puts_the_static_uv_binary_in_the_bucket_on_both_paths(
        path: str, tmp_path: Path, gcs, gcs_bucket: str, gcs_client, no_gcloud_path: str):
    """uv/uv (and uv/VERSION, locks/) reach the bucket through tools/upload_code.py itself: with the real
    gcloud pointed at the fake server, and with the Python client. The checkout's exclusions once
    applied to the generated uv/ folder too, and `uv` (GENERATED) matched the binary's own path."""
    src = _tree(tmp_path / "checkout", {"spawn.py": "x\n", "setup.cfg": "[metadata]\nname = tiny\n\n[options]\n",
                                        "pyproject.toml": ""})
    env = {**os.environ, "PYTHONPATH": str(REPO), "STORAGE_EMULATOR_HOST": gcs.url}
    if path == "gcloud":
        require_gcloud()
        env["CLOUDSDK_CONFIG"] = str(write_config(tmp_path / "gcloud-config", storage=gcs.url))
    else:
        env["PATH"] = no_gcloud_path
    result = subprocess.run(
        [sys.executable, "tools/upload_code.py", f"gs://{gcs_bucket}/code/run1", "--source", str(src), "--lock", "cpu",
         "--extras", ""], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert f"method={'gcloud' if path == 'gcloud' else 'python'}" in result.stderr
    listing = _listing(gcs_client, gcs_bucket, "code/run1")
    assert sorted(listing) == ["locks/cpu.txt", "pyproject.toml", "setup.cfg", "spawn.py", "uv/VERSION", "uv/uv"]
    version = environment.uv_version()
    assert listing["uv/VERSION"].decode().strip() == version
    fetched = tmp_path / "uv"
    fetched.write_bytes(listing["uv/uv"])
    fetched.chmod(0o755)
    assert subprocess.run([str(fetched), "--version"], capture_output=True, text=True, check=True).stdout.split()[:2] == [
        "uv", version]


def test_failing_gcloud_is_reported_with_its_exit_code(tmp_path: Path, stubs: StubBin):
    gcloud = stubs.add("gcloud", "exit 3\n")
    with pytest.raises(codesync.CodeSyncError, match="exited with 3"):
        codesync.sync_code(_tree(tmp_path / "c", {"a.py": ""}), "gs://bkt/code/x", gcloud=str(gcloud))


@pytest.mark.parametrize("dest", ["/local/dir", "gs://bucket-only", "gs://"])
def test_destination_must_be_a_bucket_prefix(tmp_path: Path, dest: str):
    with pytest.raises(codesync.CodeSyncError, match="gs://"):
        codesync.sync_code(tmp_path, dest, use_gcloud=False)


def test_git_ignored_files_are_not_uploaded(tmp_path: Path, gcs_bucket: str, gcs_client):
    src = _tree(tmp_path / "checkout", {
        ".gitignore": "/local-run/\n*.bin\n", "spawn.py": "x\n", "fleet/a.py": "a\n", "local-run/model/w.safetensors": "21 MB",
        "fleet/cache.bin": "blob", "untracked_new.py": "new\n",
    })
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run(["git", "-C", str(src), "add", "spawn.py", "fleet/a.py", ".gitignore"], check=True)
    codesync.sync_code(src, f"gs://{gcs_bucket}/code/g", client=gcs_client, use_gcloud=False)
    # Tracked and untracked-but-not-ignored files go; ignored ones (and .git) do not.
    assert sorted(_listing(gcs_client, gcs_bucket, "code/g")) == [".gitignore", "fleet/a.py", "spawn.py", "untracked_new.py"]


def _tiny_package(root: Path, name: str, version: str, deps: list[str]) -> Path:
    pkg = root / name
    (pkg / name).mkdir(parents=True)
    (pkg / name / "__init__.py").write_text(f"VERSION = {version!r}\n")
    requires = "".join(f"\n    {d}" for d in deps)
    (pkg / "setup.cfg").write_text(f"[metadata]\nname = {name}\nversion = {version}\n\n[options]\npackages = {name}\ninstall_requires ={requires}\n")
    (pkg / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n')
    return pkg


def test_locked_environment_installs_offline_from_a_wheelhouse_with_no_index(tmp_path: Path):
    """The upload side (uv pip compile, pip download) and the machine side (uv pip install
    --no-index --find-links) for this machine's platform, with two tiny wheels built here: no network."""
    index = tmp_path / "index"
    for name, version, deps in (("tinydep", "0.2.0", []), ("tinyapp", "0.1.0", ["tinydep>=0.2"])):
        pkg = _tiny_package(tmp_path / "src", name, version, deps)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                        "--wheel-dir", str(index), str(pkg)], check=True, capture_output=True)
    offline = ["--no-index", "--find-links", str(index)]
    python_version = f"{sys.version_info.major}.{sys.version_info.minor}"

    lock = environment.compile_lock(["tinyapp"], tmp_path / "stage" / "locks" / "cpu.txt", python_version,
                                 platform=None, index_args=offline)
    pins = sorted(line.split(" ")[0] for line in lock.read_text().splitlines() if "==" in line)
    assert pins == ["tinyapp==0.1.0", "tinydep==0.2.0"]

    import sysconfig
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    wheelhouse = environment.download_wheelhouse(lock, tmp_path / "stage" / "wheelhouse" / "cpu", python_version,
                                              also=(), platforms=(platform,), index_args=offline)
    assert sorted(p.name.split("-")[0] for p in wheelhouse.glob("*.whl")) == ["tinyapp", "tinydep"]

    # The machine: a fresh virtualenv and exactly the lock, from the wheelhouse alone.
    uv = environment.uv_command()
    venv = tmp_path / "venv"
    subprocess.run([*uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, capture_output=True)
    env = {**os.environ, "UV_NO_CACHE": "1"}
    subprocess.run([*uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), "--no-index",
                    "--find-links", str(wheelhouse), "--requirement", str(lock)], check=True, capture_output=True, env=env)
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import tinyapp, tinydep; print(tinyapp.VERSION, tinydep.VERSION)"],
                         check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["0.1.0", "0.2.0"]


def test_requirements_of_reads_setup_cfg_extras_and_the_jax_variant():
    reqs = environment.requirements_of(REPO, ["extract"], environment.LOCKS["tpu"])
    assert reqs[-1] == "jax[tpu]"
    assert any(r.startswith("google-cloud-tpu") for r in reqs) and any(r.startswith("flax") for r in reqs)
    with pytest.raises(codesync.CodeSyncError, match="no extra 'gpu'"):
        environment.requirements_of(REPO, ["gpu"], "jax")


# ---- the real locks, resolved against the package index as tools/upload_code.py does ----------

#: `heartbeat_timeout_seconds` of jax.distributed.initialize (extract/multihost.py passes it) first
#: appears in jax 0.7.0's jax/_src/distributed.py; 0.6.2's has no such parameter (both read from the
#: published wheels).
FIRST_JAX_WITH_HEARTBEAT_TIMEOUT = "0.7.0"


def _floor(requirement: str) -> str:
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    [line] = [r.strip() for r in config.get("options.extras_require", "extract").splitlines()
              if re.match(rf"{requirement}\s*>=", r.strip())]
    return line.split(">=", 1)[1].strip()


def _machine_tags(python: tuple[int, int], glibc: tuple[int, int]) -> set:
    """The tags a CPython `python` x86_64 machine with glibc `glibc` accepts, as pip decides it
    (packaging, which pip vendors), independently of fleet.codesync's own list."""
    from unittest import mock

    from packaging import _manylinux, tags

    _manylinux._get_glibc_version.cache_clear()
    with mock.patch.object(_manylinux, "_get_glibc_version", return_value=glibc):
        platforms = list(_manylinux.platform_tags(["x86_64"]))
    _manylinux._get_glibc_version.cache_clear()
    return {*tags.cpython_tags(python, platforms=platforms), *tags.compatible_tags(python, platforms=platforms)}


def test_pip_platforms_name_every_manylinux_tag_a_glibc_2_35_machine_accepts():
    expected = {str(tag.platform) for tag in _machine_tags((3, 11), (2, 35))} - {"any"}
    assert set(environment.pip_platforms((2, 35))) == expected
    assert "manylinux_2_31_x86_64" in environment.PIP_PLATFORMS and environment.UV_PLATFORM == "x86_64-manylinux_2_35"


def _jax_metadata(version: str, scratch: Path) -> dict:
    """jax `version`'s core metadata, from pip's installation report (no wheel downloaded)."""
    import json

    report = scratch / "jax-report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--no-deps",
                    "--target", str(scratch / "t"), "--report", str(report), f"jax=={version}"],
                   check=True, capture_output=True, timeout=120)
    [jax] = json.loads(report.read_text())["install"]
    return jax["metadata"]


def test_real_locks_hold_a_current_jax_and_every_pin_has_a_wheel_the_machines_accept(tmp_path: Path):
    """The cpu, cuda12 and tpu locks of this checkout, compiled and checked (every pin has a wheel for
    glibc 2.35, environment.check_wheels) by build_environment exactly as upload_code runs it."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    environment.build_environment(REPO, tmp_path, "3.11")
    held = {name: {p: Version(v) for p, v in environment.pins(tmp_path / "locks" / f"{name}.txt").items()}
            for name in environment.LOCKS}
    floor = Version(_floor("jax"))
    assert floor >= Version(FIRST_JAX_WITH_HEARTBEAT_TIMEOUT), "setup.cfg's jax floor lacks heartbeat_timeout_seconds"
    for name, versions in held.items():
        assert versions["jax"] >= floor and versions["jaxlib"] >= floor, (name, versions["jax"], versions["jaxlib"])
    # The machines' platform never holds the TPU lock back: it holds the jax every other lock holds,
    # and the libtpu that this jax's `tpu` extra asks for.
    assert held["tpu"]["jax"] == held["cpu"]["jax"] == held["cuda12"]["jax"]
    wanted = [Requirement(r) for r in _jax_metadata(str(held["tpu"]["jax"]), tmp_path)["requires_dist"]]
    libtpu = [r for r in wanted if r.name == "libtpu" and r.marker and r.marker.evaluate({"extra": "tpu"})]
    assert libtpu and all(held["tpu"]["libtpu"] in r.specifier for r in libtpu), (held["tpu"]["libtpu"], libtpu)
    assert "jax-cuda12-plugin" in held["cuda12"] and "libtpu" not in held["cpu"]
    # What glibc 2.28 (the old target) could not run: the check refuses the tpu lock there.
    with pytest.raises(codesync.CodeSyncError, match="libtpu"):
        environment.check_wheels(tmp_path / "locks" / "tpu.txt", "3.11", glibc=(2, 28))
    print({name: {p: str(versions[p]) for p in ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt")
                  if p in versions} for name, versions in held.items()})


def _elf_interpreter(binary: bytes) -> bool:
    """Whether an x86_64 ELF file names a dynamic loader (a PT_INTERP program header)."""
    import struct

    assert binary[:4] == b"\x7fELF" and binary[4] == 2  # ELF, 64-bit
    (phoff,) = struct.unpack_from("<Q", binary, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", binary, 0x36)
    return any(struct.unpack_from("<I", binary, phoff + i * phentsize)[0] == 3 for i in range(phnum))


def test_upload_stages_the_static_uv_binary_of_the_pinned_version(tmp_path: Path):
    version = environment.uv_version()
    staged = environment.stage_uv(tmp_path, version)
    binary = staged / "uv"
    assert (staged / "VERSION").read_text().strip() == version
    assert not _elf_interpreter(binary.read_bytes()), "uv/uv needs a dynamic loader; the machines' glibc would matter"
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=True, env={"PATH": ""})
    assert out.stdout.split()[:2] == ["uv", version]


def test_python_mirror_is_laid_out_as_uv_reads_it_and_installs_from_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """upload_code's --python-mirror, end to end through the real uv: the archive uv lists for the fleet's
    CPython is downloaded from wherever uv is told to download (here a local server standing in for the
    release host, with a stand-in archive: tests/boot/standin_python.py) into TAG/FILE with `%2B` decoded,
    and uv installs from that file:// mirror (stage_python_mirror checks it so). The same archive saved
    under the URL's own name, as `curl -LO` saves it, is not found."""
    import functools
    import http.server
    import threading

    from tests.boot import standin_python

    if not list(Path("/usr/bin").glob("python3.1[1-9]")):
        pytest.skip("needs the distribution's python3.11+ (/usr/bin) to build the stand-in archive")
    release = tmp_path / "release"
    archive, listing, version = standin_python.write(Path("/"), release / standin_python.TAG)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(release))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("UV_PYTHON_INSTALL_MIRROR", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setenv("UV_PYTHON_DOWNLOADS_JSON_URL", listing.as_uri())
        mirror = environment.stage_python_mirror(tmp_path / "staging", version.rsplit(".", 1)[0], environment.uv_command())
    finally:
        server.shutdown()
    saved = mirror / standin_python.TAG / standin_python.archive_name(version)
    assert "+" in saved.name and saved.read_bytes() == archive.read_bytes()
    assert json.loads((mirror / "downloads.json").read_text()) == json.loads(listing.read_text())

    # The machine's side with the name `curl -LO` gives: uv looks for the decoded name and fails.
    saved.rename(saved.with_name(saved.name.replace("+", "%2B")))
    env = {**os.environ, "UV_PYTHON_INSTALL_MIRROR": mirror.as_uri(), "UV_PYTHON_INSTALL_DIR": str(tmp_path / "py"),
           "UV_PYTHON_DOWNLOADS_JSON_URL": (mirror / "downloads.json").as_uri(), "UV_CACHE_DIR": str(tmp_path / "c")}
    curl_named = subprocess.run([*environment.uv_command(), "python", "install", "--no-bin", version], env=env,
                                capture_output=True, text=True)
    assert curl_named.returncode != 0 and "No such file" in curl_named.stderr + curl_named.stdout

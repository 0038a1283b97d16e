"""tools/upload_code.py and fleet.codesync: the Python sync against the fake GCS server, and the
gcloud path through a stub gcloud that records its argv."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fleet import codesync
from tests.cloud.conftest import StubBin

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
    env = {**os.environ, "PATH": no_gcloud_path}
    result = subprocess.run(
        [sys.executable, "tools/upload_code.py", f"gs://{gcs_bucket}/code/x", "--source", str(src), "--exclude", "data/*",
         "--exclude", "*.tmp"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "method=python" in result.stderr
    assert sorted(_listing(gcs_client, gcs_bucket, "code/x")) == SYNCED


def test_upload_tool_uses_gcloud_rsync_when_gcloud_is_on_path(tmp_path: Path, stubs: StubBin):
    stubs.add("gcloud")
    src = _tree(tmp_path / "checkout", {"spawn.py": "x\n"})
    env = {**os.environ, "PATH": f"{stubs.dir}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        [sys.executable, "tools/upload_code.py", "gs://bkt/code/run1/", "--source", str(src), "--exclude", "data/*"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    [argv] = stubs.calls()
    regex = codesync.exclude_regex([*codesync.DEFAULT_EXCLUDES, "data/*"])
    assert argv == ["gcloud", "storage", "rsync", "--recursive", "--delete-unmatched-destination-objects",
                    f"--exclude={regex}", str(src), "gs://bkt/code/run1"]


def test_failing_gcloud_is_reported_with_its_exit_code(tmp_path: Path, stubs: StubBin):
    gcloud = stubs.add("gcloud", "exit 3\n")
    with pytest.raises(codesync.CodeSyncError, match="exited with 3"):
        codesync.sync_code(_tree(tmp_path / "c", {"a.py": ""}), "gs://bkt/code/x", gcloud=str(gcloud))


@pytest.mark.parametrize("dest", ["/local/dir", "gs://bucket-only", "gs://"])
def test_destination_must_be_a_bucket_prefix(tmp_path: Path, dest: str):
    with pytest.raises(codesync.CodeSyncError, match="gs://"):
        codesync.sync_code(tmp_path, dest, use_gcloud=False)

"""The fake GCS server answering the real `gcloud storage` (Google Cloud CLI), as every machine's boot
and tools/upload_code.py use it: rsync both ways with its hash comparisons, multipart, resumable and
parallel composite uploads, sliced downloads, listings, cp from stdin with custom metadata, rm -r,
and the bucket commands docs/CLOUD.md shows. The strict preconditions stay: a create-if-absent that
finds the object is refused, and what the fake cannot emulate is a 400 naming it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.gcloudcli import Gcloud, write_config

# Small thresholds, so that small files take gcloud's resumable, parallel composite and sliced
# paths (https://cloud.google.com/sdk/gcloud/reference/topic/configurations, storage/*_threshold).
# Components stay above the resumable threshold, as with the defaults: gcloud deletes the
# temporary components it finds through their resumable uploads' tracker files, so components
# small enough for a multipart upload would be left in the bucket (read in gcloud 528's
# command_lib/storage/tasks/cp/delete_temporary_components_task.py, and seen against this server).
SMALL_THRESHOLDS = {
    "CLOUDSDK_STORAGE_RESUMABLE_THRESHOLD": "1MiB",
    "CLOUDSDK_STORAGE_PARALLEL_COMPOSITE_UPLOAD_ENABLED": "True",
    "CLOUDSDK_STORAGE_PARALLEL_COMPOSITE_UPLOAD_THRESHOLD": "3MiB",
    "CLOUDSDK_STORAGE_PARALLEL_COMPOSITE_UPLOAD_COMPONENT_SIZE": "2MiB",
    "CLOUDSDK_STORAGE_SLICED_OBJECT_DOWNLOAD_THRESHOLD": "1MiB",
    "CLOUDSDK_STORAGE_SLICED_OBJECT_DOWNLOAD_COMPONENT_SIZE": "1MiB",
}


@pytest.fixture
def gcloud(gcs, tmp_path: Path) -> Gcloud:
    return Gcloud(write_config(tmp_path / "gcloud-config", storage=gcs.url))


def _tree(root: Path) -> dict[str, bytes]:
    files = {
        "spawn.py": b"print('spawn')\n",
        "fleet/__init__.py": b"",
        "uv/uv": os.urandom(64 * 1024),  # a name that is also a directory's
        "wheelhouse/cpu/big-1.0-py3-none-any.whl": os.urandom(3 * 1024 * 1024 + 17),  # composite upload
        "wheelhouse/cpu/mid-1.0-py3-none-any.whl": os.urandom(1536 * 1024),  # resumable upload
        "wheelhouse/tpu/libtpu-0.0.1-py3-none-any.whl": os.urandom(1024),
        "docs/ünïcode name.md": "héllo\n".encode(),
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_gcloud_rsync_mirrors_a_tree_up_and_down_byte_identical_and_skips_what_is_unchanged(
        gcloud: Gcloud, gcs, gcs_bucket: str, tmp_path: Path):
    files = _tree(tmp_path / "src")
    url = f"gs://{gcs_bucket}/code/run1"
    gcloud("storage", "rsync", "--recursive", "--delete-unmatched-destination-objects", str(tmp_path / "src"), url,
           env=SMALL_THRESHOLDS)
    listing = gcloud("storage", "ls", "-r", f"gs://{gcs_bucket}/**").stdout.decode().splitlines()
    assert sorted(listing) == sorted(f"{url}/{rel}" for rel in files)
    # No component of the composite upload is left behind.
    assert not [name for name in gcs.storage.buckets[gcs_bucket].names if not name.startswith("code/run1/")]

    # Down, as startup.sh syncs a machine: only one lock's wheelhouse, and stale files deleted.
    dest = tmp_path / "machine"
    (dest / "wheelhouse" / "cpu").mkdir(parents=True)
    (dest / "wheelhouse" / "cpu" / "stale-0.1-py3-none-any.whl").write_bytes(b"old")
    gcloud("storage", "rsync", "--recursive", "--delete-unmatched-destination-objects", "--exclude=wheelhouse/(?!cpu/)",
           url, str(dest), env=SMALL_THRESHOLDS)
    assert _files(dest) == {rel: data for rel, data in files.items() if not rel.startswith("wheelhouse/tpu/")}

    # Again, unchanged: rsync compares (size, then crc32c/md5 from the listing) and writes nothing.
    gcs.reset_counts()
    gcloud("storage", "rsync", "--recursive", "--delete-unmatched-destination-objects", str(tmp_path / "src"), url)
    assert gcs.counts()["writes"] == 0 and gcs.counts()["deletes"] == 0
    # A changed file of the same size is uploaded again, a removed one deleted.
    (tmp_path / "src" / "spawn.py").write_bytes(b"print('SPAWN')\n")
    (tmp_path / "src" / "fleet" / "__init__.py").unlink()
    gcloud("storage", "rsync", "--recursive", "--delete-unmatched-destination-objects", str(tmp_path / "src"), url)
    assert gcs.counts()["writes"] == 1 and gcs.counts()["deletes"] == 1
    blob = gcs.storage.buckets[gcs_bucket].objects
    assert blob["code/run1/spawn.py"].data == b"print('SPAWN')\n" and "code/run1/fleet/__init__.py" not in blob


def test_gcloud_cp_from_stdin_keeps_content_type_and_custom_metadata_as_machine_records_need(
        gcloud: Gcloud, gcs_bucket: str, gcs_client):
    # What startup.sh's record() sends (values lose ',' and '=': gcloud splits at them).
    body = json.dumps({"machine": "w-1", "state": "booting"}).encode()
    url = f"gs://{gcs_bucket}/jobs/j/machines/w-1.json"
    gcloud("storage", "cp", "--content-type=application/json",
           "--custom-metadata=state=booting,code=gs://b/code/run1,at=2026-11-25T01:00:00+00:00", "-", url, stdin=body)
    blob = gcs_client.bucket(gcs_bucket).get_blob("jobs/j/machines/w-1.json")
    assert blob.download_as_bytes() == body and blob.content_type == "application/json"
    assert blob.metadata == {"state": "booting", "code": "gs://b/code/run1", "at": "2026-11-25T01:00:00+00:00"}
    described = gcloud("storage", "ls", "-L", url).stdout.decode()  # what a person checks the record with
    assert '"state": "booting"' in described and "application/json" in described
    # Overwritten, as every change of state does.
    gcloud("storage", "cp", "--custom-metadata=state=installing", "-", url, stdin=b"{}")
    assert gcs_client.bucket(gcs_bucket).get_blob("jobs/j/machines/w-1.json").metadata == {"state": "installing"}


def test_gcloud_keeps_the_strict_preconditions_and_downloads_what_it_uploaded(gcloud: Gcloud, gcs_bucket: str,
                                                                              tmp_path: Path):
    source = tmp_path / "uv"
    source.write_bytes(os.urandom(2 * 1024 * 1024 + 5))
    url = f"gs://{gcs_bucket}/code/run1/uv/uv"
    gcloud("storage", "cp", "--if-generation-match=0", str(source), url)
    again = gcloud("storage", "cp", "--if-generation-match=0", str(source), url, check=False)
    assert again.returncode != 0 and b"412" in again.stderr  # create-if-absent found the object
    # The docs' way to fetch the bucket's uv, sliced into ranged reads.
    gcloud("storage", "cp", url, str(tmp_path / "fetched"), env=SMALL_THRESHOLDS)
    assert (tmp_path / "fetched").read_bytes() == source.read_bytes()
    gcloud("storage", "rm", "-r", f"gs://{gcs_bucket}/code")
    assert gcloud("storage", "ls", f"gs://{gcs_bucket}").stdout.strip() == b""


def test_gcloud_bucket_commands_of_the_docs_create_and_grant(gcloud: Gcloud, gcs):
    # docs/CLOUD.md, "APIs, credentials, the bucket" and "IAM and scopes".
    gcloud("storage", "buckets", "create", "gs://docs-bucket-gcloud", "--location", "us-west4",
           "--uniform-bucket-level-access")
    member = "serviceAccount:spawn-worker@p.iam.gserviceaccount.com"
    gcloud("storage", "buckets", "add-iam-policy-binding", "gs://docs-bucket-gcloud", "--member", member,
           "--role", "roles/storage.objectUser")
    described = json.loads(gcloud("storage", "buckets", "describe", "gs://docs-bucket-gcloud", "--format=json").stdout)
    assert (described["location"], described["uniform_bucket_level_access"]) == ("US-WEST4", True)
    bucket = gcs.storage.buckets["docs-bucket-gcloud"]
    assert bucket.bindings == [{"members": [member], "role": "roles/storage.objectUser"}]


def test_what_the_fake_cannot_emulate_is_a_400_that_names_it(gcloud: Gcloud, gcs_bucket: str):
    gcloud("storage", "cp", "-", f"gs://{gcs_bucket}/a", stdin=b"a")
    copied = gcloud("storage", "cp", f"gs://{gcs_bucket}/a", f"gs://{gcs_bucket}/b", check=False)
    assert copied.returncode != 0 and b"400" in copied.stderr and b"rewriteTo (a copy inside the store) is not emulated" in copied.stderr

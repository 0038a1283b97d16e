"""Code sync: mirroring this checkout to a bucket prefix, which every machine syncs its code from at boot.

With gcloud on PATH the work is done by `gcloud storage rsync`; without it, by a small
checksum-comparing sync on google-cloud-storage. Both skip the same things (one regular
expression, built from globs, serves both) and both delete objects whose files are gone. In a
git checkout, files git ignores (`local-run/`, models, queues) are skipped too. The pinned
environment the machines install, which goes next to the code (GENERATED), is fleet/environment.py's.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

import google_crc32c
from google.cloud import storage

from exitcodes import EX_FAILED
from objectstore import BadAddress, split_gs

log = logging.getLogger(__name__)

# Never needed on a worker, and some of them are large.
DEFAULT_EXCLUDES = (
    ".git",
    ".venv",
    "venv",
    "__pycache__",
    "*.pyc",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".ipynb_checkpoints",
    "*.egg-info",
    "build",
    "dist",
    ".DS_Store",
)


class CodeSyncError(Exception):
    """The sync could not run or did not finish; the message names the command or object."""

    exit_code = EX_FAILED  # what a command that ends on it exits with (gcs_spawner/cli.py)


#: Written by upload_code (fleet/environment.py) next to the code, never part of the mirrored checkout (and never deleted by it).
GENERATED = ("locks", "wheelhouse", "python-mirror", "uv")



def _glob_regex(glob: str) -> str:
    out = []
    for ch in glob:
        out.append("[^/]*" if ch == "*" else "[^/]" if ch == "?" else re.escape(ch))
    return "".join(out)


def exclude_regex(globs: Iterable[str], paths: Iterable[str] = ()) -> str:
    """One regular expression, matched from the start of a relative path (as gcloud does).

    A glob without '/' matches any single path component (`*.egg-info`, `.git`); a glob with '/'
    matches from the top (`data/*.parquet`). Either way everything under a match goes too."""
    parts = []
    for glob in globs:
        glob = glob.strip().strip("/")
        if not glob:
            continue
        if "/" in glob:
            parts.append(f"{_glob_regex(glob)}(/.*)?$")
        else:
            parts.append(f"(.*/)?{_glob_regex(glob)}(/.*)?$")
    # Exact relative paths (from git), each with everything under it.
    parts += [f"{re.escape(p.strip('/'))}(/.*)?$" for p in paths if p.strip("/")]
    # gcloud splits --exclude at commas, so alternatives are joined with '|' into one pattern.
    return "|".join(f"(?:{p})" for p in parts)


def destination(url: str) -> tuple[str, str]:
    """The bucket and prefix of a code destination (`objectstore.split_gs`). A whole bucket is refused:
    a mirror deletes every object under its prefix that the checkout does not have."""
    try:
        bucket, prefix = split_gs(url, "destination")
    except BadAddress as err:
        raise CodeSyncError(str(err)) from None
    if not prefix:
        raise CodeSyncError(f"destination {url!r} needs a bucket and a prefix, e.g. gs://my-bucket/code/run1")
    return bucket, prefix


def git_ignored(root: Path) -> list[str]:
    """Paths under `root` that git ignores (whole directories collapsed), or [] outside a git checkout.

    `git ls-files --others --ignored --exclude-standard --directory` names exactly what
    `git ls-files --cached --others --exclude-standard` (what git would upload) leaves out."""
    git = shutil.which("git")
    if not git or not (root / ".git").exists():
        return []
    inside = subprocess.run([git, "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=False)
    if inside.returncode != 0 or Path(inside.stdout.strip()).resolve() != root.resolve():
        return []  # not a checkout of its own (a stray .git, or a subdirectory of another repository)
    result = subprocess.run(
        [git, "-C", str(root), "ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory"],
        capture_output=True, check=False,
    )
    if result.returncode != 0:
        raise CodeSyncError(f"git ls-files in {root} failed: {result.stderr.decode(errors='replace').strip()}")
    return [p.rstrip("/") for p in result.stdout.decode().split("\0") if p]


def local_files(root: Path, excludes: Sequence[str], ignored: Sequence[str] = ()) -> dict[str, Path]:
    """Relative POSIX path -> file, for every regular file not excluded (symlinks skipped, as gcloud does)."""
    pattern = re.compile(exclude_regex(excludes, ignored)) if (excludes or ignored) else None
    files = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = sorted(
            d for d in dirnames
            if not os.path.islink(os.path.join(dirpath, d)) and not (pattern and pattern.match(rel_dir + d))
        )
        for name in filenames:
            rel, path = rel_dir + name, Path(dirpath, name)
            if path.is_symlink() or not path.is_file() or (pattern and pattern.match(rel)):
                continue
            files[rel] = path
    return files


def _crc32c_b64(path: Path) -> str:
    checksum = google_crc32c.Checksum()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            checksum.update(chunk)
    return base64.b64encode(checksum.digest()).decode()


def _md5_b64(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return base64.b64encode(digest.digest()).decode()


def _same(path: Path, crc32c: str | None, md5: str | None) -> bool:
    if crc32c:
        return _crc32c_b64(path) == crc32c
    if md5:
        return _md5_b64(path) == md5
    return False


@dataclasses.dataclass
class SyncReport:
    uploaded: list[str] = dataclasses.field(default_factory=list)
    deleted: list[str] = dataclasses.field(default_factory=list)
    unchanged: int = 0


def sync_with_client(
    source: Path, dest_url: str, excludes: Sequence[str], client, parallel: int = 8, ignored: Sequence[str] = (),
    on_file=None,
) -> SyncReport:
    """Upload new or changed files (by crc32c, or md5 where the listing has no crc32c) and delete
    objects under the prefix that no longer have a file. Excluded names are left alone remotely.
    `on_file(relative path, bytes)`, when given, is called after each upload (a progress bar)."""
    bucket_name, prefix = destination(dest_url)
    bucket = client.bucket(bucket_name)
    files = local_files(source, excludes, ignored)
    pattern = re.compile(exclude_regex(excludes, ignored)) if (excludes or ignored) else None
    remote = {}
    for blob in client.list_blobs(bucket_name, prefix=prefix + "/"):
        remote[blob.name[len(prefix) + 1 :]] = (blob.crc32c, blob.md5_hash)
    report = SyncReport()
    to_upload = []
    for rel, path in sorted(files.items()):
        if rel in remote and _same(path, *remote[rel]):
            report.unchanged += 1
        else:
            to_upload.append(rel)
    to_delete = sorted(rel for rel in remote if rel not in files and not (pattern and pattern.match(rel)))

    def upload(rel: str) -> None:
        bucket.blob(f"{prefix}/{rel}").upload_from_filename(str(files[rel]), checksum="crc32c")
        log.info("event=code_uploaded object=gs://%s/%s/%s", bucket_name, prefix, rel)
        if on_file is not None:
            on_file(rel, files[rel].stat().st_size)

    def delete(rel: str) -> None:
        bucket.blob(f"{prefix}/{rel}").delete()
        log.info("event=code_deleted object=gs://%s/%s/%s", bucket_name, prefix, rel)

    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        # list() drains the results so that the first failed upload or delete raises here.
        list(pool.map(upload, to_upload))
        list(pool.map(delete, to_delete))
    report.uploaded, report.deleted = to_upload, to_delete
    return report


def gcloud_argv(gcloud: str, source: Path, dest_url: str, excludes: Sequence[str], ignored: Sequence[str] = ()) -> list[str]:
    """`gcloud storage rsync` comparing content, as the client sync does (crc32c): by default it copies a file
    whose modification time differs from the object's, and a fresh clone, or the environment staged anew in a
    scratch directory at every upload, has new times for the same bytes; --checksums-only compares hashes
    instead (https://cloud.google.com/sdk/gcloud/reference/storage/rsync)."""
    argv = [gcloud, "storage", "rsync", "--recursive", "--delete-unmatched-destination-objects", "--checksums-only"]
    if excludes or ignored:
        argv.append(f"--exclude={exclude_regex(excludes, ignored)}")
    return [*argv, str(source), dest_url.rstrip("/")]


def sync_code(
    source: Path,
    dest_url: str,
    extra_excludes: Sequence[str] = (),
    client=None,
    gcloud: str | None = None,
    use_gcloud: bool | None = None,
    on_file=None,
) -> SyncReport | None:
    """Mirror the checkout `source` to `dest_url`, without what a worker never needs (DEFAULT_EXCLUDES,
    `extra_excludes`, what git ignores) and without the GENERATED directories, which upload_code
    mirrors on their own (upload_generated). Uses gcloud when found on PATH (unless use_gcloud=False),
    returning None as gcloud reports for itself; otherwise the client sync and its report."""
    excludes = [*DEFAULT_EXCLUDES, *extra_excludes]
    # Generated next to the code by upload_code, from elsewhere: the mirror neither uploads nor deletes them.
    ignored = [*git_ignored(source), *GENERATED] if source.is_dir() else []
    return mirror(source, dest_url, excludes, ignored, client=client, gcloud=gcloud, use_gcloud=use_gcloud,
                  on_file=on_file)


def mirror(
    source: Path,
    dest_url: str,
    excludes: Sequence[str] = (),
    ignored: Sequence[str] = (),
    client=None,
    gcloud: str | None = None,
    use_gcloud: bool | None = None,
    on_file=None,
) -> SyncReport | None:
    """Make `dest_url` hold exactly the files of `source` that `excludes` (globs) and `ignored`
    (relative paths) leave in; what they match is neither uploaded nor deleted remotely. `on_file` is
    called per file the client uploads (gcloud shows its own progress)."""
    destination(dest_url)
    if not source.is_dir():
        raise CodeSyncError(f"source {str(source)!r} is not a directory")
    gcloud = gcloud or (shutil.which("gcloud") if use_gcloud is not False else None)
    if gcloud:
        argv = gcloud_argv(gcloud, source, dest_url, excludes, ignored)
        log.info("event=code_sync method=gcloud argv=%s", argv)
        result = subprocess.run(argv, check=False)
        if result.returncode != 0:
            raise CodeSyncError(f"{' '.join(argv[:3])} exited with {result.returncode}; see its output above")
        return None
    if client is None:
        client = storage.Client()
    log.info("event=code_sync method=python source=%s dest=%s", source, dest_url)
    report = sync_with_client(source, dest_url, excludes, client, ignored=ignored, on_file=on_file)
    log.info(
        "event=code_synced uploaded=%d deleted=%d unchanged=%d dest=%s",
        len(report.uploaded), len(report.deleted), report.unchanged, dest_url,
    )
    return report

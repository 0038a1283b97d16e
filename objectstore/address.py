"""What a user may write where the tools take a store: `gs://bucket/prefix`, or a directory that exists.

`open_store` takes anything without `gs://` for a local directory and creates it, which is right for the
code that makes its own prefixes and wrong at the edge, where a typo becomes a new empty queue: `mybucket/jobs/J`
and `gs:/b/q` would both be made as directories under the working directory, report 0 tasks and exit 0. So the
commands check what the user typed first (`check_address`), and only then open it.

- `gs://BUCKET[/PREFIX]`: BUCKET follows Cloud Storage's naming rules (3 to 63 characters of lowercase letters,
  digits, `-`, `_` and `.`, starting and ending with a letter or digit; names with dots may be up to 222
  characters, each dot-separated part at most 63: https://cloud.google.com/storage/docs/buckets#naming). PREFIX
  has no empty parts (`a//b`); a trailing `/` is dropped.
- A local directory, which must exist, so that a queue or an output is never conjured by a typo. A command that
  makes a fresh local queue asks for the directory to be made first (`mkdir`).
- Refused by name, with the fix: `gs:/x`, `gs:x`, `gs:///x` (a slash missing or extra), `gs//x` and `gs/x` (the
  colon missing), other schemes (`s3://`, `gcs://`, `https://`: only `gs://` is a bucket here), and a bare
  `bucket/x` that is no directory.
"""

from __future__ import annotations

import pathlib
import re

from exitcodes import EX_DATAERR

__all__ = ["BadAddress", "bucket_of", "check_address", "split_gs"]

_BUCKET_PART = r"[a-z0-9](?:[-_a-z0-9]{0,61}[a-z0-9])?"
_BUCKET = re.compile(rf"^{_BUCKET_PART}(?:\.{_BUCKET_PART})*$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class BadAddress(ValueError):
    """An address that is neither a well-formed `gs://bucket/prefix` nor an existing directory; the message
    names the field (or flag) it came from and what to write instead."""

    exit_code = EX_DATAERR  # what a command that ends on it exits with (gcs_spawner/cli.py)


def check_address(text: str, what: str = "address", *, prefix: bool = True, directory: bool = True) -> str:
    """`text` checked and normalised: `gs://bucket/prefix` without a trailing `/`, or the directory's path as given.

    `what` names the field or flag in the error (`queue`, `--queue`, `fleet.code`). `prefix=False` lets a bare
    `gs://bucket` through; `directory=False` refuses local paths (an address the machines must reach)."""
    if not isinstance(text, str) or not text.strip():
        raise BadAddress(f"{what}: empty; write gs://bucket/prefix" + (" or an existing directory" if directory else ""))
    text = text.strip()
    if text.startswith("gs://") and not text.startswith("gs:///"):
        return _gs(text, what, prefix)
    fix = _misspelt_gs(text)
    if fix is not None and not (text.startswith("gs/") and not text.startswith("gs//") and pathlib.Path(text).is_dir()):
        raise BadAddress(f"{what}: {text!r} is not a gs:// URL (a ':' or '/' is missing or extra); write {fix!r}")
    scheme = _SCHEME.match(text)
    if scheme:
        raise BadAddress(f"{what}: {text!r} has scheme {scheme.group(1)}://; only gs://bucket/prefix URLs (Cloud "
                         "Storage) are buckets here")
    if not directory:
        raise BadAddress(f"{what}: {text!r} is not a gs://bucket/prefix URL; the machines read this address, so it "
                         "must be in Cloud Storage")
    path = pathlib.Path(text).expanduser()
    if path.is_dir():
        return text
    if path.exists():
        raise BadAddress(f"{what}: {text!r} is a file, not a directory; give the queue's directory or a gs:// URL")
    first = text.split("/", 1)[0]
    hint = (f"for a bucket write 'gs://{text}'" if _BUCKET.match(first) and "/" in text
            else "for a bucket write gs://bucket/prefix")
    raise BadAddress(f"{what}: {text!r} is neither a gs:// URL nor an existing directory; {hint}, for a local "
                     f"directory create it first (mkdir -p {text})")


def split_gs(url: str, what: str = "address") -> tuple[str, str]:
    """`gs://bucket/a/b/` -> `("bucket", "a/b")`: the one place a gs:// address is cut into its bucket
    and its prefix (without the slashes around it; empty for a whole bucket). Raises BadAddress,
    naming `what`, for anything that is not `gs://` and a bucket. The bucket's name is not checked
    here: `check_address` does that, where a user typed it."""
    if not isinstance(url, str) or not url.startswith("gs://"):
        raise BadAddress(f"{what}: {url!r} is not a gs://bucket/prefix URL")
    bucket, _, prefix = url[len("gs://"):].partition("/")
    if not bucket:
        raise BadAddress(f"{what}: {url!r} names no bucket; write gs://bucket/prefix")
    return bucket, prefix.strip("/")


def bucket_of(url: str) -> str | None:
    """The bucket a gs:// address is in (`gs://b/jobs/j` -> `b`); None for anything else (a local directory)."""
    return split_gs(url)[0] if isinstance(url, str) and url.startswith("gs://") else None


def _gs(text: str, what: str, prefix: bool) -> str:
    rest = text[len("gs://"):].rstrip("/")
    bucket, _ = split_gs(text, what)
    path = rest.partition("/")[2]
    if not _BUCKET.match(bucket) or len(bucket) < 3 or len(bucket) > 222 or (len(bucket) > 63 and "." not in bucket):
        raise BadAddress(f"{what}: {text!r}: {bucket!r} is not a Cloud Storage bucket name (3-63 lowercase letters, "
                         "digits, '-', '_' or '.', starting and ending with a letter or digit)")
    if path and any(not part for part in path.split("/")):
        raise BadAddress(f"{what}: {text!r} has an empty part ('//') in its prefix; write gs://{bucket}/"
                         f"{'/'.join(p for p in path.split('/') if p)}")
    if prefix and not path:
        raise BadAddress(f"{what}: {text!r} is a whole bucket; give a prefix inside it, e.g. gs://{bucket}/jobs/NAME")
    return f"gs://{rest}"


def _misspelt_gs(text: str) -> str | None:
    """The gs:// URL a near miss meant (`gs:/b/q`, `gs:b/q`, `gs:///b/q`, `gs//b/q`, `gs/b/q`), or None."""
    match = re.match(r"^gs(?::/*|/{1,2})(?!/)(.+)$", text)
    return None if match is None else "gs://" + match.group(1)

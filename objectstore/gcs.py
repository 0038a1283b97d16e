"""The object-store contract on Google Cloud Storage, through the official `google-cloud-storage` client.

Retries are ours, not the client's: every call passes `retry=None` and runs through
`objectstore.retry.Retrier` (capped exponential backoff with full jitter), because only then do we
know whether a request was sent more than once. That knowledge resolves the ambiguous conditional
write (`objectstore.retry.write_with_nonce`): a 412 after a retry is read back, and the write is ours
exactly when the object carries the nonce this call put in its custom metadata. Non-transient errors
other than 404 and 412 (403, an expired credential) are re-raised as they are.

`STORAGE_EMULATOR_HOST` is honoured by the client itself; with it set we use anonymous credentials.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable, Mapping
from typing import BinaryIO, TypeVar

import requests
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exceptions
from google.cloud import storage

from objectstore.address import split_gs
from objectstore.base import (
    DEFAULT_CONTENT_TYPE,
    MAX_LIST_PAGE,
    Blob,
    Entry,
    NotFound,
    ObjectStore,
    Page,
    PreconditionFailed,
    check_name,
)
from objectstore.retry import Retrier, RetryPolicy, delete_with_retries, write_with_nonce

__all__ = ["GCSStore", "NONCE_KEY", "RetryPolicy", "is_transient", "make_client"]

log = logging.getLogger(__name__)

#: Custom-metadata key holding the per-call nonce of conditional writes. Hidden from listings.
NONCE_KEY = "spawn-write-nonce"

_TRANSIENT_API_ERRORS = (
    gexc.TooManyRequests,
    gexc.InternalServerError,
    gexc.BadGateway,
    gexc.ServiceUnavailable,
    gexc.GatewayTimeout,
)
_TRANSIENT_TRANSPORT_ERRORS = (
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,
    auth_exceptions.TransportError,
    ConnectionError,
    TimeoutError,
)

T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    """429, 5xx, connection resets and timeouts: worth another try."""
    if isinstance(exc, _TRANSIENT_API_ERRORS + _TRANSIENT_TRANSPORT_ERRORS):
        return True
    # 408 Request Timeout has no class of its own in api_core.
    return isinstance(exc, gexc.GoogleAPICallError) and exc.code == 408


def make_client(project: str | None = None) -> storage.Client:
    """A storage client for production (ADC) or, with STORAGE_EMULATOR_HOST set, for a local server."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project=project or "local-test", credentials=AnonymousCredentials())
    return storage.Client(project=project)


class _BufferReader(io.RawIOBase):
    """A seekable read-only file over a memoryview; `read` copies only the chunk the HTTP client asks for."""

    def __init__(self, view: memoryview):
        self._view = view
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._view.nbytes}[whence]
        self._position = max(0, base + offset)
        return self._position

    def read(self, size: int = -1) -> bytes:
        end = self._view.nbytes if size is None or size < 0 else min(self._view.nbytes, self._position + size)
        chunk = self._view[self._position : end].tobytes()
        self._position = max(self._position, end)
        return chunk

    def readinto(self, target) -> int:
        chunk = self._view[self._position : self._position + len(target)]
        target[: len(chunk)] = chunk
        self._position += len(chunk)
        return len(chunk)


class GCSStore(ObjectStore):
    # "a limit of one write per second to the same object name" (https://cloud.google.com/storage/quotas#objects)
    same_object_write_gap_s = 1.0

    def __init__(self, bucket: str, prefix: str = "", client: storage.Client | None = None, policy: RetryPolicy | None = None):
        self._client = client if client is not None else make_client()
        self._bucket = self._client.bucket(bucket)
        self._prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self._policy = policy or RetryPolicy()
        self._retrier = Retrier(self._policy, is_transient)
        self.root_url = f"gs://{bucket}/{self._prefix}".rstrip("/")

    @classmethod
    def from_url(cls, url: str, client: storage.Client | None = None) -> "GCSStore":
        bucket, prefix = split_gs(url, "store")
        return cls(bucket, prefix, client=client)

    # -- plumbing ---------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return self._prefix + check_name(name)

    def _blob(self, name: str) -> storage.Blob:
        return self._bucket.blob(self._key(name))

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """One request through our retry loop, with GCS's 404 and 412 mapped to the contract's errors."""
        return self._retrier.call(what, lambda: self._once(what, fn))

    def _conditional_upload(self, name: str, data: bytes, if_generation: int, metadata: Mapping[str, str] | None) -> int:
        what = f"{'create' if if_generation == 0 else 'write'} {self.url(name)}"

        def upload(nonce: str) -> int:
            blob = self._blob(name)
            blob.metadata = {**(metadata or {}), NONCE_KEY: nonce}
            self._once(what, lambda: blob.upload_from_string(
                data, content_type="application/octet-stream", if_generation_match=if_generation, retry=None,
                timeout=self._policy.timeout_s,
            ))  # fmt: skip
            return int(blob.generation)

        def read_back() -> tuple[int, str | None]:
            blob = self._blob(name)
            self._once(f"read back {self.url(name)}", lambda: blob.reload(retry=None, timeout=self._policy.timeout_s))
            return int(blob.generation), (blob.metadata or {}).get(NONCE_KEY)

        return write_with_nonce(self._retrier, what, upload, read_back)

    @staticmethod
    def _once(what: str, fn: Callable[[], T]) -> T:
        """One attempt, with 404 and 412 mapped; the caller's Retrier retries the rest."""
        try:
            return fn()
        except gexc.NotFound as exc:
            raise NotFound(f"{what}: not found ({exc.code})") from exc
        except gexc.PreconditionFailed as exc:
            raise PreconditionFailed(f"{what}: precondition failed ({exc.code})") from exc

    # -- the contract -----------------------------------------------------------------------

    def read(self, name: str) -> Blob:
        blob = self._blob(name)
        data = self._call(
            f"read {self.url(name)}", lambda: blob.download_as_bytes(retry=None, timeout=self._policy.timeout_s)
        )
        return Blob(name=name, generation=int(blob.generation), data=data)

    def create(self, name: str, data: bytes, metadata: Mapping[str, str] | None = None) -> int:
        return self._conditional_upload(name, data, 0, metadata)

    def write(self, name: str, data: bytes, if_generation: int, metadata: Mapping[str, str] | None = None) -> int:
        if if_generation <= 0:
            raise ValueError(f"write {name!r}: if_generation must be a positive generation, got {if_generation}")
        return self._conditional_upload(name, data, if_generation, metadata)

    def delete(self, name: str, if_generation: int | None = None) -> None:
        blob = self._blob(name)
        what = f"delete {self.url(name)}"
        delete_with_retries(
            self._retrier, what,
            lambda: self._once(what, lambda: blob.delete(
                if_generation_match=if_generation, retry=None, timeout=self._policy.timeout_s
            )),
            if_generation,
        )  # fmt: skip

    def put(
        self, name: str, data: bytes | memoryview, metadata: Mapping[str, str] | None = None, content_type: str | None = None
    ) -> int:
        content_type = content_type or DEFAULT_CONTENT_TYPE
        blob = self._blob(name)
        if metadata:
            # Without metadata the resource must not carry the key at all: `blob.metadata = None` would
            # send `"metadata": null`, which stricter JSON API implementations answer with 500.
            blob.metadata = dict(metadata)
        if isinstance(data, bytes):
            upload = lambda: blob.upload_from_string(  # noqa: E731
                data, content_type=content_type, retry=None, timeout=self._policy.timeout_s
            )
        else:
            # Any other buffer (an output shard's memoryview) is streamed from where it lies instead of being
            # copied into one bytes object first; each attempt reads it from the start.
            view = memoryview(data).cast("B")
            upload = lambda: blob.upload_from_file(  # noqa: E731
                _BufferReader(view), size=view.nbytes, content_type=content_type, retry=None,
                timeout=self._policy.timeout_s,
            )  # fmt: skip
        self._call(f"put {self.url(name)}", upload)
        return int(blob.generation)

    def put_file(self, name: str, path: str | os.PathLike[str]) -> int:
        blob = self._blob(name)
        # Large files go up as a resumable upload in chunks; a retry starts the upload again.
        blob.chunk_size = 64 * 1024 * 1024
        self._call(
            f"upload {path} to {self.url(name)}",
            lambda: blob.upload_from_filename(
                str(path), content_type="application/octet-stream", retry=None, timeout=self._policy.timeout_s
            ),
        )
        return int(blob.generation)

    def open_read(self, name: str) -> BinaryIO:
        blob = self._blob(name)
        self._call(f"stat {self.url(name)}", lambda: blob.reload(retry=None, timeout=self._policy.timeout_s))
        # Ranged reads are idempotent, so the client's own retry object is the right tool here.
        return blob.open("rb", chunk_size=8 * 1024 * 1024)

    def read_range(self, name: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        blob = self._blob(name)
        # One request for exactly these bytes (`end` is inclusive in the client); a BlobReader would fetch at
        # least its chunk size. Checksums cover whole objects only, so none is checked for a range.
        return self._call(
            f"read {self.url(name)} bytes {start}-{end - 1}",
            lambda: blob.download_as_bytes(
                start=start, end=end - 1, checksum=None, retry=None, timeout=self._policy.timeout_s
            ),
        )

    def list_page(
        self,
        prefix: str,
        page_token: str | None = None,
        start_offset: str | None = None,
        page_size: int = MAX_LIST_PAGE,
        end_offset: str | None = None,
    ) -> Page:
        page_size = max(1, min(page_size, MAX_LIST_PAGE))

        def fetch() -> tuple[list[storage.Blob], str | None]:
            iterator = self._client.list_blobs(
                self._bucket,
                prefix=self._prefix + prefix,
                start_offset=self._prefix + start_offset if start_offset else None,
                end_offset=self._prefix + end_offset if end_offset else None,
                page_size=page_size,
                page_token=page_token,
                retry=None,
                timeout=self._policy.timeout_s,
            )
            page = next(iterator.pages)
            return list(page), iterator.next_page_token

        blobs, token = self._call(f"list {self.url(prefix)}*", fetch)
        entries = [
            Entry(
                name=blob.name[len(self._prefix) :],
                generation=int(blob.generation),
                size=int(blob.size or 0),
                updated=blob.updated,
                metadata={k: v for k, v in (blob.metadata or {}).items() if k != NONCE_KEY},
                content_type=blob.content_type or DEFAULT_CONTENT_TYPE,
                crc32c=blob.crc32c,
            )
            for blob in blobs
        ]
        return Page(entries, token)

    def child(self, prefix: str) -> "GCSStore":
        return GCSStore(
            self._bucket.name, self._prefix + check_name(prefix.strip("/")), client=self._client, policy=self._policy
        )

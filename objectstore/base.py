"""The object-store contract that the queue, the extraction and the cloud tools share.

Only five operations, because they are all the claim protocol needs and all that GCS can
arbitrate atomically: read with generation, create-if-absent, write-if-generation-matches,
delete-if-generation-matches, and a paginated listing by prefix. `put` (unconditional write)
exists for output shards, which are fenced by their path, not by a precondition.

Generations are positive integers that only grow, per store. Custom metadata travels with
an object and is returned by listings, which lets the queue learn a lease's state without a
GET per object.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime as dt
import os
from collections.abc import Iterator, Mapping
from typing import BinaryIO

from exitcodes import EX_FAILED


class StoreError(Exception):
    """Base class of every object-store failure; the message names the object."""

    exit_code = EX_FAILED  # what a command that ends on it exits with (gcs_spawner/cli.py)


class NotFound(StoreError):
    """The object does not exist (GCS 404)."""


class PreconditionFailed(StoreError):
    """The object's generation was not the one the caller required (GCS 412).

    For `create` it means another writer's object is already there; for `write` and
    `delete` it means the caller's view is stale or the object is gone.
    """


class StoreUnavailable(StoreError):
    """Transient errors outlasted the retry budget; the caller may try again later."""


class BadObjectName(StoreError, ValueError):
    """An object name the store cannot hold (empty, absolute, `..`, control characters)."""


DEFAULT_CONTENT_TYPE = "application/octet-stream"


@dataclasses.dataclass(frozen=True)
class Blob:
    """An object's bytes together with the generation they were read at."""

    name: str
    generation: int
    data: bytes


@dataclasses.dataclass(frozen=True)
class Entry:
    """One listing row: enough to decide what to read, without reading it."""

    name: str
    generation: int
    size: int
    updated: dt.datetime
    metadata: Mapping[str, str]
    content_type: str = DEFAULT_CONTENT_TYPE
    #: The object's CRC32C as GCS reports it (base64 of 4 big-endian bytes), None where the store keeps none
    #: (a local directory): https://cloud.google.com/storage/docs/hashes-etags#crc32c
    crc32c: str | None = None


@dataclasses.dataclass(frozen=True)
class Page:
    entries: list[Entry]
    next_token: str | None


MAX_LIST_PAGE = 1000  # GCS's own ceiling for objects.list maxResults


def check_name(name: str) -> str:
    if not name or name.startswith("/") or "\x00" in name or "\n" in name or "\r" in name:
        raise BadObjectName(f"object name {name!r} is not valid: use a relative path such as 'tasks/0001.json'")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise BadObjectName(f"object name {name!r} has an empty, '.' or '..' path segment")
    return name


class ObjectStore(abc.ABC):
    """A bucket prefix. Names passed to every method are relative to that prefix."""

    #: e.g. "gs://bucket/prefix" or "/abs/path"; `url(name)` joins onto it.
    root_url: str
    #: Seconds a writer should leave between two writes of one object: the store answers faster
    #: ones with 429 (retried, but a request and a backoff lost). 0 where there is no such limit.
    same_object_write_gap_s: float = 0.0

    @abc.abstractmethod
    def read(self, name: str) -> Blob:
        """The object's bytes and generation. Raises NotFound."""

    @abc.abstractmethod
    def create(self, name: str, data: bytes, metadata: Mapping[str, str] | None = None) -> int:
        """Write only if no object has that name; return the new generation.

        Raises PreconditionFailed when the object exists. A create whose response was lost
        and which the transport retried is resolved by reading the object back: the
        caller's own write is recognised by a per-call nonce, so the answer is exact.
        """

    @abc.abstractmethod
    def write(self, name: str, data: bytes, if_generation: int, metadata: Mapping[str, str] | None = None) -> int:
        """Replace the object only if its generation is `if_generation`; return the new one.

        Raises PreconditionFailed when the generation differs or the object is gone.
        """

    @abc.abstractmethod
    def delete(self, name: str, if_generation: int | None = None) -> None:
        """Delete, optionally only at `if_generation`. Raises NotFound or PreconditionFailed."""

    @abc.abstractmethod
    def put(
        self, name: str, data: bytes | memoryview, metadata: Mapping[str, str] | None = None, content_type: str | None = None
    ) -> int:
        """Unconditional write (for outputs, whose path already carries the fencing token).

        `data` may be any contiguous buffer (a memoryview of an output shard): it is written from where it lies.
        `content_type` (default application/octet-stream) is what a browser is told it gets: a status page
        published as text/html opens as a page (listings return it as `Entry.content_type`)."""

    @abc.abstractmethod
    def put_file(self, name: str, path: str | os.PathLike[str]) -> int:
        """Unconditional write of a local file's bytes, streamed: a multi-gigabyte weights shard
        is never held in memory."""

    @abc.abstractmethod
    def open_read(self, name: str) -> BinaryIO:
        """A seekable binary file that reads the object lazily (ranged reads on GCS). Raises NotFound."""

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object, exactly (one ranged GET on GCS). Raises NotFound."""
        with self.open_read(name) as f:
            f.seek(start)
            return f.read(end - start)

    @abc.abstractmethod
    def list_page(
        self,
        prefix: str,
        page_token: str | None = None,
        start_offset: str | None = None,
        page_size: int = MAX_LIST_PAGE,
        end_offset: str | None = None,
    ) -> Page:
        """One page (one request) of objects whose names start with `prefix`, in lexicographic order.

        `start_offset` (inclusive) skips names that sort before it and `end_offset` (exclusive)
        stops before the first name that sorts at or after it, as GCS's `startOffset` and
        `endOffset` do (https://cloud.google.com/storage/docs/json_api/v1/objects/list). A range
        that holds at most `page_size` objects therefore costs exactly one request.
        """

    def list(
        self, prefix: str, start_offset: str | None = None, limit: int | None = None, end_offset: str | None = None
    ) -> Iterator[Entry]:
        """Every entry under `prefix` (within the offsets), page by page; stops after `limit` entries if given."""
        token: str | None = None
        seen = 0
        while True:
            size = MAX_LIST_PAGE if limit is None else max(1, min(MAX_LIST_PAGE, limit - seen))
            page = self.list_page(prefix, page_token=token, start_offset=start_offset, page_size=size, end_offset=end_offset)
            for entry in page.entries:
                yield entry
                seen += 1
                if limit is not None and seen >= limit:
                    return
            if not page.next_token:
                return
            token = page.next_token

    def url(self, name: str) -> str:
        return f"{self.root_url.rstrip('/')}/{name}"

    @abc.abstractmethod
    def child(self, prefix: str) -> "ObjectStore":
        """A store rooted at `prefix` under this one (same backend, same client)."""

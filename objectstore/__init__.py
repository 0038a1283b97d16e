"""Object stores: the one interface the queue, extraction and tools use for GCS or a local directory."""

from objectstore.address import BadAddress, bucket_of, check_address, split_gs
from objectstore.base import (
    BadObjectName,
    Blob,
    Entry,
    NotFound,
    ObjectStore,
    Page,
    PreconditionFailed,
    StoreError,
    StoreUnavailable,
)


def open_store(url: str, client=None) -> ObjectStore:
    """`gs://bucket/prefix` opens GCS (through `client` if given); anything else is a local directory."""
    if url.startswith("gs://"):
        from objectstore.gcs import GCSStore

        return GCSStore.from_url(url, client=client)
    from objectstore.local import LocalStore

    return LocalStore(url)


__all__ = [
    "BadAddress",
    "BadObjectName",
    "Blob",
    "Entry",
    "NotFound",
    "ObjectStore",
    "Page",
    "PreconditionFailed",
    "StoreError",
    "StoreUnavailable",
    "bucket_of",
    "check_address",
    "open_store",
    "split_gs",
]

"""Bytes of shards, done markers and indexes, on local disk or `gs://`: whole objects, exact byte ranges, listings.

gs:// goes through the object-store layer (`objectstore.GCSStore.read_range`: one ranged GET per range, with our
retry policy), so a trainer reading a bucket uses the same client and retries as the workers that wrote it. Local
paths are read with `os.preadv` straight into the caller's buffer. A `RangeCache` keeps fetched ranges of remote
objects on local disk, so a second epoch reads no bucket bytes. The loader maps local shards' rows instead
(`ByteReader.map_local`), so that they are copied once, from the page cache straight into the shuffle buffer.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import pathlib
import tempfile
import threading
from typing import Any

import numpy as np

from exitcodes import EX_FAILED
from objectstore import address


#: The kernel's fault-around window (see `ByteReader.map_local`).
_FAULT_AROUND_BYTES = 64 << 10


class ActivationsError(Exception):
    """A shard, done marker, index or loader input that cannot be read or used; the message names it."""

    exit_code = EX_FAILED  # what a command that ends on it exits with (gcs_spawner/cli.py)


class LoaderConfigError(ActivationsError, ValueError):
    """A loader argument that cannot work; the message names it and says what to pass instead."""


def is_remote(url: str) -> bool:
    return url.startswith("gs://")


def split_gs(url: str) -> tuple[str, str]:
    try:
        return address.split_gs(url, "activations")
    except address.BadAddress as exc:
        raise ActivationsError(str(exc)) from None


_stores: dict[tuple[str, int], Any] = {}
_stores_lock = threading.Lock()


def bucket_store(bucket: str, client: Any = None) -> Any:
    """One `objectstore` store per bucket (and client), shared by every thread."""
    key = (bucket, id(client))
    with _stores_lock:
        if key not in _stores:
            import objectstore

            _stores[key] = objectstore.open_store(f"gs://{bucket}", client=client)
        return _stores[key]


def _not_found() -> tuple[type[BaseException], ...]:
    from objectstore import NotFound

    return (NotFound,)


def read_object(url: str, client: Any = None) -> bytes:
    """A whole object (a done marker, an index, or a shard read in one piece)."""
    try:
        if is_remote(url):
            bucket, key = split_gs(url)
            return bucket_store(bucket, client).read(key).data
        return pathlib.Path(url).read_bytes()
    except (OSError, *_not_found()) as exc:
        raise ActivationsError(f"{url}: cannot be read ({exc})") from exc


def exists(url: str, client: Any = None) -> bool:
    if is_remote(url):
        bucket, key = split_gs(url)
        return any(e.name == key for e in bucket_store(bucket, client).list(key, limit=1))
    return pathlib.Path(url).is_file()


def list_objects(prefix: str, suffix: str, client: Any = None) -> list[str]:
    """URLs of every object under a local directory or gs:// prefix whose name ends with `suffix`, sorted."""
    if is_remote(prefix):
        bucket, key = split_gs(prefix)
        key = key.rstrip("/") + "/" if key else ""
        return sorted(f"gs://{bucket}/{e.name}" for e in bucket_store(bucket, client).list(key) if e.name.endswith(suffix))
    return sorted(str(p) for p in pathlib.Path(prefix).rglob(f"*{suffix}") if p.is_file() and ".objectstore" not in p.parts)


def join(prefix: str, name: str) -> str:
    return f"{prefix.rstrip('/')}/{name}"


class RangeCache:
    """Fetched byte ranges of remote objects, one file each under `directory`, written atomically.

    Keyed by URL and range; a shard's bytes never change once its done marker lists it, so entries never go stale.
    With `max_bytes`, the least recently used entries are deleted to keep the directory under that size: a hit
    touches its file's mtime, so the order also holds across runs that reuse the directory. The bound is kept by
    each process on its own; ranks sharing one directory should split the disk between them. Without `max_bytes`
    nothing is evicted: size the directory for the ranges a run reads (the selected layers of the shards).
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int | None = None):
        if max_bytes is not None and max_bytes < 1:
            raise ActivationsError(f"cache max_bytes must be positive, got {max_bytes}; or leave it out for no bound")
        self.directory = pathlib.Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # path -> size, least recently used first: what an earlier run left, oldest first.
        found = [(str(p), p.stat()) for p in self.directory.glob("*/*.bin")]
        found.sort(key=lambda entry: (entry[1].st_mtime_ns, entry[0]))
        self._entries: collections.OrderedDict[str, int] = collections.OrderedDict((p, st.st_size) for p, st in found)
        self._bytes = sum(self._entries.values())
        self._evict()

    @property
    def bytes(self) -> int:
        """Bytes this process knows the cache to hold."""
        return self._bytes

    def path(self, url: str, start: int, end: int) -> pathlib.Path:
        digest = hashlib.sha256(url.encode()).hexdigest()[:32]
        return self.directory / digest[:2] / f"{digest}-{start}-{end}.bin"

    def get(self, url: str, start: int, end: int, out: memoryview) -> bool:
        path = self.path(url, start, end)
        try:
            with open(path, "rb") as handle:
                if handle.readinto(out) != end - start:
                    return False
        except FileNotFoundError:
            return False
        if self.max_bytes is not None:
            with self._lock:
                if str(path) in self._entries:
                    self._entries.move_to_end(str(path))
            with contextlib.suppress(OSError):  # evicted meanwhile by another process: the bytes are already read
                os.utime(path)
        return True

    def put(self, url: str, start: int, end: int, payload: memoryview) -> None:
        if self.max_bytes is not None and len(payload) > self.max_bytes:
            return  # larger than the whole cache: keeping it would evict everything else
        path = self.path(url, start, end)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(payload)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        with self._lock:
            self._bytes += len(payload) - self._entries.pop(str(path), 0)
            self._entries[str(path)] = len(payload)
            self._evict()

    def _evict(self) -> None:
        """Delete least recently used entries until the cache fits (the caller holds the lock, or is __init__)."""
        if self.max_bytes is None:
            return
        while self._bytes > self.max_bytes and self._entries:
            victim, size = self._entries.popitem(last=False)
            self._bytes -= size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(victim)


class ByteReader:
    """Exact byte ranges of shards into caller-owned buffers; thread-safe."""

    def __init__(self, client: Any = None, cache: RangeCache | None = None):
        self._client = client
        self._cache = cache

    def read_into(self, url: str, start: int, out: np.ndarray) -> None:
        """Fill `out` (a contiguous array) with the bytes [start, start + out.nbytes) of the object."""
        view = memoryview(out).cast("B")
        end = start + len(view)
        if not is_remote(url):
            self._pread(url, start, view)
            return
        if self._cache is not None and self._cache.get(url, start, end, view):
            return
        bucket, key = split_gs(url)
        try:
            payload = bucket_store(bucket, self._client).read_range(key, start, end)
        except _not_found() as exc:
            raise ActivationsError(f"{url}: does not exist ({exc})") from exc
        if len(payload) != len(view):
            raise ActivationsError(f"{url}: bytes {start}-{end} returned {len(payload)} bytes; the object is shorter "
                                   "than its header says (truncated or overwritten)")  # fmt: skip
        view[:] = payload  # one part-sized copy; the part's bytes object is dropped at once
        if self._cache is not None:
            self._cache.put(url, start, end, view)

    @staticmethod
    def map_local(path: str, start: int, nbytes: int) -> np.ndarray:
        """Bytes [start, start + nbytes) of a local file as a read-only array over the page cache: no copy.

        The pages are faulted in now, by the calling thread: on local disk that reads them, so a read-ahead thread
        that maps a shard leaves the consumer nothing to wait for. One byte is touched every 64 KiB: the kernel maps
        the page-cache pages around a read fault 64 KiB at a time ("fault-around": Linux mm/memory.c,
        do_read_fault -> do_fault_around, `fault_around_bytes`, 64 KiB by default), which costs less CPU per GB
        than MAP_POPULATE (#26: 0.99x the numpy reference's GB per CPU-second with MAP_POPULATE, 1.11x touched;
        bench/read_bench.py). A page the touch leaves unmapped is faulted in when it is copied. The mapping lives
        as long as the array. The file's size is checked first: touching a mapping past the end of a file kills the
        process (SIGBUS) instead of raising."""
        import mmap

        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise ActivationsError(f"{path}: cannot be opened ({exc})") from exc
        try:
            if os.fstat(fd).st_size < start + nbytes:
                raise ActivationsError(f"{path}: ends before byte {start + nbytes}; the shard is truncated")
            if nbytes == 0:
                return np.empty(0, dtype=np.uint8)
            aligned = start - start % mmap.ALLOCATIONGRANULARITY
            length = start + nbytes - aligned
            mapping = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=aligned)
        finally:
            os.close(fd)
        pages = np.frombuffer(mapping, dtype=np.uint8)
        pages[:: _FAULT_AROUND_BYTES].max()  # reads one byte per window: the faults, not the data, are the point
        return pages[start - aligned : start - aligned + nbytes]

    def read_prefix(self, url: str, size: int) -> bytes:
        """The object's first `size` bytes, or all of it if it is shorter (a header read)."""
        if not is_remote(url):
            try:
                with open(url, "rb") as handle:
                    return handle.read(size)
            except OSError as exc:
                raise ActivationsError(f"{url}: cannot be read ({exc})") from exc
        bucket, key = split_gs(url)
        try:
            return bucket_store(bucket, self._client).read_range(key, 0, size)
        except _not_found() as exc:
            raise ActivationsError(f"{url}: does not exist ({exc})") from exc

    def read(self, url: str, start: int, end: int) -> bytes:
        out = np.empty(end - start, dtype=np.uint8)
        self.read_into(url, start, out)
        return out.tobytes()

    @staticmethod
    def _pread(path: str, start: int, view: memoryview) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise ActivationsError(f"{path}: cannot be opened ({exc})") from exc
        try:
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], start + done)
                if n == 0:
                    raise ActivationsError(f"{path}: ends before byte {start + len(view)}; the shard is truncated")
                done += n
        finally:
            os.close(fd)

"""JAX's persistent compilation cache, on by default, so a program is compiled once per machine (or per fleet),
not once per task.

**Where.** `$EXTRACT_COMPILE_CACHE` (a directory; `off` turns the cache off), else `$JAX_COMPILATION_CACHE_DIR`
(JAX's own setting, honoured as the root), else `$XDG_CACHE_HOME/gcs-spawner/jax` (default
`~/.cache/gcs-spawner/jax`). Entries live in one namespace directory below it per JAX build and device:
`jax<version>-jaxlib<version>-<platform>-<hash of the platform version and device kind>`.

**Which entry is used.** JAX looks an entry up by a key that hashes the lowered program (the model's shapes and
dtypes, the batch shape, the shardings and so the mesh), the jaxlib version, the backend's platform version, the
XLA flags, the compile options and the devices (`jax/_src/cache_key.py`, `get`). The namespace adds the jax
version and the device kind, so an entry is only ever looked up by the build and the device type that wrote it.
Every program the engine compiles is cached (`jax_persistent_cache_min_compile_time_secs` 0: they are the few
expensive ones). The key holds nothing of the machine's paths (XLA's own sub-caches are off, see `enable`), so an
entry serves every machine of the same build and device type.

**Integrity.** JAX writes an entry in place, not through a temporary name, and never replaces one that exists
(`jax/_src/lru_cache.py`, `LRUCache.put`): a process killed while writing leaves a truncated entry that every
later process would read, fail on and compile again, for ever. So each entry the engine's compile leaves is
*sealed* here (a sidecar `<entry>.sealed` holding its size and CRC32C), under an exclusive lock on the
namespace directory that every consumer on the machine takes for its compiles; at start-up, under the same
lock, an entry whose seal is missing or does not match its bytes is deleted. JAX then misses, compiles, writes
a fresh entry, and it is sealed in turn. A damaged entry is never read, only rebuilt. What the seal cannot
tell: an entry JAX itself failed to finish writing in this process (a full disk: JAX logs a warning and goes on)
is sealed as it lies; every later process then fails to read it and compiles instead, until the entry is
deleted. Every start-up reads each entry once to check its seal (the log line gives the seconds).

**Shared through the bucket** (optional): `$EXTRACT_COMPILE_CACHE_SHARED=gs://bucket/prefix` (or a directory).
At start-up the namespace's entries there that this machine lacks are copied in (each checked against the
size and CRC32C its uploader put in its metadata), and each entry sealed here is uploaded with a create-if-absent
write. A new machine then starts with the fleet's programs. JAX can also use a `gs://` directory as its cache
itself (https://docs.jax.dev/en/latest/persistent_compilation_cache.html, "Google Cloud"); copying through the
object store instead keeps the reads local after the first, the checks above, and the local-directory queue.
The same page's advice holds for the prefix: a bucket in the fleet's region, and a lifecycle rule that deletes
entries after the job (they are keyed to one JAX build; nothing else ever removes them).

**Trust.** A cache entry is machine code that the process runs. Whoever can write to the cache directory, or
to the shared prefix, can run code on every machine that reads it, exactly as whoever can write to the code
prefix (`tools/upload_code.py`) already can. JAX says the same of its cache (the page above, and
`jax.experimental.compilation_cache.compilation_cache.set_cache_dir`). Give the shared prefix the code
prefix's writers and no one else; the CRC32C checks catch damage, not an attacker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import threading
import time
from collections.abc import Iterator

import objectstore
from activations.format import crc32c_b64
from extract import cachedir

log = logging.getLogger(__name__)

ENV = "EXTRACT_COMPILE_CACHE"
SHARED_ENV = "EXTRACT_COMPILE_CACHE_SHARED"
JAX_ENV = "JAX_COMPILATION_CACHE_DIR"
#: JAX's file name for an entry: `<key>-cache` (jax/_src/lru_cache.py).
ENTRY_SUFFIX = "-cache"
SEAL_SUFFIX = ".sealed"
LOCK_NAME = ".lock"

_active: CompileCache | None = None
_counts = {"hits": 0, "misses": 0}
_counts_lock = threading.Lock()
_listening = False


def _on_event(event: str, **_: object) -> None:
    # jax.monitoring events (jax/_src/compiler.py): one per persistent-cache hit, one per entry written.
    name = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}.get(event)
    if name:
        with _counts_lock:
            _counts[name] += 1


def active() -> CompileCache | None:
    """The cache `enable` turned on in this process, if any: its `compiling` must wrap every compile."""
    return _active


def counts() -> dict[str, int]:
    """Persistent-cache hits and entries written so far in this process."""
    with _counts_lock:
        return dict(_counts)


def namespace(jax_version: str, jaxlib_version: str, platform: str, platform_version: str, device_kind: str) -> str:
    """The directory name of one JAX build on one kind of device."""
    device = hashlib.sha256(f"{platform_version}\n{device_kind}".encode()).hexdigest()[:12]
    return f"jax{jax_version}-jaxlib{jaxlib_version}-{platform}-{device}"


def current_namespace() -> str:
    """`namespace` of this process's JAX and its first device (initialises the backend)."""
    import jax
    import jaxlib

    device = jax.devices()[0]
    return namespace(jax.__version__, jaxlib.__version__, device.platform, device.client.platform_version,
                     device.device_kind)  # fmt: skip


def default_root() -> pathlib.Path | None:
    """The cache's root directory by the settings above; None when `$EXTRACT_COMPILE_CACHE` is `off`."""
    fallback = os.environ.get(JAX_ENV) or str(cachedir.cache_root() / "jax")
    return cachedir.setting(ENV, pathlib.Path(fallback).expanduser())


@dataclasses.dataclass(frozen=True)
class Seal:
    size: int
    crc32c: str

    @classmethod
    def of(cls, data: bytes) -> Seal:
        return cls(len(data), crc32c_b64(data))


def _write_atomically(path: pathlib.Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.part{os.getpid()}")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


class CompileCache:
    """One namespace directory of the persistent cache, its seals, and the shared copy if there is one."""

    def __init__(self, directory: pathlib.Path, shared: objectstore.ObjectStore | None = None):
        self.directory = directory
        self.shared = shared
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_path = directory / LOCK_NAME
        self._uploaded: set[str] = set()
        self.checked = {"kept": 0, "removed": 0}  # by the last `check`

    # -- the lock ------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock on the namespace, held by one consumer on the machine at a time (flock(2): released
        when the holder dies, so a killed process never leaves it held)."""
        with open(self._lock_path, "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """Wrap one compile: no other consumer writes entries meanwhile, and what it wrote is sealed (and shared)."""
        with self._locked():
            yield
            sealed = self._seal_new()
        self._push(sealed)

    # -- seals ---------------------------------------------------------------------------------------------------

    def entries(self) -> list[pathlib.Path]:
        return sorted(self.directory.glob(f"*{ENTRY_SUFFIX}"))

    @staticmethod
    def _seal_path(entry: pathlib.Path) -> pathlib.Path:
        return entry.with_name(entry.name + SEAL_SUFFIX)

    def _read_seal(self, entry: pathlib.Path) -> Seal | None:
        try:
            raw = json.loads(self._seal_path(entry).read_text())
            return Seal(int(raw["size"]), str(raw["crc32c"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _write_seal(self, entry: pathlib.Path, seal: Seal) -> None:
        _write_atomically(self._seal_path(entry), json.dumps(dataclasses.asdict(seal)).encode())

    def _seal_new(self) -> list[pathlib.Path]:
        sealed = []
        for entry in self.entries():
            if not self._seal_path(entry).exists():
                self._write_seal(entry, Seal.of(entry.read_bytes()))
                sealed.append(entry)
        return sealed

    def check(self) -> dict[str, int]:
        """Delete every entry whose seal is missing or does not match its bytes, and seals left without an entry.
        Returns how many entries were kept and removed."""
        kept = removed = 0
        with self._locked():
            for entry in self.entries():
                seal = self._read_seal(entry)
                try:
                    sound = seal is not None and entry.stat().st_size == seal.size
                    sound = sound and Seal.of(entry.read_bytes()) == seal
                except OSError:
                    sound = False
                if sound:
                    kept += 1
                    continue
                log.warning("event=compile_cache_entry_removed entry=%s reason=%s", entry.name,
                            "unsealed" if seal is None else "does_not_match_its_seal")  # fmt: skip
                entry.unlink(missing_ok=True)
                self._seal_path(entry).unlink(missing_ok=True)
                removed += 1
            for seal_path in self.directory.glob(f"*{ENTRY_SUFFIX}{SEAL_SUFFIX}"):
                if not seal_path.with_name(seal_path.name.removesuffix(SEAL_SUFFIX)).exists():
                    seal_path.unlink(missing_ok=True)
        self.checked = {"kept": kept, "removed": removed}
        return self.checked

    # -- the shared copy -----------------------------------------------------------------------------------------

    def pull(self) -> int:
        """Copy in the shared entries this directory lacks, each checked against its uploader's seal. A failure of
        the store or a damaged entry is logged and skipped: the cache never fails a task that can compile."""
        if self.shared is None:
            return 0
        copied = 0
        try:
            listed = [e for e in self.shared.list("") if e.name.endswith(ENTRY_SUFFIX) and "/" not in e.name]
        except objectstore.StoreError as exc:
            log.warning("event=compile_cache_shared_unavailable url=%s error=%s", self.shared.root_url, exc)
            return 0
        with self._locked():
            for item in listed:
                self._uploaded.add(item.name)
                local = self.directory / item.name
                if local.exists():
                    continue
                try:
                    data = self.shared.read(item.name).data
                    expected = Seal(int(item.metadata["size"]), item.metadata["crc32c"])
                except (objectstore.StoreError, KeyError, ValueError) as exc:
                    log.warning("event=compile_cache_shared_skipped entry=%s error=%r", item.name, exc)
                    continue
                if Seal.of(data) != expected:
                    log.warning("event=compile_cache_shared_skipped entry=%s reason=does_not_match_its_seal", item.name)
                    continue
                _write_atomically(local, data)
                self._write_seal(local, expected)
                copied += 1
        return copied

    def _push(self, entries: list[pathlib.Path]) -> None:
        if self.shared is None:
            return
        for entry in entries:
            if entry.name in self._uploaded:
                continue
            try:
                data = entry.read_bytes()
                seal = Seal.of(data)
                self.shared.create(entry.name, data, metadata={"size": str(seal.size), "crc32c": seal.crc32c})
            except objectstore.PreconditionFailed:
                pass  # another machine shared the same program first
            except (objectstore.StoreError, OSError) as exc:
                log.warning("event=compile_cache_share_failed entry=%s error=%s", entry.name, exc)
                continue
            self._uploaded.add(entry.name)


def enable(root: pathlib.Path | None = None, shared_url: str | None = None) -> CompileCache | None:
    """Turn JAX's persistent cache on for this process (before its first compile), check the local entries and
    copy in the shared ones. `root` and `shared_url` default to the settings above; None if the cache is off."""
    import jax

    global _listening, _active
    root = root if root is not None else default_root()
    if root is None:
        log.info("event=compile_cache state=off setting=%s", ENV)
        return None
    started = time.monotonic()
    ns = current_namespace()
    shared_url = shared_url if shared_url is not None else (os.environ.get(SHARED_ENV) or None)
    shared = objectstore.open_store(shared_url.rstrip("/") + "/" + ns) if shared_url else None
    cache = CompileCache(root / ns, shared)
    checked = cache.check()
    copied = cache.pull()
    jax.config.update("jax_compilation_cache_dir", str(cache.directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # JAX's default also turns on XLA's GPU autotuning cache, whose directory (below this one) it writes into the
    # compile options, and so into every key (jax/_src/compiler.py, get_compile_options; cache_key.py leaves the
    # field in): an entry would serve only machines whose cache has the same path. A hit loads the tuned
    # executable whole, so that cache adds nothing here.
    jax.config.update("jax_persistent_cache_enable_xla_caches", None)
    if not _listening:
        jax.monitoring.register_event_listener(_on_event)
        _listening = True
    _active = cache
    log.info(
        "event=compile_cache state=on dir=%s entries=%d removed=%d shared=%s copied_from_shared=%d seconds=%.2f",
        cache.directory, checked["kept"], checked["removed"], shared.root_url if shared else "none", copied,
        time.monotonic() - started,
    )  # fmt: skip
    return cache

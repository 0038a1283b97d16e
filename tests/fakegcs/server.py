"""A small Google Cloud Storage JSON-API server for tests, with preconditions and fault injection.

What it emulates, over plain HTTP/1.1 with keep-alive on 127.0.0.1, for the real
`google-cloud-storage` client pointed at it through `STORAGE_EMULATOR_HOST`, and for the real
`gcloud storage` pointed at it through `api_endpoint_overrides/storage` (tests/gcloudcli.py):

- buckets: create (`POST /storage/v1/b`, keeping `location`, `storageClass`, `iamConfiguration`
  and `labels`), get, list, delete (empty buckets only), `getStorageLayout` (a flat namespace),
  and the IAM policy (`GET`/`PUT .../iam`, a stale etag answered 412);
- object inserts: `uploadType=media`, `multipart` (CRLF or gcloud's bare-LF body, quoted
  boundaries) and `resumable` (initiate, also at `/resumable/upload/...`, `PUT` chunks with
  `Content-Range`, status queries with `bytes */N`, cancel), with the client's crc32c or md5
  checked against the bytes received; `compose` (gcloud's parallel composite uploads);
- object reads: metadata (JSON) and media (`alt=media`, also under `/download/...`) with
  `x-goog-generation`, `x-goog-metageneration`, `x-goog-hash`, `x-goog-stored-content-length`
  and single HTTP byte ranges (206 / 416 as GCS answers them);
- listings: `prefix`, `delimiter` (with `prefixes`), `startOffset`, `endOffset`, `maxResults`
  and `pageToken`, items being full object resources including custom `metadata`;
  `includeFoldersAsPrefixes` and `versions` are accepted and change nothing (see PLAIN_LIST_PARAMS);
- delete, metadata patch (merge, `null` removes a key) and update (replace), which bump the
  metageneration only;
- the four generation preconditions with GCS's status codes: 412 when a condition fails on a
  write, delete or patch (and on an insert with `ifGenerationMatch=N` when nothing is there),
  404 when the object is missing on get/delete/patch, 304 when a `...NotMatch` condition fails
  on a read. Errors carry GCS's JSON error body, so the client raises the matching
  `google.api_core.exceptions` type.

Generations are global, monotonic integers (max(last + 1, now in microseconds)), as on GCS:
every write gets a new one and metageneration 1.

Fault injection (Python API on `FakeGCS.faults`, or over HTTP under `/_fake/` through
`FakeGCSAdmin` for other processes): fail the next N matching requests with a status, fail a
seeded random fraction of them, "apply then drop" (the write happens, then the connection is
closed without an answer: the ambiguous outcome of a lost response), and added latency.
Request counts per kind (`writes`, `reads`, `lists`, `deletes`, `faults_injected`) include
attempts that were failed on purpose. Bucket calls are neither counted nor faulted.

What it does not emulate: authentication and IAM checks (policies are kept, never enforced), ACLs,
object versioning (reading or deleting a `generation` other than the live one is a 404), soft
delete, copy / rewrite, XML API, signed URLs, `matchGlob`, `includeTrailingDelimiter`, folders
and managed folders, gzip transcoding,
multi-range reads, retention and holds, notifications. Those calls answer 400 with a
message naming what is missing, never a silent success. State lives in memory only.
"""

from __future__ import annotations

import base64
import bisect
import dataclasses
import datetime as dt
import hashlib
import http.client
import json
import logging
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import google_crc32c

log = logging.getLogger(__name__)

WRITE, READ, LIST, DELETE = "write", "read", "list", "delete"
KINDS = (WRITE, READ, LIST, DELETE)
COUNT_KEYS = {WRITE: "writes", READ: "reads", LIST: "lists", DELETE: "deletes"}
MAX_RESULTS = 1000
BUCKET_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]$")
# Object fields a patch or update may change; everything else is either read-only (ignored,
# as GCS does) or a feature this server does not emulate (rejected).
WRITABLE_FIELDS = (
    "contentType", "cacheControl", "contentDisposition", "contentEncoding", "contentLanguage", "customTime")
READ_ONLY_FIELDS = frozenset(
    "kind id selfLink mediaLink name bucket generation metageneration size md5Hash crc32c etag "
    "timeCreated updated timeStorageClassUpdated storageClass".split()
)
# What a bucket insert may set here (`gcloud storage buckets create --location --uniform-bucket-level-access`
# sends location and iamConfiguration); anything else is refused by name.
BUCKET_INSERT_FIELDS = frozenset({"location", "storageClass", "iamConfiguration", "labels"})
UNEMULATED_LIST_PARAMS = ("matchglob", "includetrailingdelimiter", "softdeleted")
# Listing parameters whose answer on these buckets is the plain listing
# (https://cloud.google.com/storage/docs/json_api/v1/objects/list): includeFoldersAsPrefixes adds
# folders and managed folders to the prefixes, and these buckets have a flat namespace and none;
# versions=true adds noncurrent generations, and these buckets never keep any (versioning off: a
# write or delete ends the old generation). gcloud sends both (`storage ls`, `storage rm -r`).
PLAIN_LIST_PARAMS = ("includefoldersasprefixes", "versions")


class FakeGCSError(Exception):
    """The fake server was driven wrongly (bad fault rule, not started, admin call refused)."""


class ApiError(Exception):
    """A request the server answers with a GCS-style JSON error."""

    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


class NotModified(Exception):
    """A read whose `...NotMatch` precondition failed: answered 304 with no body."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _rfc3339(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def crc32c_b64(data: bytes) -> str:
    return base64.b64encode(google_crc32c.value(data).to_bytes(4, "big")).decode()


def md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


@dataclasses.dataclass(frozen=True)
class StoredObject:
    """One live object. Immutable, so a listing can serialize it after the lock is released."""

    bucket: str
    name: str
    data: bytes
    generation: int
    metageneration: int
    created: dt.datetime
    updated: dt.datetime
    crc32c: str
    md5: str
    metadata: Mapping[str, str]
    fields: Mapping[str, str]  # contentType and the other WRITABLE_FIELDS that are set
    # A composed object's source count; GCS gives such objects a crc32c and no md5Hash
    # (https://cloud.google.com/storage/docs/composite-objects).
    component_count: int | None = None

    def resource(self, base_url: str) -> dict[str, Any]:
        quoted = urllib.parse.quote(self.name, safe="")
        body: dict[str, Any] = {
            "kind": "storage#object",
            "id": f"{self.bucket}/{self.name}/{self.generation}",
            "selfLink": f"{base_url}/storage/v1/b/{self.bucket}/o/{quoted}",
            "mediaLink": (f"{base_url}/download/storage/v1/b/{self.bucket}/o/{quoted}"
                          f"?generation={self.generation}&alt=media"),
            "name": self.name,
            "bucket": self.bucket,
            "generation": str(self.generation),
            "metageneration": str(self.metageneration),
            "storageClass": "STANDARD",
            "size": str(len(self.data)),
            "crc32c": self.crc32c,
            "etag": self.etag,
            "timeCreated": _rfc3339(self.created),
            "updated": _rfc3339(self.updated),
            "timeStorageClassUpdated": _rfc3339(self.created),
        }
        if self.component_count is None:
            body["md5Hash"] = self.md5
        else:
            body["componentCount"] = self.component_count
        body.update(self.fields)
        if self.metadata:  # GCS omits the key when an object has no custom metadata
            body["metadata"] = dict(self.metadata)
        return body

    @property
    def etag(self) -> str:
        return base64.b64encode(f"{self.generation}/{self.metageneration}".encode()).decode()

    @property
    def content_type(self) -> str:
        return self.fields.get("contentType", "application/octet-stream")


@dataclasses.dataclass
class Bucket:
    name: str
    created: dt.datetime
    objects: dict[str, StoredObject] = dataclasses.field(default_factory=dict)
    names: list[str] = dataclasses.field(default_factory=list)  # sorted, for listings
    location: str = "US"
    # What buckets.insert set beside name and location (iamConfiguration, storageClass, labels).
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The bucket's IAM policy (buckets.getIamPolicy / setIamPolicy); its version counts the writes.
    bindings: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    policy_version: int = 1

    def policy(self) -> dict[str, Any]:
        return {"kind": "storage#policy", "resourceId": f"projects/_/buckets/{self.name}", "version": 1,
                "bindings": self.bindings, "etag": base64.b64encode(f"policy-{self.policy_version}".encode()).decode()}

    def resource(self, base_url: str) -> dict[str, Any]:
        return {
            "kind": "storage#bucket",
            "id": self.name,
            "name": self.name,
            "selfLink": f"{base_url}/storage/v1/b/{self.name}",
            "projectNumber": "0",
            "metageneration": "1",
            "location": self.location,
            "locationType": "region" if "-" in self.location else "multi-region",
            "storageClass": "STANDARD",
            "etag": "CAE=",
            **self.settings,
            "timeCreated": _rfc3339(self.created),
            "updated": _rfc3339(self.created),
        }


@dataclasses.dataclass(frozen=True)
class Preconditions:
    if_generation_match: int | None = None
    if_generation_not_match: int | None = None
    if_metageneration_match: int | None = None
    if_metageneration_not_match: int | None = None

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> "Preconditions":
        return cls(*(_int_param(query, key) for key in (
            "ifgenerationmatch", "ifgenerationnotmatch", "ifmetagenerationmatch", "ifmetagenerationnotmatch")))

    def check_write(self, current: StoredObject | None, what: str) -> None:
        """Raise 412 unless the live object (or its absence) satisfies every condition."""
        generation = current.generation if current else 0
        failed = (
            (self.if_generation_match is not None and generation != self.if_generation_match)
            or (self.if_generation_not_match is not None and generation == self.if_generation_not_match)
            or (self.if_metageneration_match is not None
                and (current is None or current.metageneration != self.if_metageneration_match))
            or (self.if_metageneration_not_match is not None and current is not None
                and current.metageneration == self.if_metageneration_not_match)
        )
        if failed:
            raise ApiError(412, "conditionNotMet", f"At least one of the pre-conditions you specified did not hold "
                           f"for {what} (live generation {generation}, conditions {self.describe()}).")

    def check_read(self, current: StoredObject, what: str) -> None:
        """GCS answers 412 for a failed `...Match` on a read, 304 for a failed `...NotMatch`."""
        Preconditions(self.if_generation_match, None, self.if_metageneration_match, None).check_write(current, what)
        if (self.if_generation_not_match == current.generation
                or self.if_metageneration_not_match == current.metageneration):
            raise NotModified()

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                         if getattr(self, f.name) is not None)


@dataclasses.dataclass
class UploadSession:
    """A resumable upload between its initiation and its final chunk."""

    bucket: str
    name: str
    resource: dict[str, Any]  # the JSON metadata sent at initiation
    preconditions: Preconditions
    total: int | None
    received: bytearray = dataclasses.field(default_factory=bytearray)
    finished: StoredObject | None = None
    # Serializes the chunks of one session (a retried chunk may race its original).
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def _int_param(query: Mapping[str, str], key: str) -> int | None:
    raw = query.get(key)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ApiError(400, "invalid", f"query parameter {key}={raw!r} must be an integer") from None


# --------------------------------------------------------------------------------------------
# Faults and counts


@dataclasses.dataclass
class Rule:
    """Which requests a fault applies to; None matches anything."""

    method: str | None = None
    kind: str | None = None
    name_contains: str | None = None
    name_prefix: str | None = None

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in KINDS:
            raise FakeGCSError(f"fault rule kind={self.kind!r} is unknown: use one of {KINDS} or None")
        if self.method is not None:
            self.method = self.method.upper()

    def matches(self, method: str, kind: str, name: str) -> bool:
        return ((self.method is None or self.method == method)
                and (self.kind is None or self.kind == kind)
                and (self.name_contains is None or self.name_contains in name)
                and (self.name_prefix is None or name.startswith(self.name_prefix)))


@dataclasses.dataclass
class _Budgeted:
    rule: Rule
    remaining: int
    status: int = 503


@dataclasses.dataclass
class _Fraction:
    rule: Rule
    probability: float
    status: int
    rng: random.Random


class Faults:
    """Fault rules and request counters, shared by every handler thread under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fail_next: list[_Budgeted] = []
        self._fractions: list[_Fraction] = []
        self._drops: list[_Budgeted] = []
        self._latency: dict[str | None, float] = {}
        self._slow: list[tuple[Rule, float]] = []  # latency for some objects only, on top of the above
        self._counts = dict.fromkeys([*COUNT_KEYS.values(), "faults_injected"], 0)

    def fail_next(self, n: int, status: int = 503, *, method: str | None = None, kind: str | None = None,
                  name_contains: str | None = None, name_prefix: str | None = None) -> None:
        """Answer the next `n` matching requests with `status` (503, 429, ...) without acting on them."""
        _check_status(status)
        rule = Rule(method, kind, name_contains, name_prefix)
        with self._lock:
            self._fail_next.append(_Budgeted(rule, _check_count(n), status))

    def fail_fraction(self, probability: float, status: int = 503, *, seed: int = 0, method: str | None = None,
                      kind: str | None = None, name_contains: str | None = None,
                      name_prefix: str | None = None) -> None:
        """Fail each matching request with probability `probability`, drawn from a seeded RNG."""
        if not 0.0 <= probability <= 1.0:
            raise FakeGCSError(f"fail_fraction probability={probability} must lie in [0, 1]")
        _check_status(status)
        rule = Rule(method, kind, name_contains, name_prefix)
        with self._lock:
            self._fractions.append(_Fraction(rule, probability, status, random.Random(seed)))

    def drop_after_apply(self, n: int, *, method: str | None = None, kind: str | None = WRITE,
                         name_contains: str | None = None, name_prefix: str | None = None) -> None:
        """For the next `n` matching requests that succeed, apply them, then close the connection unanswered."""
        rule = Rule(method, kind, name_contains, name_prefix)
        with self._lock:
            self._drops.append(_Budgeted(rule, _check_count(n)))

    def add_latency(self, seconds: float, kind: str | None = None, *, name_contains: str | None = None) -> None:
        """Delay every request (or every request of `kind`, which then overrides the global delay).
        With `name_contains`, only the matching requests, by at least `seconds`: a request delayed
        before it is applied is in flight all that time (the client has sent it, the store has not
        acted on it)."""
        if seconds < 0:
            raise FakeGCSError(f"latency seconds={seconds} must be >= 0")
        rule = Rule(kind=kind, name_contains=name_contains)  # validates the kind
        with self._lock:
            if name_contains is not None:
                self._slow.append((rule, float(seconds)))
            else:
                self._latency[kind] = float(seconds)

    def reset(self) -> None:
        """Remove every fault rule and latency; counts are kept (see `reset_counts`)."""
        with self._lock:
            self._fail_next.clear()
            self._fractions.clear()
            self._drops.clear()
            self._latency.clear()
            self._slow.clear()

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def reset_counts(self) -> None:
        with self._lock:
            for key in self._counts:
                self._counts[key] = 0

    def admit(self, method: str, kind: str, name: str) -> tuple[float, int | None]:
        """Count one request; return (latency seconds, status to fail it with or None)."""
        with self._lock:
            self._counts[COUNT_KEYS[kind]] += 1
            latency = self._latency.get(kind, self._latency.get(None, 0.0))
            latency = max([latency, *(seconds for rule, seconds in self._slow if rule.matches(method, kind, name))])
            for budget in self._fail_next:
                if budget.remaining > 0 and budget.rule.matches(method, kind, name):
                    budget.remaining -= 1
                    self._counts["faults_injected"] += 1
                    return latency, budget.status
            for fraction in self._fractions:
                if fraction.rule.matches(method, kind, name) and fraction.rng.random() < fraction.probability:
                    self._counts["faults_injected"] += 1
                    return latency, fraction.status
        return latency, None

    def take_drop(self, method: str, kind: str, name: str) -> bool:
        """Whether to drop the answer of this applied request (consumes one unit of a drop rule)."""
        with self._lock:
            for budget in self._drops:
                if budget.remaining > 0 and budget.rule.matches(method, kind, name):
                    budget.remaining -= 1
                    self._counts["faults_injected"] += 1
                    return True
        return False


def _check_status(status: int) -> None:
    if not 400 <= status <= 599:
        raise FakeGCSError(f"fault status={status} must be an HTTP error status (400-599), e.g. 503 or 429")


def _check_count(n: int) -> int:
    if n < 0:
        raise FakeGCSError(f"fault count n={n} must be >= 0")
    return n


#: The principal an injected 403 names (the server checks no credential: tests use anonymous ones).
CALLER = "spawn-worker@test-project.iam.gserviceaccount.com"
#: The permission each kind of request needs, and what a 403 says it was denied on.
_PERMISSIONS = {WRITE: ("storage.objects.create", "object"), READ: ("storage.objects.get", "object"),
                LIST: ("storage.objects.list", "bucket"), DELETE: ("storage.objects.delete", "object")}
_ERROR_REASONS = {400: "invalid", 404: "notFound", 409: "conflict", 412: "conditionNotMet",
                  416: "requestedRangeNotSatisfiable", 429: "rateLimitExceeded", 500: "backendError",
                  501: "notImplemented", 503: "backendError"}


# --------------------------------------------------------------------------------------------
# Storage state


class Storage:
    """Buckets, objects and upload sessions behind one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buckets: dict[str, Bucket] = {}
        self.sessions: dict[str, UploadSession] = {}
        self._last_generation = 0

    def _next_generation(self) -> int:
        self._last_generation = max(self._last_generation + 1, time.time_ns() // 1000)
        return self._last_generation

    def _bucket(self, name: str) -> Bucket:
        bucket = self.buckets.get(name)
        if bucket is None:
            raise ApiError(404, "notFound", f"The specified bucket does not exist: {name}")
        return bucket

    def create_bucket(self, name: str, location: str = "US", settings: Mapping[str, Any] | None = None) -> Bucket:
        if not BUCKET_NAME_RE.match(name):
            raise ApiError(400, "invalid", f"Invalid bucket name: {name!r} (use 3-63 of a-z, 0-9, '-', '_', '.')")
        with self.lock:
            if name in self.buckets:
                raise ApiError(409, "conflict", f"The requested bucket name {name} is already taken.")
            bucket = self.buckets[name] = Bucket(name, _now(), location=location.upper(), settings=dict(settings or {}))
            return bucket

    def set_policy(self, name: str, policy: Mapping[str, Any]) -> Bucket:
        """buckets.setIamPolicy: replace the bindings; a stale etag is a 412, as on GCS."""
        bindings = policy.get("bindings", [])
        if not isinstance(bindings, list) or not all(
                isinstance(b, dict) and isinstance(b.get("role"), str) and isinstance(b.get("members"), list)
                for b in bindings):
            raise ApiError(400, "invalid", f"IAM policy of bucket {name}: bindings must be a list of {{role, members}}")
        with self.lock:
            bucket = self._bucket(name)
            if policy.get("etag") not in (None, bucket.policy()["etag"]):
                raise ApiError(412, "conditionNotMet", f"IAM policy of bucket {name} changed since it was read (etag)")
            bucket.bindings = [dict(b) for b in bindings]
            bucket.policy_version += 1
            return bucket

    def get_bucket(self, name: str) -> Bucket:
        with self.lock:
            return self._bucket(name)

    def delete_bucket(self, name: str) -> None:
        with self.lock:
            if self._bucket(name).objects:
                raise ApiError(409, "conflict", f"The bucket {name} you tried to delete is not empty.")
            del self.buckets[name]

    def commit(self, bucket_name: str, name: str, data: bytes, resource: Mapping[str, Any],
               pre: Preconditions, content_type: str | None) -> StoredObject:
        """Store a new generation of `name` if the preconditions hold."""
        _check_object_name(name)
        crc, md5 = crc32c_b64(data), md5_b64(data)
        for key, actual in (("crc32c", crc), ("md5Hash", md5)):
            claimed = resource.get(key)
            if claimed is not None and claimed != actual:
                raise ApiError(400, "invalid", f"Provided {key} {claimed} does not match the data of {name} "
                               f"({actual}); the upload was corrupted, retry it")
        _check_metadata_field(resource, name)
        fields = _writable_fields(resource, name)
        if content_type and "contentType" not in fields:
            fields["contentType"] = content_type
        metadata = {k: str(v) for k, v in (resource.get("metadata") or {}).items() if v is not None}
        with self.lock:
            bucket = self._bucket(bucket_name)
            current = bucket.objects.get(name)
            pre.check_write(current, f"gs://{bucket_name}/{name}")
            moment = _now()
            stored = StoredObject(bucket_name, name, data, self._next_generation(), 1, moment, moment, crc, md5,
                                  metadata, fields)
            if current is None:
                bisect.insort(bucket.names, name)
            bucket.objects[name] = stored
            return stored

    def compose(self, bucket_name: str, name: str, sources: list[Any], resource: Mapping[str, Any],
                pre: Preconditions) -> StoredObject:
        """objects.compose (https://cloud.google.com/storage/docs/json_api/v1/objects/compose): the
        sources' bytes in order, at most 32 of them, each at its live generation (or the one named,
        with its own ifGenerationMatch), as a new generation of `name` with a crc32c and no md5Hash."""
        if not isinstance(sources, list) or not 1 <= len(sources) <= 32:
            raise ApiError(400, "invalid", f"compose of {name}: sourceObjects must list 1 to 32 objects")
        _check_object_name(name)
        _check_metadata_field(resource, name)
        fields = _writable_fields(resource, name)
        metadata = {k: str(v) for k, v in (resource.get("metadata") or {}).items() if v is not None}
        with self.lock:
            bucket = self._bucket(bucket_name)
            parts = []
            for source in sources:
                if not isinstance(source, dict) or not isinstance(source.get("name"), str):
                    raise ApiError(400, "invalid", f"compose of {name}: each source needs a string 'name'")
                wanted = source.get("generation")
                stored = self._live(bucket_name, source["name"], int(wanted) if wanted is not None else None)
                match = (source.get("objectPreconditions") or {}).get("ifGenerationMatch")
                if match is not None and int(match) != stored.generation:
                    raise ApiError(412, "conditionNotMet", f"compose source {source['name']} is at generation "
                                   f"{stored.generation}, not {match}")
                parts.append(stored)
            data = b"".join(part.data for part in parts)
            current = bucket.objects.get(name)
            pre.check_write(current, f"gs://{bucket_name}/{name}")
            moment = _now()
            count = sum(part.component_count or 1 for part in parts)
            stored = StoredObject(bucket_name, name, data, self._next_generation(), 1, moment, moment,
                                  crc32c_b64(data), "", metadata, fields, component_count=count)
            if current is None:
                bisect.insort(bucket.names, name)
            bucket.objects[name] = stored
            return stored

    def get(self, bucket_name: str, name: str, generation: int | None, pre: Preconditions) -> StoredObject:
        with self.lock:
            current = self._live(bucket_name, name, generation)
        pre.check_read(current, f"gs://{bucket_name}/{name}")
        return current

    def _live(self, bucket_name: str, name: str, generation: int | None) -> StoredObject:
        current = self._bucket(bucket_name).objects.get(name)
        if current is None or (generation is not None and current.generation != generation):
            at = f" at generation {generation}" if generation is not None else ""
            raise ApiError(404, "notFound", f"No such object: {bucket_name}/{name}{at}")
        return current

    def delete(self, bucket_name: str, name: str, generation: int | None, pre: Preconditions) -> None:
        with self.lock:
            current = self._live(bucket_name, name, generation)
            pre.check_write(current, f"gs://{bucket_name}/{name}")
            bucket = self.buckets[bucket_name]
            del bucket.objects[name]
            del bucket.names[bisect.bisect_left(bucket.names, name)]

    def change_metadata(self, bucket_name: str, name: str, generation: int | None, pre: Preconditions,
                        body: Mapping[str, Any], replace: bool) -> StoredObject:
        """PATCH merges `metadata` (a null value removes a key); PUT replaces every writable field."""
        for key in body:
            if key != "metadata" and key not in WRITABLE_FIELDS and key not in READ_ONLY_FIELDS:
                raise ApiError(400, "invalid", f"object field {key!r} cannot be changed on this test server "
                               f"(it supports metadata and {', '.join(WRITABLE_FIELDS)})")
        with self.lock:
            current = self._live(bucket_name, name, generation)
            pre.check_write(current, f"gs://{bucket_name}/{name}")
            metadata = {} if replace or body.get("metadata", {}) is None else dict(current.metadata)
            changes = body.get("metadata") or {}
            if not isinstance(changes, dict):
                raise ApiError(400, "invalid", f"metadata of {name} must be a JSON object of strings")
            for key, value in changes.items():
                if value is None:
                    metadata.pop(key, None)
                else:
                    metadata[key] = str(value)
            fields = {} if replace else dict(current.fields)
            for key in WRITABLE_FIELDS:
                if key in body:
                    if body[key] is None:
                        fields.pop(key, None)
                    else:
                        fields[key] = str(body[key])
            if replace and "contentType" not in fields and "contentType" in current.fields:
                fields["contentType"] = current.fields["contentType"]
            updated = dataclasses.replace(current, metageneration=current.metageneration + 1, updated=_now(),
                                          metadata=metadata, fields=fields)
            self.buckets[bucket_name].objects[name] = updated
            return updated

    def list_page(self, bucket_name: str, prefix: str, delimiter: str, start_offset: str, end_offset: str,
                  resume_at: str, max_results: int) -> tuple[list[StoredObject], list[str], str | None]:
        """One page of a listing: (objects, prefixes, name to resume from or None)."""
        items: list[StoredObject] = []
        prefixes: list[str] = []
        with self.lock:
            bucket = self._bucket(bucket_name)
            names = bucket.names
            i = bisect.bisect_left(names, max(prefix, start_offset, resume_at))
            while i < len(names):
                name = names[i]
                if not name.startswith(prefix) or (end_offset and name >= end_offset):
                    return items, prefixes, None
                if len(items) + len(prefixes) >= max_results:
                    return items, prefixes, name
                cut = name.find(delimiter, len(prefix)) if delimiter else -1
                if cut >= 0:
                    group = name[: cut + len(delimiter)]
                    prefixes.append(group)
                    while i < len(names) and names[i].startswith(group):
                        i += 1
                else:
                    items.append(bucket.objects[name])
                    i += 1
        return items, prefixes, None

    def start_upload(self, bucket_name: str, name: str, resource: dict[str, Any], pre: Preconditions,
                     total: int | None) -> str:
        _check_object_name(name)
        _check_metadata_field(resource, name)
        with self.lock:
            # GCS checks preconditions when the session starts and again when it completes.
            pre.check_write(self._bucket(bucket_name).objects.get(name), f"gs://{bucket_name}/{name}")
            upload_id = uuid.uuid4().hex
            self.sessions[upload_id] = UploadSession(bucket_name, name, resource, pre, total)
            return upload_id

    def session(self, upload_id: str) -> UploadSession:
        with self.lock:
            session = self.sessions.get(upload_id)
        if session is None:
            raise ApiError(404, "notFound", f"No such resumable upload session: upload_id={upload_id}")
        return session

    def cancel_upload(self, upload_id: str) -> None:
        with self.lock:
            if self.sessions.pop(upload_id, None) is None:
                raise ApiError(404, "notFound", f"No such resumable upload session: upload_id={upload_id}")


def _check_object_name(name: str) -> None:
    if not name or len(name.encode()) > 1024 or "\r" in name or "\n" in name:
        raise ApiError(400, "invalid", f"object name {name!r} is not valid (1-1024 bytes, no CR or LF)")


def _check_metadata_field(resource: Mapping[str, Any], name: str) -> None:
    """An insert whose resource says `"metadata": null` is refused with 500, as stricter implementations of
    the JSON API do (real GCS is lenient). A client must leave the key out when there is no custom metadata;
    a 500 is retried, so a client that sends null would retry until its deadline."""
    if "metadata" in resource and resource["metadata"] is None:
        raise ApiError(500, "backendError", f"insert of {name}: resource field 'metadata' is null; "
                       "omit the key when the object has no custom metadata")


def _writable_fields(resource: Mapping[str, Any], name: str) -> dict[str, str]:
    known = {"name", "bucket", "metadata", "crc32c", "md5Hash", "kind", "size", "storageClass"}
    for key in resource:
        if key not in known and key not in WRITABLE_FIELDS:
            raise ApiError(400, "invalid", f"object field {key!r} on {name} is not emulated by this test server")
    return {key: str(resource[key]) for key in WRITABLE_FIELDS if resource.get(key) is not None}


# --------------------------------------------------------------------------------------------
# HTTP


_CONTENT_RANGE_RE = re.compile(r"^bytes (?:(\d+)-(\d+)|\*)/(\d+|\*)$")
_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")


class _Dropped(Exception):
    """Raised after an applied request whose answer a fault rule says to swallow."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def setup(self) -> None:
        super().setup()
        # Responses go out in one write, but turn Nagle off anyway so that no 40 ms
        # delayed-ACK stall ever appears in the benchmarks.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("event=http %s", format % args)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # -- plumbing

    def _dispatch(self, method: str) -> None:
        parts = urllib.parse.urlsplit(self.path)
        query = {k.lower(): v for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)}
        try:
            body = self._read_body()
        except ValueError as error:
            self.close_connection = True  # the framing is lost; this connection cannot be reused
            return self._send_error(ApiError(400, "invalid", f"unreadable request body: {error}"))
        try:
            if parts.path.startswith("/_fake/"):
                self._admin(method, parts.path, body)
            else:
                self._api(method, parts.path, query, body)
        except ApiError as error:
            self._send_error(error)
        except NotModified:
            self._send(304, b"", {})
        except _Dropped:
            self.close_connection = True  # the applied request's answer is lost on purpose
        except FakeGCSError as error:
            self._send_error(ApiError(400, "invalid", str(error)))
        except Exception as error:  # a bug in this server: answer 500 with the cause, and log the traceback
            log.exception("event=fakegcs_internal_error method=%s path=%s", method, parts.path)
            self.close_connection = True
            self._send_error(ApiError(500, "backendError", f"fake GCS internal error: {error!r}"))

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        reason = http.client.responses.get(status, "Unknown")
        lines = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(body)}"]
        lines += [f"{key}: {value}" for key, value in headers.items()]
        if self.close_connection:
            lines.append("Connection: close")
        self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        self.log_request(status, len(body))

    def _send_json(self, status: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(),
                   {"Content-Type": "application/json; charset=UTF-8", **(headers or {})})

    def _send_error(self, error: ApiError) -> None:
        self._send_json(error.code, {"error": {"code": error.code, "message": error.message, "errors": [
            {"domain": "global", "reason": error.reason, "message": error.message}]}})

    def _base_url(self) -> str:
        return f"http://{self.headers.get('Host') or self.server.fake.url.removeprefix('http://')}"

    def _json_body(self, body: bytes) -> dict[str, Any]:
        if not body.strip():
            return {}
        try:
            parsed = json.loads(body)
        except ValueError as error:
            raise ApiError(400, "parseError", f"request body is not JSON: {error}") from None
        if not isinstance(parsed, dict):
            raise ApiError(400, "invalid", "request body must be a JSON object")
        return parsed

    # -- the storage API

    def _api(self, method: str, path: str, query: dict[str, str], body: bytes) -> None:
        segments = path.split("/")  # ['', 'storage'|'upload'|'download', 'storage'?, ...]
        if path.startswith("/storage/v1/b"):
            rest = segments[3:]
        elif path.startswith(("/upload/storage/v1/b", "/download/storage/v1/b")):
            rest = segments[4:]
        elif path.startswith("/resumable/upload/storage/v1/b"):
            # The discovery document's resumable path (`mediaUpload.protocols.resumable`), which gcloud uses.
            path, rest = path.removeprefix("/resumable"), segments[5:]
        else:
            raise ApiError(404, "notFound", f"no such endpoint on the GCS test server: {method} {path}")
        # rest: ['b'] | ['b', bucket] | ['b', bucket, 'o'] | ['b', bucket, 'o', quoted-name...]
        if rest[0] != "b":
            raise ApiError(404, "notFound", f"no such endpoint on the GCS test server: {method} {path}")
        if len(rest) <= 2:
            return self._bucket_call(method, rest[1] if len(rest) == 2 else None, body)
        bucket = rest[1]
        if rest[2:] == ["iam"] and path.startswith("/storage/"):
            return self._bucket_iam(method, bucket, body)
        if rest[2:] == ["storageLayout"] and method == "GET":
            # buckets.getStorageLayout, which `gcloud storage rm -r` asks first: a flat namespace here
            # (https://cloud.google.com/storage/docs/json_api/v1/buckets/getStorageLayout).
            found = self.server.fake.storage.get_bucket(bucket).resource(self._base_url())
            return self._send_json(200, {"kind": "storage#storageLayout", "bucket": bucket,
                                         "location": found["location"], "locationType": found["locationType"],
                                         "hierarchicalNamespace": {"enabled": False}})
        if rest[2] != "o":
            raise ApiError(400, "invalid", f"bucket sub-resource {rest[2]!r} is not emulated by this test server ({method} {path})")
        name = urllib.parse.unquote("/".join(rest[3:])) if len(rest) > 3 else None
        if path.startswith("/upload/"):
            return self._upload(method, bucket, query, body)
        if path.startswith("/download/"):
            if method != "GET" or name is None:
                raise ApiError(405, "invalid", f"{method} {path}: the download endpoint only serves GET of an object")
            return self._object_get(bucket, name, query, media=True)
        if name is None:
            if method != "GET":
                raise ApiError(400, "invalid", f"{method} on /o without an upload is not emulated; "
                               "inserts go to /upload/storage/v1")
            return self._list(bucket, query)
        if "/" in name and name.rsplit("/", 1)[1] == "compose" and method == "POST":
            return self._compose(bucket, name.rsplit("/", 1)[0], query, body)
        copy = re.search(r"/(copyTo|rewriteTo)/b/", name)
        if copy and method == "POST":
            raise ApiError(400, "invalid", f"{copy.group(1)} (a copy inside the store) is not emulated by this test server")
        if method == "GET":
            return self._object_get(bucket, name, query, media=query.get("alt") == "media")
        if method == "DELETE":
            return self._guarded(method, DELETE, name, lambda: self._object_delete(bucket, name, query))
        if method in ("PATCH", "PUT"):
            return self._guarded(method, WRITE, name, lambda: self._object_patch(bucket, name, query, body, method))
        raise ApiError(405, "invalid", f"{method} is not allowed on an object ({path})")

    def _guarded(self, method: str, kind: str, name: str, handle) -> None:
        """Count, delay and fault one request, then run `handle`, which sends the answer."""
        latency, fail_status = self.server.fake.faults.admit(method, kind, name)
        if latency:
            time.sleep(latency)  # the latency a test asked of the server (faults.add_latency): a slow request
        if fail_status == 403:
            # What Cloud Storage says to a caller without the permission
            # (https://cloud.google.com/storage/docs/troubleshooting, "403: Forbidden").
            permission, what = _PERMISSIONS[kind]
            raise ApiError(403, "forbidden", f"{CALLER} does not have {permission} access to the Google Cloud "
                                             f"Storage {what}. Permission '{permission}' denied on resource "
                                             f"(or it may not exist).")  # fmt: skip
        if fail_status is not None:
            raise ApiError(fail_status, _ERROR_REASONS.get(fail_status, "injected"),
                           f"injected fault: {method} {kind} {name!r} answered {fail_status}")
        handle()

    def _maybe_drop(self, method: str, kind: str, name: str) -> None:
        if self.server.fake.faults.take_drop(method, kind, name):
            log.info("event=fault_drop method=%s kind=%s name=%s", method, kind, name)
            raise _Dropped()

    def _bucket_call(self, method: str, bucket: str | None, body: bytes) -> None:
        storage, base = self.server.fake.storage, self._base_url()
        if bucket is None and method == "POST":
            request = self._json_body(body)
            name = request.pop("name", None)
            if not isinstance(name, str):
                raise ApiError(400, "required", "bucket insert needs a JSON body with a string 'name'")
            unknown = sorted(set(request) - BUCKET_INSERT_FIELDS)
            if unknown:
                raise ApiError(400, "invalid", f"bucket insert field(s) {', '.join(unknown)} are not emulated by this "
                               f"test server (it keeps {', '.join(sorted(BUCKET_INSERT_FIELDS))})")
            location = request.pop("location", "US")
            return self._send_json(200, storage.create_bucket(name, location, request).resource(base))
        if bucket is None and method == "GET":
            with storage.lock:
                buckets = sorted(storage.buckets.values(), key=lambda b: b.name)
            return self._send_json(200, {"kind": "storage#buckets", "items": [b.resource(base) for b in buckets]})
        if bucket is not None and method == "GET":
            return self._send_json(200, storage.get_bucket(bucket).resource(base))
        if bucket is not None and method == "DELETE":
            storage.delete_bucket(bucket)
            return self._send(204, b"", {})
        raise ApiError(400, "invalid", f"{method} on buckets is not emulated by this test server")

    def _bucket_iam(self, method: str, bucket: str, body: bytes) -> None:
        storage = self.server.fake.storage
        if method == "GET":
            return self._send_json(200, storage.get_bucket(bucket).policy())
        if method == "PUT":
            return self._send_json(200, storage.set_policy(bucket, self._json_body(body)).policy())
        raise ApiError(400, "invalid", f"{method} on the IAM policy of bucket {bucket} is not emulated")

    def _object_get(self, bucket: str, name: str, query: dict[str, str], media: bool) -> None:
        def handle() -> None:
            stored = self.server.fake.storage.get(bucket, name, _int_param(query, "generation"),
                                                  Preconditions.from_query(query))
            self._maybe_drop("GET", READ, name)
            if media:
                self._send_media(stored)
            else:
                self._send_json(200, stored.resource(self._base_url()))
        self._guarded("GET", READ, name, handle)

    def _send_media(self, stored: StoredObject) -> None:
        size = len(stored.data)
        headers = {
            "Content-Type": stored.content_type,
            "ETag": stored.etag,
            "Accept-Ranges": "bytes",
            "x-goog-generation": str(stored.generation),
            "x-goog-metageneration": str(stored.metageneration),
            "x-goog-hash": f"crc32c={stored.crc32c}" + (f",md5={stored.md5}" if stored.component_count is None else ""),
            "x-goog-stored-content-length": str(size),
            "x-goog-stored-content-encoding": "identity",
            "x-goog-storage-class": "STANDARD",
        }
        requested = self.headers.get("Range")
        if not requested:
            return self._send(200, stored.data, headers)
        match = _RANGE_RE.match(requested.strip())
        if match is None or match.group(1) == match.group(2) == "":
            raise ApiError(400, "invalid", f"Range header {requested!r} is not a single 'bytes=a-b' range")
        first, last = match.groups()
        if first == "":  # suffix range: the last N bytes
            start, end = max(0, size - int(last)), size - 1
        else:
            start, end = int(first), min(size - 1, int(last)) if last else size - 1
        if start >= size or start > end:
            self._send(416, b"", {**headers, "Content-Range": f"bytes */{size}"})
            return
        self._send(206, stored.data[start:end + 1], {**headers, "Content-Range": f"bytes {start}-{end}/{size}"})

    def _object_delete(self, bucket: str, name: str, query: dict[str, str]) -> None:
        self.server.fake.storage.delete(bucket, name, _int_param(query, "generation"), Preconditions.from_query(query))
        self._maybe_drop("DELETE", DELETE, name)
        self._send(204, b"", {})

    def _object_patch(self, bucket: str, name: str, query: dict[str, str], body: bytes, method: str) -> None:
        stored = self.server.fake.storage.change_metadata(bucket, name, _int_param(query, "generation"),
                                                          Preconditions.from_query(query), self._json_body(body),
                                                          replace=method == "PUT")
        self._maybe_drop(method, WRITE, name)
        self._send_json(200, stored.resource(self._base_url()))

    def _compose(self, bucket: str, name: str, query: dict[str, str], body: bytes) -> None:
        request = self._json_body(body)

        def handle() -> None:
            stored = self.server.fake.storage.compose(bucket, name, request.get("sourceObjects"),
                                                      request.get("destination") or {}, Preconditions.from_query(query))
            self._maybe_drop("POST", WRITE, name)
            self._send_json(200, stored.resource(self._base_url()))
        self._guarded("POST", WRITE, name, handle)

    def _list(self, bucket: str, query: dict[str, str]) -> None:
        for key in UNEMULATED_LIST_PARAMS:
            if query.get(key, "false").lower() not in ("", "false"):
                raise ApiError(400, "invalid",
                               f"list parameter {key}={query[key]!r} is not emulated by this test server")
        for key in PLAIN_LIST_PARAMS:
            if query.get(key, "false").lower() not in ("", "false", "true"):
                raise ApiError(400, "invalid", f"list parameter {key}={query[key]!r} must be true or false")
        prefix = query.get("prefix", "")

        def handle() -> None:
            resume_at = ""
            if query.get("pagetoken"):
                try:
                    resume_at = base64.urlsafe_b64decode(query["pagetoken"].encode()).decode()
                except ValueError:
                    raise ApiError(400, "invalid",
                                   f"pageToken {query['pagetoken']!r} was not issued by this server") from None
            max_results = _int_param(query, "maxresults") or MAX_RESULTS
            items, prefixes, resume = self.server.fake.storage.list_page(
                bucket, prefix, query.get("delimiter", ""), query.get("startoffset", ""), query.get("endoffset", ""),
                resume_at, max(1, min(MAX_RESULTS, max_results)))
            base = self._base_url()
            page: dict[str, Any] = {"kind": "storage#objects"}
            if items:
                page["items"] = [stored.resource(base) for stored in items]
            if prefixes:
                page["prefixes"] = prefixes
            if resume is not None:
                page["nextPageToken"] = base64.urlsafe_b64encode(resume.encode()).decode()
            self._send_json(200, page)
        self._guarded("GET", LIST, prefix, handle)

    # -- uploads

    def _upload(self, method: str, bucket: str, query: dict[str, str], body: bytes) -> None:
        storage = self.server.fake.storage
        upload_type = query.get("uploadtype", "")
        if "upload_id" in query:
            session = storage.session(query["upload_id"])
            if method == "DELETE":
                storage.cancel_upload(query["upload_id"])
                return self._send(499, b"", {})
            if method != "PUT":
                raise ApiError(405, "invalid", f"{method} on a resumable session; use PUT with Content-Range")
            return self._guarded("PUT", WRITE, session.name, lambda: self._upload_chunk(session, body))
        if method != "POST":
            raise ApiError(405, "invalid", f"{method} {upload_type!r} upload: inserts are POSTs")
        pre = Preconditions.from_query(query)
        if upload_type == "media":
            name = query.get("name", "")
            resource = {"name": name}
            data, content_type = body, self.headers.get("Content-Type")
        elif upload_type == "multipart":
            resource, data, content_type = _parse_multipart(self.headers.get("Content-Type", ""), body)
            name = query.get("name") or resource.get("name", "")
        elif upload_type == "resumable":
            resource = self._json_body(body)
            name = query.get("name") or resource.get("name", "")
            total = self.headers.get("X-Upload-Content-Length")
            if self.headers.get("X-Upload-Content-Type") and "contentType" not in resource:
                resource["contentType"] = self.headers["X-Upload-Content-Type"]
            resource["name"] = name

            def start() -> None:
                upload_id = storage.start_upload(bucket, name, resource, pre, int(total) if total else None)
                self._maybe_drop("POST", WRITE, name)
                location = (f"{self._base_url()}/upload/storage/v1/b/{bucket}/o"
                            f"?uploadType=resumable&upload_id={upload_id}")
                self._send(200, b"", {"Location": location, "X-GUploader-UploadID": upload_id})
            return self._guarded("POST", WRITE, name, start)
        else:
            raise ApiError(400, "invalid", f"uploadType={upload_type!r} is not one of media, multipart, resumable")

        def insert() -> None:
            stored = storage.commit(bucket, name, data, resource, pre, content_type)
            self._maybe_drop("POST", WRITE, name)
            self._send_json(200, stored.resource(self._base_url()))
        self._guarded("POST", WRITE, name, insert)

    def _upload_chunk(self, session: UploadSession, body: bytes) -> None:
        header = self.headers.get("Content-Range")
        if header is None:  # a single PUT carrying the whole object
            first, last, total = (0, len(body) - 1, len(body)) if body else (None, None, 0)
        else:
            match = _CONTENT_RANGE_RE.match(header.strip())
            if match is None:
                raise ApiError(400, "invalid",
                               f"Content-Range {header!r} is not 'bytes a-b/N', 'bytes a-b/*' or 'bytes */N'")
            first = int(match.group(1)) if match.group(1) else None
            last = int(match.group(2)) if match.group(2) else None
            total = None if match.group(3) == "*" else int(match.group(3))
        with session.lock:
            if session.finished is None:
                self._append_chunk(session, first, last, total, body, header)
            finished = session.finished
            received = len(session.received)
        self._maybe_drop("PUT", WRITE, session.name)
        if finished is not None:  # also the answer to a status query after completion, as on GCS
            return self._send_json(200, finished.resource(self._base_url()))
        self._send(308, b"", {"Range": f"bytes=0-{received - 1}"} if received else {})

    def _append_chunk(self, session: UploadSession, first: int | None, last: int | None, total: int | None,
                      body: bytes, header: str | None) -> None:
        """Add one chunk to the session (caller holds session.lock); commit when the last byte is in."""
        if first is not None:
            if last - first + 1 != len(body):
                raise ApiError(400, "invalid", f"Content-Range {header!r} spans {last - first + 1} bytes "
                               f"but the body holds {len(body)}")
            if first > len(session.received):
                raise ApiError(400, "invalid", f"chunk starts at byte {first} but only "
                               f"{len(session.received)} bytes of {session.name} were received")
            session.received += body[len(session.received) - first:]  # a resent chunk overlaps what we hold
        if total is not None:
            session.total = total
        if session.total is None or len(session.received) < session.total:
            return
        if len(session.received) > session.total:
            raise ApiError(400, "invalid", f"upload of {session.name} received {len(session.received)} bytes, "
                           f"more than the declared {session.total}")
        session.finished = self.server.fake.storage.commit(
            session.bucket, session.name, bytes(session.received), session.resource, session.preconditions,
            session.resource.get("contentType"))
        session.received = bytearray()  # the object holds the bytes now; the session only answers queries

    # -- admin endpoints for other processes (see FakeGCSAdmin)

    def _admin(self, method: str, path: str, body: bytes) -> None:
        fake = self.server.fake
        args = self._json_body(body)
        actions = {
            ("POST", "/_fake/faults/fail_next"): lambda: fake.faults.fail_next(**args),
            ("POST", "/_fake/faults/fail_fraction"): lambda: fake.faults.fail_fraction(**args),
            ("POST", "/_fake/faults/drop_after_apply"): lambda: fake.faults.drop_after_apply(**args),
            ("POST", "/_fake/faults/latency"): lambda: fake.faults.add_latency(**args),
            ("POST", "/_fake/faults/reset"): fake.faults.reset,
            ("POST", "/_fake/counts/reset"): fake.reset_counts,
            ("POST", "/_fake/buckets"): lambda: fake.create_bucket(**args),
        }
        if method == "GET" and path == "/_fake/counts":
            return self._send_json(200, fake.counts())
        action = actions.get((method, path))
        if action is None:
            raise ApiError(404, "notFound", f"no admin endpoint {method} {path}; see FakeGCSAdmin for the list")
        try:
            action()
        except TypeError as error:  # wrong argument names in the JSON body
            raise ApiError(400, "invalid", f"{method} {path}: {error}") from None
        self._send_json(200, {"ok": True})


def _parse_multipart(content_type: str, body: bytes) -> tuple[dict[str, Any], bytes, str | None]:
    """Split a multipart/related upload into (JSON resource, media bytes, media content type).

    Read as RFC 2046 reads it, and as leniently as GCS does: the boundary may be quoted with double
    or single quotes (gcloud's Python email generator writes `boundary='===...=='`), and lines may
    end in CRLF or in a bare LF (gcloud's body has LF only). The line break before each delimiter
    belongs to the delimiter, so the media keeps every byte it was sent with."""
    match = re.search(r"""boundary=(?:"([^"]+)"|'([^']+)'|([^;\s]+))""", content_type)
    if not content_type.startswith("multipart/related") or match is None:
        raise ApiError(400, "invalid",
                       f"multipart upload needs Content-Type multipart/related with a boundary, got {content_type!r}")
    delimiter = b"--" + next(g for g in match.groups() if g).encode()
    first = body.find(delimiter)
    if first < 0:
        raise ApiError(400, "invalid", "multipart upload body holds no boundary delimiter")
    # One line-break style for the whole body, read off the first delimiter line; splitting on that
    # exact sequence keeps a media part that ends in a bare CR or LF whole.
    eol = b"\r\n" if body[first + len(delimiter):].startswith(b"\r\n") else b"\n"
    parts = (eol + body[first:]).split(eol + delimiter)
    # ['', JSON part, media part, '--' + epilogue]
    if len(parts) != 4 or not parts[3].startswith(b"--"):
        raise ApiError(400, "invalid", f"multipart upload body must hold exactly a JSON part and a media part, "
                       f"found {max(0, len(parts) - 2)} parts")

    def split_part(part: bytes) -> tuple[dict[str, str], bytes]:
        head, sep, payload = part.removeprefix(eol).partition(eol + eol)
        if not part.startswith(eol) or not sep:
            raise ApiError(400, "invalid", "malformed multipart part (delimiter line, headers, blank line, payload expected)")
        headers = {}
        for line in head.decode("latin-1").split(eol.decode()):
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        return headers, payload

    _, json_part = split_part(parts[1])
    media_headers, media = split_part(parts[2])
    encoding = media_headers.get("content-transfer-encoding", "binary").lower()
    if encoding == "base64":
        media = base64.b64decode(media)
    elif encoding not in ("binary", "8bit", "7bit"):
        raise ApiError(400, "invalid", f"multipart media part: Content-Transfer-Encoding {encoding!r} is not emulated")
    try:
        resource = json.loads(json_part)
    except ValueError as error:
        raise ApiError(400, "parseError", f"multipart metadata part is not JSON: {error}") from None
    return resource, media, media_headers.get("content-type")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # the default of 5 drops SYNs when 64 client threads connect at once

    def __init__(self, address: tuple[str, int], fake: "FakeGCS"):
        self.fake = fake
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def track(self, connection: socket.socket, is_open: bool) -> None:
        with self._connections_lock:
            (self._connections.add if is_open else self._connections.discard)(connection)

    def close_connections(self) -> None:
        """Wake handler threads parked on idle keep-alive connections so that stop() leaves none behind."""
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError as error:  # the peer closed it meanwhile
                log.debug("event=close_connection_skipped reason=%s", error)


class FakeGCS:
    """The embeddable server: `FakeGCS().start()`, then point clients at `.url`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.storage = Storage()
        self.faults = Faults()
        self._address = (host, port)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "FakeGCS":
        if self._server is not None:
            raise FakeGCSError(f"FakeGCS at {self.url} is already started")
        self._server = _Server(self._address, self)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="fakegcs", daemon=True)
        self._thread.start()
        log.info("event=fakegcs_started url=%s", self.url)
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()
        self._thread.join()
        log.info("event=fakegcs_stopped url=%s", self.url)
        self._server = self._thread = None

    def __enter__(self) -> "FakeGCS":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._server is None:
            raise FakeGCSError("FakeGCS has no URL until start() is called")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def create_bucket(self, name: str) -> None:
        self.storage.create_bucket(name)

    def counts(self) -> dict[str, int]:
        return self.faults.counts()

    def reset_counts(self) -> None:
        self.faults.reset_counts()


class _RemoteFaults:
    """Same methods as `Faults`, sent to a server in another process."""

    def __init__(self, admin: "FakeGCSAdmin"):
        self._admin = admin

    def fail_next(self, n: int, status: int = 503, **rule: Any) -> None:
        self._admin.call("POST", "/_fake/faults/fail_next", {"n": n, "status": status, **rule})

    def fail_fraction(self, probability: float, status: int = 503, **rule: Any) -> None:
        self._admin.call("POST", "/_fake/faults/fail_fraction", {"probability": probability, "status": status, **rule})

    def drop_after_apply(self, n: int, **rule: Any) -> None:
        self._admin.call("POST", "/_fake/faults/drop_after_apply", {"n": n, **rule})

    def add_latency(self, seconds: float, kind: str | None = None) -> None:
        self._admin.call("POST", "/_fake/faults/latency", {"seconds": seconds, "kind": kind})

    def reset(self) -> None:
        self._admin.call("POST", "/_fake/faults/reset", {})


class FakeGCSAdmin:
    """Drive a FakeGCS that runs elsewhere (e.g. `python -m tests.fakegcs`) through `/_fake/`."""

    def __init__(self, url: str, timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.faults = _RemoteFaults(self)

    def call(self, method: str, path: str, payload: Mapping[str, Any] | None = None) -> Any:
        data = json.dumps(payload).encode() if payload is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            raise FakeGCSError(f"admin call {method} {path} on {self.url} failed with {error.code}: "
                               f"{error.read().decode(errors='replace')}") from error

    def create_bucket(self, name: str) -> None:
        self.call("POST", "/_fake/buckets", {"name": name})

    def counts(self) -> dict[str, int]:
        return self.call("GET", "/_fake/counts")

    def reset_counts(self) -> None:
        self.call("POST", "/_fake/counts/reset", {})

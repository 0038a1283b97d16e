"""The GCE metadata server, as seen from inside a VM or TPU VM.

Every fact a machine learns about itself (name, zone, project, the group that created it, the
spawn-* attributes the launch tools set, whether it is being preempted) comes through here.
`GCE_METADATA_HOST` (host[:port], the variable google-auth also honours) points it at another
server; tests use that to reach a fake on 127.0.0.1.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import requests
import tenacity

log = logging.getLogger(__name__)

# The link-local address, rather than metadata.google.internal, so that a machine off GCP
# fails fast instead of waiting on a DNS lookup.
DEFAULT_HOST = "169.254.169.254"
HOST_ENV = "GCE_METADATA_HOST"
FLAVOR = {"Metadata-Flavor": "Google"}


class MetadataError(Exception):
    """The metadata server could not be reached or did not answer as a metadata server."""


class MetadataNotFound(MetadataError):
    """The server answered 404 for that path."""


class MetadataUnavailable(MetadataError):
    """The server answered 5xx; worth another try."""


def metadata_host() -> str:
    return os.environ.get(HOST_ENV) or DEFAULT_HOST


def _transient(err: BaseException) -> bool:
    return isinstance(err, (requests.ConnectionError, requests.Timeout, MetadataUnavailable))


class MetadataClient:
    """Reads `computeMetadata/v1/...` paths; every request carries and checks `Metadata-Flavor: Google`."""

    def __init__(self, host: str | None = None, timeout_s: float = 5.0, session: requests.Session | None = None):
        self.host = host or metadata_host()
        self.base_url = f"http://{self.host}/computeMetadata/v1/"
        self.timeout_s = timeout_s
        self._session = session
        self._per_thread = threading.local()

    @property
    def session(self) -> requests.Session:
        # requests sessions are not thread-safe, and the preemption watcher polls from two threads.
        if self._session is not None:
            return self._session
        if not hasattr(self._per_thread, "session"):
            self._per_thread.session = requests.Session()
        return self._per_thread.session

    def _get(self, path: str, params: dict[str, str] | None = None, timeout_s: float | None = None) -> requests.Response:
        url = self.base_url + path
        resp = self.session.get(url, params=params, headers=FLAVOR, timeout=timeout_s or self.timeout_s)
        # A captive proxy or some other web server answering on that address is not a metadata server.
        if resp.headers.get("Metadata-Flavor") != "Google":
            raise MetadataError(f"{url} answered without 'Metadata-Flavor: Google'; is {HOST_ENV} right?")
        if resp.status_code == 404:
            raise MetadataNotFound(f"metadata path {path!r} does not exist on {self.host}")
        if resp.status_code >= 500:
            raise MetadataUnavailable(f"metadata path {path!r} on {self.host} answered status={resp.status_code}")
        if resp.status_code != 200:
            raise MetadataError(f"metadata path {path!r} on {self.host} answered status={resp.status_code}")
        return resp

    @tenacity.retry(
        retry=tenacity.retry_if_exception(_transient),
        stop=tenacity.stop_after_attempt(4),
        wait=tenacity.wait_random_exponential(multiplier=0.2, max=2),
        reraise=True,
    )
    def text(self, path: str) -> str:
        """The value at `path` as text (`alt=text`); raises MetadataNotFound on 404."""
        return self._get(path, params={"alt": "text"}).text

    def json(self, path: str) -> object:
        """A directory as one JSON document (`recursive=true`)."""
        return self._get(path, params={"recursive": "true", "alt": "json"}).json()

    def attribute(self, name: str, default: str | None = None) -> str | None:
        """Instance attribute `name` (set by the launch tools), or `default` when it is not set."""
        try:
            return self.text(f"instance/attributes/{name}")
        except MetadataNotFound:
            return default

    def wait_for_change(self, path: str, last_etag: str | None, timeout_s: int) -> tuple[str, str]:
        """Long-poll `path`: returns (value, etag) once the value's etag differs from `last_etag`,
        or the unchanged value after about `timeout_s` seconds."""
        params = {"wait_for_change": "true", "timeout_sec": str(timeout_s), "alt": "text"}
        if last_etag:
            params["last_etag"] = last_etag
        # The server holds the request for up to timeout_s; give the socket a little longer.
        resp = self._get(path, params=params, timeout_s=timeout_s + 10)
        return resp.text, resp.headers.get("ETag", "")

    def current(self, path: str) -> tuple[str, str]:
        """(value, etag) now, without waiting."""
        resp = self._get(path, params={"alt": "text"})
        return resp.text, resp.headers.get("ETag", "")


@functools.cache
def _probe(host: str) -> bool:
    try:
        MetadataClient(host, timeout_s=1.0)._get("", timeout_s=1.0)
    except (requests.RequestException, MetadataError) as err:
        log.info("event=metadata_probe host=%s on_gcp=false reason=%s", host, type(err).__name__)
        return False
    log.info("event=metadata_probe host=%s on_gcp=true", host)
    return True


def on_gcp() -> bool:
    """Whether a metadata server answers (at most ~1 s, then cached per host for the process)."""
    return _probe(metadata_host())

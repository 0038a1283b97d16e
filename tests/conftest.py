"""Suite-wide setup: JAX on a 4-device CPU host, and a fake GCS server the real client talks to.

The environment variables are set at import, before any test module can import jax; a caller
who exports them (e.g. to run on an accelerator) keeps their own values.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The machine caches of consume.py (compiled programs, weights: extract/cachedir.py) go to one directory per test
# process, never the user's ~/.cache; tests that check them set their own.
if "XDG_CACHE_HOME" not in os.environ:
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="xdg-cache-")
    atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)

import uuid  # noqa: E402 (after the environment is fixed)
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from tests.fakegcs import FakeGCS  # noqa: E402

TEST_PROJECT = "fake-project"


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[FakeGCS]:
    """One server for the whole session; tests isolate themselves with their own bucket."""
    server = FakeGCS().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def gcs(gcs_server: FakeGCS) -> Iterator[FakeGCS]:
    """The session server with no faults and zeroed counts; faults are cleared again afterwards."""
    gcs_server.faults.reset()
    gcs_server.reset_counts()
    yield gcs_server
    gcs_server.faults.reset()


@pytest.fixture
def gcs_bucket(gcs: FakeGCS) -> str:
    """A fresh, empty bucket on the server, unique to this test."""
    name = f"test-{uuid.uuid4().hex[:16]}"
    gcs.create_bucket(name)
    return name


@pytest.fixture
def gcs_client(gcs: FakeGCS, monkeypatch: pytest.MonkeyPatch):
    """A real google.cloud.storage.Client talking to the server.

    STORAGE_EMULATOR_HOST is set in os.environ for the test, so subprocesses it starts (and
    clients they build, e.g. through objectstore.open_store) reach the same server.
    """
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
    client = storage.Client(project=TEST_PROJECT, credentials=AnonymousCredentials())
    yield client
    client.close()

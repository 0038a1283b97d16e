"""Fixtures for the cloud glue: a fake metadata server, fake Compute/TPU APIs, real clients on them."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.auth.credentials import AnonymousCredentials

from fleet import compute, tpu
from fleet.metadata import MetadataClient
from tests.cloud.fakecloud import FakeCloud
from tests.cloud.fakemetadata import FakeMetadata


@pytest.fixture
def metadata_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeMetadata]:
    """An empty fake metadata server; GCE_METADATA_HOST points at it for this test and its subprocesses."""
    server = FakeMetadata().start()
    monkeypatch.setenv("GCE_METADATA_HOST", server.host)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def metadata(metadata_server: FakeMetadata) -> MetadataClient:
    return MetadataClient(metadata_server.host, timeout_s=5.0)


@pytest.fixture
def cloud(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCloud]:
    """Fake Compute, TPU, Resource Manager and bucket APIs; FLEET_*_ENDPOINT point at them for subprocesses."""
    server = FakeCloud().start()
    monkeypatch.setenv("FLEET_COMPUTE_ENDPOINT", server.url)
    monkeypatch.setenv("FLEET_TPU_ENDPOINT", server.url)
    monkeypatch.setenv("FLEET_CRM_ENDPOINT", server.url)
    monkeypatch.setenv("FLEET_STORAGE_ENDPOINT", server.url)
    try:
        yield server
    finally:
        server.stop()
    assert not server.schema_breaks, f"the fake answered outside Google's schema: {server.schema_breaks}"


def _client_args(server: FakeCloud) -> dict:
    return {"client_options": {"api_endpoint": server.url}, "credentials": AnonymousCredentials(), "transport": "rest"}


@pytest.fixture
def compute_clients(cloud: FakeCloud) -> compute.ComputeClients:
    return compute.ComputeClients.connect(**_client_args(cloud))


@pytest.fixture
def tpu_clients(cloud: FakeCloud) -> tpu.TpuClients:
    return tpu.TpuClients.connect(**_client_args(cloud))


class StubBin:
    """A directory of stub executables that append their argv (one JSON list per line) to a log."""

    def __init__(self, root: Path):
        self.dir = root / "bin"
        self.log = root / "argv.log"
        # Absolute, so that stubs still run when a test narrows PATH to the stub directory.
        self.bash = shutil.which("bash")
        self.dir.mkdir(parents=True)
        self.log.touch()

    def add(self, name: str, body: str = "") -> Path:
        """A stub `name` that records its argv (under the name it is run as, so copies record
        their own name), then runs `body` (bash) with "$@" still set."""
        path = self.dir / name
        path.write_text(
            f"#!{self.bash}\nset -euo pipefail\n"
            f"{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"${{0##*/}}\" \"$@\" >> {self.log}\n"
            + textwrap.dedent(body)
        )
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return path

    def calls(self) -> list[list[str]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]


@pytest.fixture
def stubs(tmp_path: Path) -> StubBin:
    return StubBin(tmp_path / "stubs")


@pytest.fixture
def no_gcloud_path(tmp_path: Path) -> str:
    """A PATH without gcloud (this machine has one) but with the interpreter the tools need."""
    keep = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and not (Path(p) / "gcloud").exists()]
    return os.pathsep.join(keep)

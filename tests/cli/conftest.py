"""A world for `gcs-spawner`: a bucket on the fake GCS server (data, a code prefix), the fake Compute and TPU APIs,
a tiny local checkpoint to mirror, and run files that point at them.

The fake cloud here also counts, per resource, the creates it answered with success, so a test can say that a
resource was created once across any number of `up`s.
"""

from __future__ import annotations

import collections
import copy
import json
import pathlib
import uuid
from collections.abc import Iterator

import pytest

from tests.cloud.fakecloud import FakeCloud
from tests.cloud.fakehttp import Request, Response

REPO = pathlib.Path(__file__).resolve().parents[2]
PROJECT = "proj-run"


class CountingCloud(FakeCloud):
    """FakeCloud that counts successful creates by resource (`kind/name`)."""

    def __init__(self) -> None:
        super().__init__()
        self.created: collections.Counter[str] = collections.Counter()

    def handle(self, request: Request) -> Response:
        response = super().handle(request)
        if request.method == "POST" and response.status == 200:
            path = request.path
            if path.endswith("/queuedResources"):
                self.created[f"queued_resource/{request.query['queuedResourceId']}"] += 1
            elif path.endswith("/nodes"):
                self.created[f"tpu_node/{request.query['nodeId']}"] += 1
            elif path.endswith("/instanceTemplates"):
                self.created[f"instance_template/{request.body['name']}"] += 1
            elif path.endswith("/instanceGroupManagers"):
                self.created[f"instance_group/{request.body['name']}"] += 1
        return response

    def offer(self, project: str, zone: str, machine_types=(), tpu_types=(), gpu_types=()) -> None:
        """Zone `zone` of `project` exists and offers these types, as zones.get, machineTypes.get and
        acceleratorTypes.get (Compute) and acceleratorTypes.get (TPU) answer."""
        self.add(f"projects/{project}/zones/{zone}", {"kind": "compute#zone", "name": zone, "status": "UP",
                                                      "region": f"projects/{project}/regions/{zone[:-2]}"})
        for name in machine_types:
            self.add(f"projects/{project}/zones/{zone}/machineTypes/{name}",
                     {"kind": "compute#machineType", "name": name, "zone": zone})
        for name in gpu_types:
            self.add(f"projects/{project}/zones/{zone}/acceleratorTypes/{name}",
                     {"kind": "compute#acceleratorType", "name": name, "zone": zone})
        for name in tpu_types:
            self.add(f"projects/{project}/locations/{zone}/acceleratorTypes/{name}",
                     {"name": f"projects/{project}/locations/{zone}/acceleratorTypes/{name}", "type": name})

    def catalogue(self, path: str) -> bool:
        """Whether `path` is what a zone offers (not something a run made)."""
        return "/regions/" in path or "/machineTypes" in path or "/acceleratorTypes" in path or (
            path.count("/") == 3 and "/zones/" in path)

    def ours(self) -> list[str]:
        """The resources left in the fake (any kind, not the zones' catalogue), sorted."""
        with self.lock:
            return sorted(k for k in self.resources if not self.catalogue(k))

    def reset(self) -> None:
        with self.lock:
            for key in [k for k in self.resources if not self.catalogue(k)]:
                del self.resources[key]
            self.requests.clear()
            self.created.clear()


@pytest.fixture
def cloud(monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingCloud]:
    server = CountingCloud().start()
    for zone in ("us-west4-a", "us-east5-b", "us-central1-a"):
        server.offer(PROJECT, zone, machine_types=("g2-standard-8", "n2-standard-8", "n1-standard-8"),
                     tpu_types=("v5litepod-8", "v5litepod-16", "v6e-8"), gpu_types=("nvidia-tesla-t4",))
    for name in ("FLEET_COMPUTE_ENDPOINT", "FLEET_TPU_ENDPOINT", "FLEET_CRM_ENDPOINT", "FLEET_STORAGE_ENDPOINT"):
        monkeypatch.setenv(name, server.url)
    try:
        yield server
    finally:
        server.stop()
    assert not server.schema_breaks, f"the fake answered outside Google's schema: {server.schema_breaks}"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> pathlib.Path:
    from extract.tiny import write_tiny_qwen

    return write_tiny_qwen(tmp_path_factory.mktemp("ckpt"), "qwen2", hidden=32, layers=2, heads=4, kv_heads=2, vocab=320)


@pytest.fixture(scope="session")
def parquet_files(tmp_path_factory) -> list[pathlib.Path]:
    from extract.tiny import write_fineweb_like_parquet

    return write_fineweb_like_parquet(tmp_path_factory.mktemp("data"), 2, [30, 20], seed=1)


class World:
    """A bucket with the run's data and code, and a directory for run files (`run_file`)."""

    def __init__(self, gcs, cloud: CountingCloud, directory: pathlib.Path, checkpoint: pathlib.Path,
                 parquet: list[pathlib.Path]):
        self.gcs, self.cloud, self.dir, self.checkpoint, self.parquet = gcs, cloud, directory, checkpoint, parquet
        self.bucket = ""
        self.new_bucket()

    def new_bucket(self) -> str:
        """A fresh bucket holding the data files and a code prefix with uv/uv and every lock; run files made after
        this point at it."""
        from objectstore import open_store

        self.bucket = f"run-{uuid.uuid4().hex[:12]}"
        self.gcs.create_bucket(self.bucket)
        data = open_store(f"gs://{self.bucket}/data")
        for path in self.parquet:
            data.put_file(path.name, path)
        code = open_store(f"gs://{self.bucket}/code/r1")
        for name in ("uv/uv", "locks/cpu.txt", "locks/cuda12.txt", "locks/tpu.txt", "spawn.py"):
            code.put(name, b"x\n")
        return self.bucket

    def run(self, kind: str = "tpu", **changes) -> dict:
        b = self.bucket
        raw = {
            "name": "r1", "project": PROJECT, "queue": f"gs://{b}/jobs/r1",
            "job": {"data_files": f"gs://{b}/data/*.parquet", "model": f"gs://{b}/models/tiny", "layers": [1, -1],
                    "max_seq_len": 64, "batch_size": 4, "shard_size": 16},
            "tasks": {"rows_per_task": 10},
            "model": {"source": str(self.checkpoint)},
            "code": {"url": f"gs://{b}/code/r1", "upload": False},
            "fleet": ({"spec": str(REPO / "templates" / "tpu.yaml"), "count": 3, "zones": ["us-west4-a", "us-east5-b"]}
                      if kind == "tpu" else
                      {"spec": str(REPO / "templates" / "vm.yaml"), "count": 2, "zones": ["us-central1-a"]}),
            "plan": {"tokens_per_row": 40.0},
        }
        return merge(raw, changes)

    def run_file(self, kind: str = "tpu", name: str = "run.yaml", **changes) -> pathlib.Path:
        path = self.dir / name
        path.write_text(json.dumps(self.run(kind, **changes), indent=1))
        return path

    def store(self, prefix: str = "jobs/r1"):
        from objectstore import open_store

        return open_store(f"gs://{self.bucket}/{prefix}")

    def names(self, prefix: str = "jobs/r1", under: str = "") -> list[str]:
        return sorted(e.name for e in self.store(prefix).list(under))


def merge(base: dict, changes: dict) -> dict:
    """`base` with `changes` merged in, mappings recursively; a value of None removes the key."""
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture
def world(gcs, gcs_client, cloud, tmp_path, tiny_checkpoint, parquet_files, monkeypatch) -> World:
    monkeypatch.setenv("CLOUDSDK_CORE_PROJECT", PROJECT)
    return World(gcs, cloud, tmp_path, tiny_checkpoint, parquet_files)

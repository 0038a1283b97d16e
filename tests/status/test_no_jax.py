"""reporting/ and the queue never import JAX (reporting/__init__.py, STYLE: "the queue never imports JAX"):
every module of both, imported in a fresh interpreter, and a status snapshot of a local queue taken there, leave
JAX, Flax, torch and the cloud clients out of `sys.modules`."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.workers import REPO

HEAVY = ("jax", "jaxlib", "flax", "torch", "google.cloud.storage", "google.cloud.compute_v1", "google.cloud.tpu_v2")

PROBE = """
import importlib, json, pkgutil, sys
import reporting, taskqueue
for package in (reporting, taskqueue):
    for module in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        importlib.import_module(module.name)
from objectstore import open_store
from reporting.status import render, snapshot
from taskqueue.submit import submit
store = open_store(sys.argv[1])
submit(store, b"{}", [(t, json.dumps({"id": t}).encode()) for t in ("t1", "t2")])
view = snapshot(store)
print(json.dumps([view["total"], render(view).splitlines()[0], sorted(m for m in %r if m in sys.modules)]))
"""


def test_reporting_and_the_queue_import_no_jax_nor_cloud_client_and_status_runs_without_them(tmp_path):
    queue = tmp_path / "queue"
    queue.mkdir()
    result = subprocess.run([sys.executable, "-c", PROBE % (HEAVY,), str(queue)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    total, first_line, imported = json.loads(result.stdout.splitlines()[-1])
    assert total == 2 and first_line  # the snapshot counted the queue: the probe ran to its end
    assert imported == []

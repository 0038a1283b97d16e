"""The README's install (`pip install -e .`, no extras) gives a gcs-spawner on which every verb runs.

Each test runs the command in a fresh interpreter with the extras' modules blocked (tests/cli/base_install.py,
`BLOCKED`): an import of one raises ModuleNotFoundError, as on the base install. `.ci/run` runs the same verbs from
a venv of the base install alone.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

from tests.cli import base_install

REPO = pathlib.Path(__file__).resolve().parents[2]
#: Verbs that truly need an extra, and the module they meet first: each says which extra in one line. None since
#: `mirror` left the checkpoint's loader (extract/hub.py: JAX-free; only a Hub source needs huggingface_hub).
NEEDS_EXTRA: dict[str, str] = {}


def _verb_imports() -> dict[str, list[str]]:
    """The modules each `cmd_*` function of gcs_spawner/cli.py imports, by verb."""
    tree = ast.parse((REPO / "gcs_spawner" / "cli.py").read_text())
    verbs = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("cmd_"):
            modules = {n.module for n in ast.walk(node) if isinstance(n, ast.ImportFrom)}
            modules |= {a.name for n in ast.walk(node) if isinstance(n, ast.Import) for a in n.names}
            verbs[node.name[4:].replace("_", "-")] = sorted(modules)
    return verbs


IMPORTING = """
import importlib, importlib.abc, json, sys
BLOCKED = set(sys.argv[1].split(","))
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocked())
failed = {}
for verb, modules in json.loads(sys.argv[2]).items():
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            failed[verb] = err.name
            break
print(json.dumps(failed))
"""


def test_every_verb_imports_what_it_uses_without_the_extras():
    """What each verb imports loads without JAX, Flax, ml_dtypes, torch, transformers and the other extras' modules,
    but for the verbs of NEEDS_EXTRA, which meet exactly the module named there. (One interpreter for every verb:
    a blocked module never enters sys.modules, so no verb's imports can hide another's.)"""
    verbs = _verb_imports()
    assert {"plan", "validate", "up", "tasks", "submit", "merge", "status", "down"} <= set(verbs)
    done = subprocess.run([sys.executable, "-c", IMPORTING, ",".join(base_install.BLOCKED), json.dumps(verbs)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == NEEDS_EXTRA


def test_mirror_copies_a_local_checkpoint_without_the_extras_and_a_hub_source_names_its_extra(tmp_path):
    """`mirror` of a local checkpoint runs on the base install (exit 0, config.json in the bucket, written last);
    of a Hub id, which needs huggingface_hub, it says which extra brings it, in one line and exit 1."""
    from objectstore import open_store

    with base_install.servers() as world:
        run_file = base_install.write_world(world["gcs"], tmp_path, "vm")
        done = base_install.run_mirror(base_install.blocking_command(), run_file, world["env"])
        assert done.returncode == 0, done.stderr
        dest = json.loads(run_file.read_text())["job"]["model"].rsplit("/", 1)[0] + "/mirrored"
        assert sorted(e.name for e in open_store(dest).list("")) == ["config.json", "model.safetensors"]
        assert "mirrored 2 files to" in done.stdout and done.stdout.rstrip().endswith("model.safetensors config.json")
    hub = subprocess.run([*base_install.blocking_command(), "mirror", "Qwen/Qwen2.5-0.5B", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert hub.returncode == 1, hub.stderr
    assert hub.stderr.strip().splitlines() == [
        "gcs-spawner mirror: error: this command needs huggingface_hub, which the base install does not have: pip "
        "install 'gcs-spawner[extract]' (or, in a checkout, pip install -e '.[extract]')"
    ]


def test_plan_validate_and_up_dry_run_run_without_the_extras(tmp_path):
    """A GPU group's run on the fake GCS server and cloud (.ci/run adds a TPU run): plan, validate and up --dry-run each exit 0
    in an interpreter where JAX, Flax, ml_dtypes, torch and transformers cannot be imported. The plan still sizes
    the batch (its memory line) and prices the run."""
    with base_install.servers() as world:
        run_file = base_install.write_world(world["gcs"], tmp_path, "vm")
        results = base_install.run_verbs(base_install.blocking_command(), run_file, world["env"])
    for verb, done in results.items():
        assert done.returncode == 0, f"{verb}: {done.stderr[-2000:]}"
    plan = results["plan"].stdout
    assert "  memory      " in plan and "fits (" in plan and "total $     on-demand" in plan
    assert "valid: run 'r1'" in results["validate"].stdout
    assert "dry run: " in results["up --dry-run"].stdout and "none made" in results["up --dry-run"].stdout
    assert os.environ.get("STORAGE_EMULATOR_HOST") != world["env"]["STORAGE_EMULATOR_HOST"]  # restored

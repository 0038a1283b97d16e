"""The README's install (`pip install .`, no extras) runs `plan`, `validate`, `up --dry-run` and `mirror` against the
fakes.

A run on the fake GCS server and the fake Compute and TPU APIs (a local checkpoint's config.json, a tasks file, a
code prefix with every lock), then one `gcs-spawner` command line per verb, each of which must exit 0. What runs
the command is the caller's:

- `tests/cli/test_base_install.py`: this interpreter, with the modules the extras bring blocked (`BLOCKED`), so the
  suite sees an import of any of them that a verb makes;
- `.ci/run`: a venv of the base install alone (`python -m tests.cli.base_install --gcs-spawner VENV/bin/gcs-spawner`),
  so CI sees a dependency the base install lacks.

The servers and the world are made by this interpreter (the suite's venv); only the command runs in the other.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence

REPO = pathlib.Path(__file__).resolve().parents[2]
PROJECT = "proj-base"
#: What the extras bring and no verb of the base install may import (extract, train, status, test).
BLOCKED = ("jax", "jaxlib", "flax", "ml_dtypes", "torch", "transformers", "tokenizers", "safetensors", "datasets",
           "huggingface_hub", "pyarrow", "matplotlib")  # fmt: skip
#: `python -c` of this program runs gcs-spawner with BLOCKED unimportable: an import of one raises
#: ModuleNotFoundError naming it, as it would on the base install.
BLOCKING_MAIN = """
import importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not in the base install)", name=name)
        return None
sys.meta_path.insert(0, Blocked())
from gcs_spawner.cli import main
sys.exit(main(sys.argv[2:]))
"""
VERBS = (("plan",), ("validate",), ("up", "--dry-run"))


def blocking_command(blocked: Sequence[str] = BLOCKED) -> list[str]:
    """This interpreter running gcs-spawner with `blocked` unimportable."""
    return [sys.executable, "-c", BLOCKING_MAIN, ",".join(blocked)]


@contextlib.contextmanager
def servers() -> Iterator[dict[str, str]]:
    """The fake GCS server and the fake cloud, and the environment that points the clients at them."""
    from tests.cloud.fakecloud import FakeCloud
    from tests.fakegcs import FakeGCS

    with FakeGCS("127.0.0.1", 0) as gcs:
        cloud = FakeCloud().start()
        offer(cloud)
        env = {"STORAGE_EMULATOR_HOST": gcs.url, "CLOUDSDK_CORE_PROJECT": PROJECT}
        env.update({name: cloud.url for name in ("FLEET_COMPUTE_ENDPOINT", "FLEET_TPU_ENDPOINT",
                                                  "FLEET_CRM_ENDPOINT", "FLEET_STORAGE_ENDPOINT")})
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)  # this interpreter writes the world through the same clients
        try:
            yield {"gcs": gcs, "cloud": cloud, "env": env}
        finally:
            cloud.stop()
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def offer(cloud) -> None:
    """The zones the two runs name exist and offer their types, as zones.get, machineTypes.get and
    acceleratorTypes.get (Compute) and acceleratorTypes.get (TPU) answer: `up` and `validate` check that first."""
    for zone in ("us-central1-a", "us-west4-a"):
        cloud.add(f"projects/{PROJECT}/zones/{zone}", {"kind": "compute#zone", "name": zone, "status": "UP",
                                                     "region": f"projects/{PROJECT}/regions/{zone[:-2]}"})
    cloud.add(f"projects/{PROJECT}/zones/us-central1-a/machineTypes/g2-standard-8",
              {"kind": "compute#machineType", "name": "g2-standard-8", "zone": "us-central1-a"})
    cloud.add(f"projects/{PROJECT}/zones/us-central1-a/acceleratorTypes/nvidia-l4",
              {"kind": "compute#acceleratorType", "name": "nvidia-l4", "zone": "us-central1-a"})
    cloud.add(f"projects/{PROJECT}/locations/us-west4-a/acceleratorTypes/v5litepod-8",
              {"name": f"projects/{PROJECT}/locations/us-west4-a/acceleratorTypes/v5litepod-8", "type": "v5litepod-8"})


def write_world(gcs, directory: pathlib.Path, kind: str = "vm") -> pathlib.Path:
    """A bucket with a data file and a code prefix, a local checkpoint (config.json only: nothing reads its
    weights before the mirror), a tasks file, and a run file of `kind` (vm: a GPU group; tpu) pointing at them."""
    from objectstore import open_store

    bucket = f"base-{uuid.uuid4().hex[:12]}"
    gcs.create_bucket(bucket)
    open_store(f"gs://{bucket}/data").put("a.parquet", b"PAR1 not read before the machines run")
    code = open_store(f"gs://{bucket}/code/r1")
    for name in ("uv/uv", "locks/cpu.txt", "locks/cuda12.txt", "locks/tpu.txt", "spawn.py"):
        code.put(name, b"x\n")
    checkpoint = directory / "ckpt"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"{}")  # what the mirror copies; nothing reads its tensors here
    (checkpoint / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
    }))  # fmt: skip
    tasks = directory / "tasks.jsonl"
    tasks.write_text("".join(
        json.dumps({"id": f"t{i}", "files": [{"path": f"gs://{bucket}/data/a.parquet", "start": 10 * i,
                                              "end": 10 * i + 10}]}) + "\n"
        for i in range(3)
    ))  # fmt: skip
    fleet = ({"spec": str(REPO / "templates" / "tpu.yaml"), "count": 2, "zones": ["us-west4-a"]} if kind == "tpu"
             else {"spec": str(REPO / "templates" / "vm.yaml"), "count": 2, "zones": ["us-central1-a"]})
    run = {
        "name": "r1", "project": PROJECT, "queue": f"gs://{bucket}/jobs/r1",
        "job": {"data_files": f"gs://{bucket}/data/*.parquet", "model": f"gs://{bucket}/models/tiny",
                "layers": [1, -1], "max_seq_len": 64, "batch_size": 4, "shard_size": 16},
        "tasks": {"file": str(tasks)},
        "model": {"source": str(checkpoint)},
        "code": {"url": f"gs://{bucket}/code/r1", "upload": False},
        "fleet": fleet,
        "plan": {"tokens_per_row": 40.0},
    }  # fmt: skip
    run_file = directory / f"run-{kind}.yaml"
    run_file.write_text(json.dumps(run, indent=1))
    return run_file


def run_verbs(command: Sequence[str], run_file: pathlib.Path, env: dict[str, str],
              checkout: bool = True) -> dict[str, subprocess.CompletedProcess]:  # fmt: skip
    """Each verb of VERBS on `run_file` through `command` (a gcs-spawner command line), in a fresh process in the
    run file's directory; `checkout`: with this checkout on the path (an installed command runs its own copy)."""
    full_env = {**os.environ, **env}
    full_env.pop("PYTHONPATH", None)
    if checkout:
        full_env["PYTHONPATH"] = str(REPO)
    return {
        " ".join(verb): subprocess.run([*command, *verb, str(run_file)], cwd=run_file.parent, env=full_env,
                                       capture_output=True, text=True, timeout=300)
        for verb in VERBS
    }  # fmt: skip


def run_mirror(command: Sequence[str], run_file: pathlib.Path, env: dict[str, str],
               checkout: bool = True) -> subprocess.CompletedProcess:  # fmt: skip
    """`mirror` of the run's local checkpoint into its bucket (models/mirrored), as `run_verbs` runs a verb."""
    run = json.loads(run_file.read_text())
    dest = run["job"]["model"].rsplit("/", 1)[0] + "/mirrored"
    full_env = {**os.environ, **env}
    full_env.pop("PYTHONPATH", None)
    if checkout:
        full_env["PYTHONPATH"] = str(REPO)
    return subprocess.run([*command, "mirror", run["model"]["source"], dest], cwd=run_file.parent, env=full_env,
                          capture_output=True, text=True, timeout=300)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cli.base_install", description=__doc__.splitlines()[0])
    parser.add_argument("--gcs-spawner", required=True, help="the base install's gcs-spawner command")
    args = parser.parse_args(argv)
    failed = 0
    with servers() as world, tempfile.TemporaryDirectory(prefix="base-install-") as directory:
        for kind in ("vm", "tpu"):
            run_file = write_world(world["gcs"], pathlib.Path(directory) / kind, kind)
            results = run_verbs([args.gcs_spawner], run_file, world["env"], checkout=False)
            results["mirror"] = run_mirror([args.gcs_spawner], run_file, world["env"], checkout=False)
            for verb, done in results.items():
                print(f"base install: gcs-spawner {verb} ({kind} run): exit {done.returncode}", flush=True)
                if done.returncode != 0:
                    failed += 1
                    print(done.stdout, done.stderr, sep="\n", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

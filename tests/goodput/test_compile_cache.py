"""The compilation cache (extract/compilecache.py): a second consume.py of a task compiles almost nothing; an entry
is used only by the program, mesh and JAX build that wrote it, on this machine or, through the bucket, another;
a damaged or unsealed entry is removed, never read."""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import subprocess
import sys

import pytest

from extract import compilecache
from extract.phases import ATTEMPTS, PHASES, counter_name
from extract.tiny import generate_text, write_tiny_qwen

REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def clean_env(**extra: str) -> dict[str, str]:
    """The default settings: no cache variable of ours or JAX's; `extra` on top."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPAWN_", "EXTRACT_", "JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}  # fmt: skip
    return {**env, "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false", **extra}


def varied_parquet(path: pathlib.Path, rows: int, seed: int) -> pathlib.Path:
    """Documents of every length from a few words to past max_seq_len, so that a task meets every bucket."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    texts = [generate_text(rng, rng.choice((4, 12, 25, 45, 70, 200))) for _ in range(rows)]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path)
    return path


def consume(work: pathlib.Path, job: dict, task: dict, env: dict) -> dict[str, int]:
    """Run consume.py to completion; the task's summed progress counters (what its done marker would carry)."""
    work.mkdir(parents=True)
    (work / "job.json").write_text(json.dumps(job))
    (work / "task.json").write_text(json.dumps(task))
    proc = subprocess.run([sys.executable, "consume.py", "--job-file", str(work / "job.json"), "--task-file",
                           str(work / "task.json"), "--output", str(work / "out"), "--progress-file",
                           str(work / "progress.jsonl")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    totals: dict[str, int] = {}
    for line in (work / "progress.jsonl").read_text().splitlines():
        for name, value in json.loads(line).get("counters", {}).items():
            totals[name] = totals.get(name, 0) + value
    return totals


def test_a_second_consume_of_the_task_spends_under_30pc_of_the_first_compile_and_less_wall(tmp_path):
    """Default settings, a fresh cache directory for each pair: the second run's programs come from the cache.

    The compile bound must hold in every pair. Wall time on a shared 2-core machine moves by seconds that
    have nothing to do with the cache (in one CI run the second process's imports took 4.4 s against the
    first's 1.4 s, its tokenizer and first batch 7.2 s against 3 s), so a pair whose second run is not
    faster is measured again with a fresh cache, up to PAIRS times: a cache that never saves wall time
    still fails."""
    model = write_tiny_qwen(tmp_path / "model", layers=6, seed=3)
    data = varied_parquet(tmp_path / "data" / "part.parquet", 48, seed=5)
    job = {"data_files": [str(data)], "model": str(model), "layers": [6], "max_seq_len": 128, "batch_size": 4,
           "shard_size": 48, "buckets": [16, 32, 64, 128]}  # fmt: skip
    task = {"id": "t0", "files": [{"path": str(data), "base": 0, "start": 0, "end": 48}]}
    walls = []
    for pair in range(PAIRS):
        root = tmp_path / f"pair{pair}"
        env = clean_env(XDG_CACHE_HOME=str(root / "cache"))
        first, second = (consume(root / name, job, task, env) for name in ("first", "second"))

        for run in (first, second):  # every phase reported, once per attempt, and the programs counted apart
            assert run[ATTEMPTS] == 1 and all(run.get(counter_name(p), 0) > 0 for p in ("imports", "compile", "steady"))
        wall = {name: sum(run.get(counter_name(p), 0) for p in PHASES) for name, run in (("first", first), ("second", second))}
        compile_ms = first[counter_name("compile")], second[counter_name("compile")]
        assert compile_ms[1] <= 0.3 * compile_ms[0], (compile_ms, first, second)
        entries = list((root / "cache" / "gcs-spawner" / "jax").glob(f"*/*{compilecache.ENTRY_SUFFIX}"))
        assert len(entries) >= 4  # one per bucket at least, each sealed
        assert all(pathlib.Path(f"{e}{compilecache.SEAL_SUFFIX}").is_file() for e in entries)
        walls.append(wall)
        if wall["second"] < wall["first"]:
            break
    assert walls[-1]["second"] < walls[-1]["first"], walls


#: How many pairs the wall-time check may take (see the test's docstring).
PAIRS = 3


def compile_in_process(root: pathlib.Path, *specs: dict, shared: str | None = None) -> dict:
    """tests/goodput/compile_driver.py in a fresh process on 2 CPU devices: the cache's answer per program."""
    env = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=2",
                    **({compilecache.SHARED_ENV: shared} if shared else {}))  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "tests.goodput.compile_driver", str(root), *map(json.dumps, specs)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def program(**changes) -> dict:
    return {"hidden": 32, "layers": 1, "seq_len": 16, "mesh": "data=1,model=1", **changes}


def test_an_entry_serves_its_own_program_mesh_and_jax_build_only_on_any_machine_and_a_damaged_one_is_rebuilt(
    tmp_path, gcs_client, gcs_bucket
):
    base, other_model, other_shape, other_mesh = program(), program(hidden=64), program(seq_len=32), program(mesh="data=2,model=1")
    shared = f"gs://{gcs_bucket}/jax-cache"
    first = compile_in_process(tmp_path, base, shared=shared)
    assert first["answers"] == ["miss"]
    # Another machine (its own cache directory) finds the program in the bucket: its first compile is a hit.
    assert compile_in_process(tmp_path / "machine-2", base, shared=shared)["answers"] == ["hit"]
    namespace = pathlib.Path(first["dir"])
    assert namespace == tmp_path / compilecache.current_namespace()  # this JAX build's directory, under the root

    # The same program is served from the cache; another model, batch shape or mesh is compiled and cached apart.
    second = compile_in_process(tmp_path, base, other_model, other_shape, other_mesh)
    assert second["answers"] == ["hit", "miss", "miss", "miss"]
    forwards = sorted(namespace.glob(f"jit_forward-*{compilecache.ENTRY_SUFFIX}"), key=lambda p: p.stat().st_mtime)
    assert len(forwards) == 4

    # Damage the base program's entry (bytes changed in place), leave an unsealed one as a killed writer would, and
    # move the other model's entry to the namespace another JAX build would use.
    base_entry, model_entry = forwards[0], forwards[1]
    raw = bytearray(base_entry.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    base_entry.write_bytes(bytes(raw))
    (namespace / f"jit_forward-{'0' * 64}{compilecache.ENTRY_SUFFIX}").write_bytes(b"half an entry")
    elsewhere = tmp_path / compilecache.namespace("0.0.1", "0.0.1", "cpu", "", "cpu")
    elsewhere.mkdir()
    for path in (model_entry, pathlib.Path(f"{model_entry}{compilecache.SEAL_SUFFIX}")):
        shutil.move(path, elsewhere / path.name)

    third = compile_in_process(tmp_path, base, other_model)
    assert third["checked"]["removed"] == 2  # the damaged and the unsealed entry, before JAX could read them
    assert third["answers"] == ["miss", "miss"]  # rebuilt, and the other build's entry never looked up
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted([model_entry.name, f"{model_entry.name}{compilecache.SEAL_SUFFIX}"])
    rebuilt = compilecache.Seal.of(base_entry.read_bytes())
    assert rebuilt == compilecache.CompileCache(namespace)._read_seal(base_entry) and base_entry.read_bytes() != bytes(raw)

"""consume.py as a resident consumer (extract/resident.py, docs/PROTOCOL.md "Resident consumers"): one real process,
driven over its standard input and output as `spawn.py --resident` drives it, serving several tasks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from extract.phases import counter_name
from tests.extract_pipeline.conftest import CONSUME, REPO, base_job, write_json


def request(workdir, task_id: str, task: dict, job_file, waited_s: float = 0.0) -> bytes:
    task_file = write_json(workdir / task_id / "task.json", {"id": task_id, **task})
    env = {"SPAWN_TASK_FILE": str(task_file), "SPAWN_JOB_FILE": str(job_file), "SPAWN_TASK_ID": task_id,
           "SPAWN_ATTEMPT": "1", "SPAWN_OUTPUT": str(workdir / task_id / "out"),
           "SPAWN_PROGRESS_FILE": str(workdir / task_id / "progress.jsonl")}  # fmt: skip
    return (json.dumps({"task": task_id, "env": env, "waited_s": waited_s}) + "\n").encode()


def counters(workdir, task_id: str) -> dict[str, int]:
    total: dict[str, int] = {}
    for line in (workdir / task_id / "progress.jsonl").read_text().splitlines():
        for name, value in json.loads(line).get("counters", {}).items():
            total[name] = total.get(name, 0) + value
    return total


def shard_tensors(workdir, task_id: str) -> list[bytes]:
    """Each shard's tensor bytes (after its safetensors header, whose metadata names the task)."""
    tensors = []
    for path in sorted((workdir / task_id / "out").rglob("*.safetensors")):
        raw = path.read_bytes()
        tensors.append(raw[8 + int.from_bytes(raw[:8], "little") :])
    return tensors


def test_one_process_serves_tasks_keeping_its_engine_and_survives_a_bad_input_task(tmp_path, tiny_models, corpus,
                                                                                    consume_env):  # fmt: skip
    job_file = write_json(tmp_path / "job.json", base_job(tiny_models["qwen2"], corpus))
    first = {"files": corpus.slice_files([(0, 0, 24)])}
    stderr = open(tmp_path / "stderr.log", "w")
    proc = subprocess.Popen([sys.executable, str(CONSUME)], cwd=REPO, env={**consume_env(), "SPAWN_RESIDENT": "1"},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)  # fmt: skip
    stderr.close()
    try:

        def serve(line: bytes) -> dict:
            proc.stdin.write(line)
            proc.stdin.flush()
            reply = proc.stdout.readline()
            assert reply, f"no reply; exit {proc.wait()}:\n{(tmp_path / 'stderr.log').read_text()[-3000:]}"
            return json.loads(reply)

        assert serve(request(tmp_path, "a", first, job_file)) == {"task": "a", "exit_code": 0, "stays": True}
        # A task asking for rows its file lacks: bad input (65), and the loaded engine stays.
        bad = {"files": corpus.slice_files([(0, 80, 95)])}
        assert serve(request(tmp_path, "bad", bad, job_file)) == {"task": "bad", "exit_code": 65, "stays": True}
        # The first task's slice again, claimed 2 s before its request: the same activations, from the same engine.
        assert serve(request(tmp_path, "again", first, job_file, waited_s=2.0)) == {
            "task": "again", "exit_code": 0, "stays": True}  # fmt: skip
        proc.stdin.close()  # end of input: the worker is leaving
        started = time.monotonic()
        assert proc.wait(timeout=30) == 0
        left_s = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (tmp_path / "stderr.log").read_text()
    assert log.count("event=engine_ready") == 1, "the weights are loaded once"
    assert log.count("event=compile_cache state=") == 1, "the runtime and its cache are set up once"
    cold, warm = counters(tmp_path, "a"), counters(tmp_path, "again")
    for phase in ("imports", "devices", "weights", "trace", "compile", "first_step"):
        assert cold.get(counter_name(phase), 0) > 0 and counter_name(phase) not in warm, phase
    # Its ledger starts at its claim: the 2 s before the request count, to `prepare`.
    assert warm[counter_name("prepare")] >= 2000
    assert shard_tensors(tmp_path, "again") == shard_tensors(tmp_path, "a") != []
    assert left_s < 10, f"leaving took {left_s:.1f} s: the exit skips the interpreter's teardown"
    assert not os.path.exists(tmp_path / "bad" / "out") or not shard_tensors(tmp_path, "bad")

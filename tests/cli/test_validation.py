"""Nothing reaches a machine unvalidated: each mistake is refused by name (exit 65) before anything is created.

The tools' cases run the old command lines (tools/status.py, merge.py, submit.py) in a subprocess, as a user would,
and each failed on the code before gcs-spawner: the typo'd address made a directory and exited 0, merge wrote an
empty index, submit stored the misspelt job, a missing credential printed a traceback (a TPU type the planner does
not know, once taken by tools/create_tpus.py, is `gcs-spawner add`'s refusal now: tests/cli/test_add.py).
The run's cases drive `gcs-spawner up` against the fake GCS and cloud APIs and check that it made nothing:
no request that changes the cloud, no object in the queue.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from objectstore.local import LocalStore

from gcs_spawner.cli import main
from tests.cli.conftest import PROJECT, REPO

JOB = {"data_files": ["/data/x.parquet"], "model": "/models/m", "layers": [1], "max_seq_len": 64, "batch_size": 8,
       "shard_size": 16}
TASK = {"id": "t000000", "files": [{"path": "/data/x.parquet", "base": 0, "start": 0, "end": 10}]}


def tool(*argv: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, str(REPO / "tools" / argv[0]), *argv[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


# -- addresses --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("address, says", [
    ("mybucket/jobs/J", "write 'gs://mybucket/jobs/J'"),
    ("gs:/b1b/q", "write 'gs://b1b/q'"),
    ("gs//b1b/q", "write 'gs://b1b/q'"),
    ("s3://b1b/q", "only gs://bucket/prefix"),
])
def test_status_refuses_an_address_that_is_neither_a_bucket_url_nor_a_directory_and_makes_nothing(
        tmp_path: Path, address: str, says: str):
    result = tool("status.py", address, cwd=tmp_path)
    assert result.returncode == 65, result.stderr
    assert says in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # before: ./mybucket/jobs/J (or ./gs:) was created, 0 tasks, exit 0


def test_merge_of_a_path_that_is_no_queue_writes_no_index(tmp_path: Path, gcs_bucket: str, gcs_client):
    missing = tool("merge.py", str(tmp_path / "no" / "queue"), cwd=tmp_path)
    assert missing.returncode == 65 and "neither a gs:// URL nor an existing directory" in missing.stderr
    assert list(tmp_path.iterdir()) == []  # before: an empty index.json under a new directory
    empty = tool("merge.py", f"gs://{gcs_bucket}/jobs/typo", cwd=tmp_path, env={"STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"]})
    assert empty.returncode == 65 and "neither job.json nor done markers" in empty.stderr
    assert list(gcs_client.list_blobs(gcs_bucket)) == []


# -- the job and the tasks, by consume.py's models ---------------------------------------------------------------------


def test_submit_refuses_a_misspelt_job_field_and_writes_nothing(tmp_path: Path):
    queue = tmp_path / "queue"
    queue.mkdir()
    job = tmp_path / "job.json"
    job.write_text(json.dumps({**{k: v for k, v in JOB.items() if k != "batch_size"}, "batch_sise": 8}))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASK) + "\n")
    result = tool("submit.py", str(queue), "--job", str(job), "--tasks", str(tasks), cwd=tmp_path)
    assert result.returncode == 65, result.stderr
    assert "batch_sise: unknown field" in result.stderr
    assert list(queue.iterdir()) == []  # before: job.json with "batch_sise" stored, exit 0


def test_submit_without_a_job_to_a_queue_without_one_is_refused_and_writes_nothing(tmp_path: Path):
    """Workers claim nothing at a prefix without job.json (docs/PROTOCOL.md, "A queue is where its job
    is"): tasks submitted there would wait forever. With the job stored, the same tasks go in."""
    queue = tmp_path / "queue"
    queue.mkdir()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASK) + "\n")
    result = tool("submit.py", str(queue), "--tasks", str(tasks), cwd=tmp_path)
    assert result.returncode == 65, result.stderr
    assert f"no job.json at {queue}" in result.stderr and "--job" in result.stderr and "Traceback" not in result.stderr
    assert list(LocalStore(queue).list("")) == []  # no task, no batch marker
    job = tmp_path / "job.json"
    job.write_text(json.dumps(JOB))
    assert tool("submit.py", str(queue), "--job", str(job), "--tasks", str(tasks), cwd=tmp_path).returncode == 0
    extra = tmp_path / "extra.jsonl"
    extra.write_text(json.dumps({**TASK, "id": "extra"}) + "\n")
    later = tool("submit.py", str(queue), "--tasks", str(extra), cwd=tmp_path)
    assert later.returncode == 0, later.stderr
    assert (queue / "tasks" / "extra.json").exists()


def test_submit_refuses_a_task_consume_would_refuse_and_writes_nothing(tmp_path: Path):
    queue = tmp_path / "queue"
    queue.mkdir()
    job = tmp_path / "job.json"
    job.write_text(json.dumps(JOB))
    tasks = tmp_path / "tasks.jsonl"
    bad = {**TASK, "id": "t000001", "files": [{"path": "/data/x.parquet", "base": 0, "start": 9, "end": 3}]}
    tasks.write_text(json.dumps(TASK) + "\n" + json.dumps(bad) + "\n")
    result = tool("submit.py", str(queue), "--job", str(job), "--tasks", str(tasks), cwd=tmp_path)
    assert result.returncode == 65, result.stderr
    assert "task 't000001'" in result.stderr and "files[0].end" in result.stderr
    assert list(queue.iterdir()) == []


# -- the accelerator, the credentials --------------------------------------------------------------------------------


def _no_credentials(tmp_path: Path) -> dict:
    """An environment in which Application Default Credentials find nothing: no key file, no gcloud login, and a
    metadata server that does not answer (google.auth's search order)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "CLOUDSDK_CONFIG")
           and not k.startswith("FLEET_")}
    home = tmp_path / "home"
    home.mkdir()
    return {**env, "HOME": str(home), "CLOUDSDK_CONFIG": str(home / "gcloud"), "GCE_METADATA_HOST": "127.0.0.1:9",
            "GCE_METADATA_IP": "127.0.0.1:9", "CLOUDSDK_CORE_PROJECT": PROJECT}


def test_missing_credentials_are_one_line_saying_how_to_log_in(tmp_path: Path):
    result = subprocess.run([sys.executable, "-m", "gcs_spawner", "status", "gs://bkt/jobs/j"], cwd=tmp_path,
                            env={**_no_credentials(tmp_path), "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr  # before: a traceback of DefaultCredentialsError
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert "no usable Google Cloud credentials" in line and "gcloud auth application-default login" in line


# -- the run file -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, says", [
    ({"job": {"batch_size": None, "batch_sise": 8}}, "batch_sise: unknown field"),
    ({"queue": "gs:/bkt/jobs/r1"}, "queue: 'gs:/bkt/jobs/r1' is not a gs:// URL"),
    ({"queue": "bkt/jobs/r1"}, "queue: 'bkt/jobs/r1' is not a gs://bucket/prefix URL"),
    ({"fleet": {"count": 0}}, "fleet.count: must be a positive integer, got 0"),
    ({"job": {"data_files": "/local/x.parquet"}}, "data_files '/local/x.parquet' is a local path"),
    ({"job": {"model": "Qwen/Qwen2.5-0.5B"}}, "is not in a bucket"),
    ({"fleet": {"zones": ["us-west4"]}}, "fleet.zones[0]: must be a zone"),
    ({"tasks": {"file": "t.jsonl"}}, "give exactly one of 'file'"),
    ({"fleet": {"spec": {"kind": "tpu", "name": "x"}}}, "also wrong: accelerator_type, runtime_version"),
    ({"max_dollars": -1}, "max_dollars: must be a positive number of dollars"),
])
def test_run_file_mistakes_are_refused_naming_the_field_before_anything_is_made(world, capsys, changes, says):
    assert main(["up", str(world.run_file("tpu", **changes)), "--yes"]) == 65
    assert says in capsys.readouterr().err
    assert world.cloud.mutations() == [] and world.names() == []


def test_a_vm_fleet_is_one_group_in_one_zone(world, capsys):
    assert main(["up", str(world.run_file("vm", fleet={"zones": ["us-central1-a", "us-central1-b"]})), "--yes"]) == 65
    assert "fleet.zones: a VM fleet is one managed instance group" in capsys.readouterr().err


# -- what up checks against the bucket and the APIs -------------------------------------------------------------------


def _refused(world, capsys, run_file) -> str:
    assert main(["up", str(run_file), "--yes"]) == 65
    err = capsys.readouterr().err
    assert world.cloud.mutations() == [], world.cloud.mutations()
    assert world.names() == [] and world.names("models/tiny") == []
    return err


def test_up_refuses_a_queue_whose_bucket_does_not_exist(world, capsys):
    err = _refused(world, capsys, world.run_file("tpu", queue="gs://no-such-bucket-r1/jobs/r1"))
    assert "bucket no-such-bucket-r1 does not exist" in err and "gcloud storage buckets create" in err


def test_up_refuses_a_code_prefix_without_the_fleets_lock(world, capsys):
    world.store("code/r1").delete("locks/tpu.txt")
    err = _refused(world, capsys, world.run_file("tpu"))
    assert "code.url" in err and "lacks locks/tpu.txt" in err


def test_up_refuses_a_model_family_the_extraction_does_not_support(world, capsys, tmp_path):
    checkpoint = tmp_path / "bert"
    shutil.copytree(world.checkpoint, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    err = _refused(world, capsys, world.run_file("tpu", model={"source": str(checkpoint)}))
    assert "model_type='bert' is not supported" in err


def test_up_refuses_an_accelerator_the_planner_does_not_know(world, capsys):
    spec = (REPO / "templates" / "tpu.yaml").read_text().replace("v5litepod-8", "v6f-8")
    (world.dir / "tpu.yaml").write_text(spec)
    err = _refused(world, capsys, world.run_file("tpu", fleet={"spec": "tpu.yaml"}))
    assert "fleet.spec.accelerator_type" in err and "'v6f-8' is not in the price table" in err


def test_up_refuses_a_fleet_the_regions_quota_cannot_hold(world, capsys):
    world.cloud.set_region(PROJECT, "us-central1", {"CPUS": (8, 0), "IN_USE_ADDRESSES": (100, 0)})
    world.cloud.resources[f"projects/{PROJECT}/regions/us-central1"]["zones"] = [f"projects/{PROJECT}/zones/us-central1-a"]
    world.cloud.add(f"projects/{PROJECT}/zones/us-central1-a/machineTypes/g2-standard-8",
                    {"name": "g2-standard-8", "guestCpus": 8, "accelerators": []})
    err = _refused(world, capsys, world.run_file("vm"))
    assert "quota:CPUS: need 16, only 8 free in us-central1" in err and "fleet.force" in err


def test_up_refuses_a_plan_above_the_spending_limit(world, capsys):
    err = _refused(world, capsys, world.run_file("tpu", max_dollars=0.0001))  # the plan: about 0.0002 $
    assert "max_dollars: the plan's spot estimate" in err


def test_up_refuses_a_queue_that_holds_another_job(world, capsys):
    world.store().put("job.json", json.dumps({**world.run("tpu")["job"], "batch_size": 2}).encode())
    assert main(["up", str(world.run_file("tpu")), "--yes"]) == 65
    assert "already holds another job" in capsys.readouterr().err
    assert world.cloud.mutations() == [] and world.names() == ["job.json"]


def test_up_refuses_a_template_name_another_run_holds(world, capsys):
    world.cloud.add(f"projects/{PROJECT}/global/instanceTemplates/r1", {"name": "r1"})
    err = _refused(world, capsys, world.run_file("vm"))
    assert "instance_template r1 (global) exists" in err and "was not made by run 'r1'" in err

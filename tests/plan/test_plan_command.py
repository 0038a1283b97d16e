"""One plan command: `gcs-spawner plan RUN`, or `gcs-spawner plan JOB --accelerator TYPE` for a job alone, and
tools/plan.py is that command under its old name, with the command's exit codes (0, 1, 2, 65; never 75)."""

from __future__ import annotations

import json

from gcs_spawner.cli import main
from tests.plan.test_plan import QWEN25_7B_JOB, run_tool

FLAGS = ("--accelerator", "v6e-8", "--rows", "1000", "--tokens-per-row", "1040", "--json")


def test_tools_plan_is_the_plan_verb_with_its_exit_codes(tmp_path, capsys):
    job = tmp_path / "job.json"
    job.write_text(json.dumps(QWEN25_7B_JOB))
    tool = run_tool("tools/plan.py", str(job), *FLAGS)
    assert tool.returncode == 0, tool.stderr
    assert main(["plan", str(job), *FLAGS]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(tool.stdout)

    bad = run_tool("tools/plan.py", str(job), "--accelerator", "v6f-8", "--rows", "1000", "--tokens-per-row", "1")
    assert bad.returncode == 65 and "'v6f-8' is not in the price table" in bad.stderr, bad.stderr
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert run_tool("tools/plan.py", str(broken), *FLAGS).returncode == 65


def test_a_job_flag_beside_a_run_file_is_a_usage_error(tmp_path, capsys):
    run_file = tmp_path / "run.yaml"
    run_file.write_text("name: r1\n")
    assert main(["plan", str(run_file), "--rows", "5"]) == 2
    assert "--rows: a flag of a job planned alone" in capsys.readouterr().err

"""Issue 47's smaller defects, each as a new user meets it: a misspelt run file is named as one (not a queue
directory to create), YAML errors name the file, the credentials line is cut at a word, `tools/local_run.py --help`
starts nothing."""

from __future__ import annotations

import os
import subprocess
import sys

from gcs_spawner.cli import main
from tests.cli.conftest import REPO


def test_a_misspelt_run_file_is_named_as_one_with_the_nearest_run_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "run.yaml").write_text("name: r1\n")
    monkeypatch.chdir(tmp_path)
    assert main(["status", "runn.yaml"]) == 65
    err = capsys.readouterr().err
    assert "runn.yaml: no such run file; did you mean run.yaml?" in err
    assert "mkdir" not in err


def test_a_yaml_error_names_the_run_file_not_a_unicode_string(tmp_path, capsys):
    run_file = tmp_path / "run.yaml"
    run_file.write_text("name: r1\nqueue: [gs://b/q\n")
    assert main(["validate", str(run_file)]) == 65
    err = capsys.readouterr().err
    assert f'in "{run_file}", line' in err and "<unicode string>" not in err


def test_the_credentials_line_is_cut_at_a_word():
    from fleet.gapi import _first_sentence

    long = "Your default credentials were not found " + "because nothing was configured on this machine " * 5
    cut = _first_sentence(long)
    assert cut.endswith(" ...") and len(cut) <= 165
    assert long.startswith(cut[:-4]) and long[len(cut) - 4] == " "  # the cut falls between two words
    assert _first_sentence("File x was not found. To set up ADC, see https://x.") == "File x was not found"


def test_local_runs_help_prints_its_help_and_starts_nothing(tmp_path):
    work = tmp_path / "local-run"
    result = subprocess.run([sys.executable, "tools/local_run.py", "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "LOCAL_RUN_DIR": str(work)})
    assert result.returncode == 0 and "usage: tools/local_run.py" in result.stdout
    assert not work.exists()


def test_a_missing_local_checkpoint_is_named_as_a_path_not_a_bad_hub_id(world, capsys):
    run_file = world.run_file("tpu", model={"source": "./checkpoints/qwen-tiny"})
    assert main(["validate", str(run_file), "--no-preflight"]) == 65
    err = capsys.readouterr().err
    assert f"model.source: {run_file.parent / 'checkpoints' / 'qwen-tiny'} is not a checkpoint directory (it does not " \
           "exist)" in err
    assert "Hub" not in err.split("model.source:", 1)[1].split(";")[0]


def test_a_run_file_copied_without_its_spec_names_templates_spec(tmp_path, capsys):
    run_file = tmp_path / "run.yaml"
    run_file.write_text((REPO / "templates" / "run.yaml").read_text())
    assert main(["validate", str(run_file)]) == 65
    err = capsys.readouterr().err
    assert f"fleet.spec: {tmp_path / 'tpu.yaml'} does not exist; the machine specs ship in templates/ " \
           "(templates/tpu.yaml)" in err

"""The command itself: help that imports nothing heavy, the entry point, one exit code per outcome, the plan's
considered resources, `logs`, `status RUN`, the run file's schema for editors, and progress on a terminal and in
a log."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from importlib import metadata

import pytest
import yaml

from gcs_spawner.cli import main
from progress import Progress
from tests.cli.conftest import REPO

HEAVY = ("jax", "google.cloud.compute_v1", "google.cloud.tpu_v2", "google.cloud.storage", "transformers", "torch")


@pytest.mark.parametrize("argv", [["--help"], ["up", "--help"], ["down", "--help"], ["plan", "--help"]])
def test_help_imports_neither_jax_nor_the_cloud_clients(argv):
    probe = ("import json, sys\nfrom gcs_spawner.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    code = e.code\nprint(json.dumps([code, [m for m in %r if m in sys.modules]]))" % (HEAVY,))
    result = subprocess.run([sys.executable, "-c", probe, *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
    code, imported = json.loads(result.stdout.splitlines()[-1])
    assert (code, imported) == (0, [])
    assert "usage: gcs-spawner" in result.stdout


def test_the_console_command_is_declared():
    [script] = [e for e in metadata.entry_points(group="console_scripts") if e.name == "gcs-spawner"]
    assert script.value == "gcs_spawner.cli:main"
    assert "gcs-spawner = gcs_spawner.cli:main" in (REPO / "setup.cfg").read_text()


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["up"])
    assert caught.value.code == 2
    assert main(["status", "--queue", "x", "y"]) == 2
    assert "give the run file or the queue once" in capsys.readouterr().err


def test_plan_marks_the_cheapest_of_the_accelerators_the_run_allows(world, capsys):
    """The rows are priced from the same FLOPs: machine-hours scale as 1/peak and dollars as (hours + the tasks'
    fixed hours) x price, the fixed hours the same on every TPU (one platform's figures), so the cheapest is the
    lowest (hours + fixed) x price (reporting/prices.json, read here independently), and the run's row costs what
    the plan's total says."""
    from reporting.pricing import load_prices

    names = ["v5litepod-8", "v6e-8", "v5p-8", "v4-8"]
    run_file = world.run_file("tpu", fleet={"alternatives": names[1:]})
    assert main(["plan", str(run_file), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    rows = {row["accelerator"]: row for row in plan["considered"]}
    assert list(rows) == names
    prices = load_prices()
    fixed = plan["storage"]["dollars"] + plan["operations"]["dollars"]
    fixed_hours = plan["tasks"]["fixed"]["machine_hours"]
    assert fixed_hours > 0
    for name in names:
        machine = prices.accelerator(name)
        hours = plan["compute"]["flops"] / (machine.peak_flops * 0.35) / 3600
        assert math.isclose(rows[name]["machine_hours"], hours, rel_tol=1e-9)
        assert math.isclose(rows[name]["spot_dollars"], (hours + fixed_hours) * machine.spot_per_hour + fixed,
                            rel_tol=1e-9)
    assert rows["v5litepod-8"]["spot_dollars"] == pytest.approx(plan["total_dollars"]["spot"], rel=1e-9)
    assert rows["v5litepod-8"]["on_demand_dollars"] == pytest.approx(plan["total_dollars"]["on_demand"], rel=1e-9)
    assert len({round(row["spot_dollars"], 9) for row in rows.values()}) == len(names)  # no two rows tie
    cheapest = min(names, key=lambda n: (plan["compute"]["flops"] / (prices.accelerator(n).peak_flops * 0.35) / 3600
                                         + fixed_hours) * prices.accelerator(n).spot_per_hour)
    assert [n for n in names if rows[n]["cheapest"]] == [cheapest]
    assert [n for n in names if rows[n]["chosen"]] == ["v5litepod-8"]
    assert rows["v5litepod-8"]["machine_hours"] == pytest.approx(plan["time"]["machine_hours"], rel=1e-9)

    assert main(["plan", str(run_file)]) == 0
    table = capsys.readouterr().out.split("considered resources")[1].splitlines()
    assert table[1].split()[:3] == ["ACCELERATOR", "CHIPS", "MACHINE-HOURS"]
    [marked] = [line for line in table if line.rstrip().endswith("cheapest")]
    assert marked.split()[0] == cheapest


def test_logs_prints_the_tail_a_machine_left_and_names_the_machines_that_did(world, capsys):
    store = world.store()
    store.put("machines/r1-0001.json", json.dumps({"machine": "r1-0001", "state": "failed", "reason": "install_failed: uv",
                                                   "log_tail": "line one\nline two\n"}).encode())
    run_file = world.run_file("tpu")
    assert main(["logs", str(run_file), "r1-0001"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["machine=r1-0001 state=failed reason=install_failed: uv", "line one", "line two"]
    assert main(["logs", f"gs://{world.bucket}/jobs/r1", "r1-0009"]) == 65
    err = capsys.readouterr().err
    assert "no machine 'r1-0009'" in err and "machines that have: r1-0001" in err


def test_status_of_a_run_reads_its_queue(world, capsys):
    run_file = world.run_file("vm")
    assert main(["up", str(run_file), "--yes"]) == 0
    capsys.readouterr()
    assert main(["status", str(run_file), "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert (view["total"], view["pending"], view["done"]) == (5, 5, 0)


def test_the_run_template_passes_its_schema_and_the_model(tmp_path):
    """templates/run.yaml names docs/schema/run.json, which refers to job.json and the spec schemas beside it; an
    editor's draft-07 validator with those files accepts it, and refuses a misspelt field of the inline job."""
    import jsonschema
    from referencing import Registry, Resource

    from gcs_spawner.runfile import load_run

    path = REPO / "templates" / "run.yaml"
    assert path.read_text().splitlines()[0] == "# yaml-language-server: $schema=../docs/schema/run.json"
    schemas = REPO / "docs" / "schema"
    registry = Registry().with_resources(
        [(name, Resource.from_contents(json.loads((schemas / name).read_text()))) for name in
         ("job.json", "vm-spec.json", "tpu-spec.json")])
    validator = jsonschema.Draft7Validator(json.loads((schemas / "run.json").read_text()), registry=registry)
    raw = yaml.safe_load(path.read_text())
    assert list(validator.iter_errors(raw)) == []
    assert load_run(path).accelerator == "v5litepod-8"
    raw["job"]["batch_sise"] = raw["job"].pop("batch_size")
    assert [".".join(map(str, e.absolute_path)) for e in validator.iter_errors(raw)] == ["job"]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_a_line_every_interval_in_a_log_and_a_bar_on_a_terminal():
    clock, log = FakeClock(), io.StringIO()
    with Progress("submit", 100, "tasks", stream=log, every_s=10, bar=False, clock=clock) as progress:
        for _ in range(100):
            clock.now += 0.5  # 50 s in all: a line at 10, 20, 30, 40 and 50 s, then the last
            progress.advance()
    lines = log.getvalue().splitlines()
    assert [line.split()[0] for line in lines] == ["event=progress"] * 5 + ["event=progress_done"]
    assert [line.split()[2] for line in lines] == ["done=20", "done=40", "done=60", "done=80", "done=100", "done=100"]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    with Progress("submit", 100, "tasks", stream=screen) as progress:
        progress.advance(100)
    assert "\r" in screen.getvalue() and "100/100" in screen.getvalue() and "event=" not in screen.getvalue()


def test_validate_checks_what_up_would_and_makes_nothing(world, capsys):
    assert main(["validate", str(world.run_file("vm"))]) == 0
    assert "valid: run 'r1' (2 x g2-standard-8, 5 tasks)" in capsys.readouterr().out
    assert world.cloud.mutations() == [] and world.names() == [] and world.names("models/tiny") == []
    world.store("code/r1").delete("locks/cuda12.txt")
    assert main(["validate", str(world.run_file("vm"))]) == 65
    assert "lacks locks/cuda12.txt" in capsys.readouterr().err


def test_mirror_copies_a_checkpoint_config_last_and_refuses_a_bucket_typo(world, capsys, tmp_path):
    assert main(["mirror", str(world.checkpoint), f"gs://{world.bucket}/models/m"]) == 0
    names = capsys.readouterr().out.split(": ", 1)[1].split()
    assert names[-1] == "config.json" and sorted(names) == world.names("models/m")
    assert main(["mirror", str(world.checkpoint), f"gs:/{world.bucket}/models/m2"]) == 65
    assert world.names("models/m2") == []


def test_an_errors_exit_code_comes_from_its_type_not_its_name_or_text(capsys):
    """`failed` reads the type's `exit_code` (issue 46: no table of class names, no search of the message): a
    subclass inherits its base's, a class cli.py never heard of is mapped by its own, an OSError is a failed step,
    and any other error is a bug, re-raised."""
    from exitcodes import EX_DATAERR, EX_FAILED
    from gcs_spawner.checks import CheckError
    from gcs_spawner.cli import failed
    from objectstore import NotFound

    class Refused(CheckError):
        pass

    class Elsewhere(Exception):
        exit_code = EX_DATAERR

    assert failed("t", Refused("pass --yes")) == EX_DATAERR
    assert failed("t", Elsewhere("x")) == EX_DATAERR
    assert failed("t", NotFound("gs://b/o")) == EX_FAILED
    assert failed("t", PermissionError(13, "denied")) == EX_FAILED
    assert "t: error: pass --yes" in capsys.readouterr().err
    with pytest.raises(KeyError):
        failed("t", KeyError("a bug"))


def test_a_misspelt_verb_exits_2_naming_the_nearest_verbs(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["upp", "run.yaml"])
    assert caught.value.code == 2
    assert "gcs-spawner: error: 'upp' is not a verb; did you mean up?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["-v", "frobnicate"])
    assert "'frobnicate' is not a verb; the verbs: plan, validate, up, add, down" in capsys.readouterr().err


def test_a_run_file_that_is_not_there_is_named_with_the_nearest_one(tmp_path, capsys, monkeypatch):
    (tmp_path / "run.yaml").write_text((REPO / "templates" / "run.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    assert main(["up", "runn.yaml"]) == 65
    assert "runn.yaml: no such run file; did you mean run.yaml?" in capsys.readouterr().err
    assert main(["validate", "elsewhere/run.yaml"]) == 65  # a directory that does not exist: the one here
    assert "elsewhere/run.yaml: no such run file; did you mean run.yaml?" in capsys.readouterr().err
    assert main(["plan", "nothing.yaml"]) == 65
    assert "nothing.yaml: no such run file; give the run file's path" in capsys.readouterr().err

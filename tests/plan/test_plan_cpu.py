"""`gcs-spawner plan JOB --accelerator cpu`: a CPU fleet planned like an accelerator one, its peak the price table's
per-vCPU figure (labelled an assumption), its fixed seconds the CPU's measured startup costs."""

from __future__ import annotations

import json

import pytest

from gcs_spawner.cli import main
from reporting.pricing import PRICES_FILE, load_prices
from tests.plan.test_plan import QWEN25_7B_JOB
from tests.plan.test_price_file import plan_with_prices


def plan_json(tmp_path, capsys, accelerator: str) -> dict:
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(QWEN25_7B_JOB))
    code = main(["plan", str(job_file), "--accelerator", accelerator, "--rows", "1000", "--tokens-per-row", "500",
                 "--json"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


@pytest.mark.parametrize("accelerator, machine_type", [("cpu", "n2-standard-8"), ("n2-standard-16", "n2-standard-16")])
def test_a_cpu_machine_type_is_planned_from_its_vcpus_assumed_peak(tmp_path, capsys, accelerator, machine_type):
    plan = plan_json(tmp_path, capsys, accelerator)
    row = load_prices().cpu_machines[machine_type]
    peak = row["vcpus"] * row["peak_fp32_gflops_per_vcpu"] * 1e9
    a = plan["accelerator"]
    assert (a["name"], a["platform"], a["chips"], a["peak_flops"]) == (machine_type, "cpu", 1, pytest.approx(peak))
    assert a["peak_source"].startswith("assumed:") and any("assumed" in w for w in plan["warnings"])
    hours = plan["compute"]["flops"] / (peak * 0.35) / 3600  # --mfu's default
    assert plan["time"]["machine_hours"] == pytest.approx(hours)
    assert plan["compute_dollars"]["on_demand"] == pytest.approx(hours * row["on_demand_per_hour"])
    assert plan["tasks"]["fixed"]["platform"] == "cpu"  # extract/costmodel.py STARTUP_COSTS["cpu"], measured
    assert plan["memory"]["usable_bytes_per_chip"] == row["memory_gib"] * 2**30


def test_a_cpu_machine_type_without_a_peak_is_bad_input_naming_the_field(tmp_path, capsys):
    table = json.loads(PRICES_FILE.read_text())
    del table["cpu_machines"]["c3-standard-8"]["peak_fp32_gflops_per_vcpu"]
    code, err, _ = plan_with_prices(tmp_path, capsys, table, "c3-standard-8")
    assert code == 65
    assert "'c3-standard-8' has no peak_fp32_gflops_per_vcpu" in err

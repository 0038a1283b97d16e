"""reporting/prices.json is declared by a pydantic model (`reporting.pricing.PriceFile`) like every other user file:
the shipped table and a `--prices` copy are validated by it, and a bad field is named with what to write."""

from __future__ import annotations

import json

import pytest

from gcs_spawner.cli import main
from reporting import pricing
from tests.plan.test_plan import QWEN25_7B_JOB


def shipped() -> dict:
    return json.loads(pricing.PRICES_FILE.read_text())


BAD = [
    (lambda r: r["tpu"]["v5e"].update(spot_per_chip_hour=-1), "tpu.v5e.spot_per_chip_hour: must be a number >= 0, got -1"),
    (lambda r: r["gpu_machines"]["g2-standard-8"].update(gpus=True), "gpu_machines.g2-standard-8.gpus: must be a positive integer, got True"),
    (lambda r: r["gpu_machines"]["a2-highgpu-1g"].pop("gpu"), "gpu_machines.a2-highgpu-1g.gpu: missing; a required field"),
    (lambda r: r["cpu_machines"]["n2-standard-8"].update(vcpu=8), "cpu_machines.n2-standard-8.vcpu: unknown field; remove it or use one of: memory_gib,"),
    (lambda r: r["storage"]["region"].update(class_a_per_1000="0.005"), "storage.region.class_a_per_1000: must be a number >= 0, got '0.005'"),
    (lambda r: r.update(as_of="2026-11"), "as_of: must be a date, YYYY-MM-DD, got '2026-11'"),
]  # fmt: skip


@pytest.mark.parametrize("break_it, message", BAD, ids=[message.split(":")[0] for _, message in BAD])
def test_a_bad_field_of_the_price_file_is_named_with_what_to_write(tmp_path, break_it, message):
    raw = shipped()
    break_it(raw)
    with pytest.raises(pricing.PriceError) as error:
        pricing.parse_prices(raw, source="my-prices.json")
    assert str(error.value).startswith(f"my-prices.json: {message}")


def plan_with_prices(tmp_path, capsys, table: dict, accelerator: str) -> tuple[int, str, str]:
    """`gcs-spawner plan` of Qwen2.5-7B on `accelerator` with the price table `table` passed as `--prices`: its exit
    code, its stderr, and the price file's path."""
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps(table))
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(QWEN25_7B_JOB))
    code = main(["plan", str(job_file), "--accelerator", accelerator, "--rows", "10", "--tokens-per-row", "5",
                 "--prices", str(prices)])  # fmt: skip
    return code, capsys.readouterr().err, str(prices)


def test_prices_flag_is_validated_by_the_same_model_and_is_bad_input(tmp_path, capsys):
    raw = shipped()
    raw["tpu"]["v6e"]["peak_bf16_tflops_per_chip"] = "fast"
    code, err, prices = plan_with_prices(tmp_path, capsys, raw, "v6e-8")
    assert code == 65
    assert f"{prices}: tpu.v6e.peak_bf16_tflops_per_chip: must be a number >= 0, got 'fast'" in err


def test_the_shipped_table_is_valid_by_the_model():
    pricing.PriceFile.model_validate(shipped())


def test_one_machine_type_check_refuses_an_unknown_tpu_family_and_lets_an_unpriced_vm_type_through_when_asked():
    """`pricing.check_machine_type` is the check that up/validate/plan, and add share."""
    with pytest.raises(pricing.PriceError, match=r"accelerator: 'v6f-8' is not in the price table .*v6e-8"):
        pricing.check_machine_type("v6f-8", "tpu")
    with pytest.raises(pricing.PriceError, match="counts TensorCores"):
        pricing.check_machine_type("v4-7", "tpu")
    assert pricing.check_machine_type("v6e-8", "tpu").spot_per_hour == pytest.approx(8 * 1.08)
    assert pricing.check_machine_type("g2-standard-96", "vm", unpriced_ok=True) is None
    assert pricing.check_machine_type("g2-standard-8", "vm", unpriced_ok=True).spot_per_hour == 0.34
    with pytest.raises(pricing.PriceError, match="'g2-standard-96' is not in the price table"):
        pricing.check_machine_type("g2-standard-96", "vm")
    assert pricing.check_machine_type("n2-standard-8", "vm").on_demand_per_hour == 0.3885

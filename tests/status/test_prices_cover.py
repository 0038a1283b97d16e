"""Every machine type the project names, in its templates, its docs and its tools (the planner's
help included), is in the price table, so status never leaves a named machine's time unpriced."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from reporting.pricing import load_prices

REPO = Path(__file__).resolve().parents[2]
#: Compute Engine machine types (n2-standard-8, a3-highgpu-8g, e2-standard-4, ...) and TPU
#: accelerator types (v5litepod-16, v6e-8, v4-8, v5p-8).
MACHINE_TYPE = re.compile(
    r"\b(?:[a-z][0-9][a-z]?-(?:standard|highmem|highcpu|highgpu|ultragpu|megagpu|edgegpu)-[0-9]+g?"
    r"|v[0-9]+(?:e|p|litepod)?-[0-9]+)\b"
)


def named_machine_types() -> dict[str, list[str]]:
    """{machine type: [files naming it]} over templates/, docs/ (schemas too), README.md, tools/ and reporting/."""
    files = [*REPO.glob("templates/*.yaml"), *REPO.glob("docs/**/*.md"), *REPO.glob("docs/schema/*.json"),
             REPO / "README.md", *REPO.glob("tools/*.py"), *REPO.glob("reporting/*.py")]  # fmt: skip
    named: dict[str, list[str]] = {}
    for path in files:
        for name in sorted(set(MACHINE_TYPE.findall(path.read_text()))):
            named.setdefault(name, []).append(str(path.relative_to(REPO)))
    return named


def test_the_scan_finds_the_types_the_templates_and_the_planner_use():
    named = named_machine_types()
    assert {"g2-standard-8", "n2-standard-8", "v5litepod-8", "v5litepod-16"} <= set(named)
    assert "templates/vm.yaml" in named["n2-standard-8"] and "reporting/plan.py" in named["v6e-8"]


@pytest.mark.parametrize("machine_type", sorted(named_machine_types()))
def test_every_named_machine_type_is_priced(machine_type: str):
    price = load_prices().machine_price(machine_type)
    assert 0 < price.spot_per_hour < price.on_demand_per_hour

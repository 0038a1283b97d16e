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


def test_every_priced_group_says_how_the_last_refresh_found_it():
    """The table was 544 days old. Refreshed from Google's pages, it says for every group of figures whether
    the refresh confirmed it and on which page, or kept an older reading (and which figures), so a kept
    price is never passed off as a fresh one."""
    table = load_prices()
    groups = {f"tpu.{f}": table.tpu[f] for f in table.tpu} | {f"gpu_machines.{m}": table.gpu_machines[m] for m in table.gpu_machines}
    groups |= {f"cpu_machines.{m}": table.cpu_machines[m] for m in table.cpu_machines}
    groups |= {f"storage.{loc}": vars(table.storage[loc]) for loc in table.storage}
    assert set(table.figures) == set(groups)
    for group, figure in table.figures.items():
        assert figure["source"].startswith("https://cloud.google.com/"), group
        # a figure added since the refresh, never read from the page, is dated when it was added
        assert (figure["as_of"] <= table.as_of or figure["status"] == "unconfirmed") and figure["note"], group
        if figure["status"] != "confirmed":  # the mark names the figures it keeps, and they are the table's
            assert figure["values"] and all(groups[group][k] == v for k, v in figure["values"].items()), group
    assert table.figures["storage.region"]["status"] == "confirmed" and table.figures["storage.region"]["as_of"] == table.as_of


def test_a_kept_price_is_named_where_status_uses_it_and_an_edited_one_is_not(tmp_path: Path):
    import datetime as dt
    import json

    from fleet import machines
    from objectstore import open_store
    from reporting.cost import fleet_cost, prices_text
    from reporting.machinestate import read_row
    from reporting.pricing import PRICES_FILE

    table = load_prices()
    assert table.read_on("g2-standard-8") == table.figures["gpu_machines.g2-standard-8"]["as_of"] < table.as_of
    assert "gpu_machines.g2-standard-8 prices are those read around" in table.unconfirmed("g2-standard-8")
    now = dt.datetime(2026, 11, 27, 12, tzinfo=dt.timezone.utc)
    store = open_store(str(tmp_path / "queue"))
    machines.write_record(store, machines.make_record("vm-1", "working", at=now, since=now.isoformat(), spent={"booting": 60},
                                                      machine_type="g2-standard-8", provisioning="spot"))  # fmt: skip
    rows = [read_row(e, now) for e in store.list("machines/")]
    kept = table.figures["gpu_machines.g2-standard-8"]["as_of"]
    assert prices_text(fleet_cost(rows, table, now)["prices"]) == f"{table.as_of}; g2-standard-8 as read on {kept}, not confirmed since"
    raw = json.loads(PRICES_FILE.read_text())
    raw["gpu_machines"]["g2-standard-8"]["on_demand_per_hour"] = 0.9  # someone's own, newer reading
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(raw))
    edited = load_prices(path)
    assert edited.unconfirmed("g2-standard-8") is None and prices_text(fleet_cost(rows, edited, now)["prices"]) == edited.as_of


@pytest.mark.parametrize("figure, field", [({"status": "fresh"}, "status"), ({"status": "kept", "as_of": "2025-06-01",
                          "source": "https://cloud.google.com/tpu/pricing"}, "values")])  # fmt: skip
def test_a_malformed_figures_entry_names_its_field(tmp_path: Path, figure: dict, field: str):
    import json

    from reporting.pricing import PRICES_FILE, PriceError

    raw = json.loads(PRICES_FILE.read_text())
    raw["figures"]["tpu.v6e"] = figure
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(PriceError, match=rf"figures\.tpu\.v6e\.{field}"):
        load_prices(path)

"""The accelerators a run allows, side by side: hours and dollars to finish on each, the cheapest marked.

SkyPilot's `sky launch` prints the resources it considered with their price and marks the one it chose; this is
that table for a run (`gcs-spawner plan RUN`, and `up` before it asks to proceed). The plan (`reporting.plan`) is
made once, for the run's own accelerator; each other type is priced from the same FLOPs, tasks and output, so the
rows differ only where the machine does: its peak (hence machine-hours and wall clock), its hourly prices, and
whether the job's batch fits its memory (`reporting.plan.memory_plan`), and the fixed seconds a task pays on it
(`reporting.plan.task_fixed_seconds`), priced at its rate as the plan's total prices them. Storage and operations
cost the same on every row and are in every total, so the run's row costs what the plan's total says.
"""

from __future__ import annotations

import math
import pathlib
import tempfile

from reporting import pricing
from reporting.plan import PlanInputs, fixed_machine_hours, memory_plan, task_fixed_seconds
from reporting.planrender import _n


def considered_resources(inputs: PlanInputs, plan: dict, names: list[str], spot: bool) -> list[dict]:
    """One row per accelerator type in `names` (the run's first), in that order, each with `chosen` (the run's),
    `cheapest` (the lowest total in the run's pricing: spot when `spot`) or `error` (a type the table lacks)."""
    from extract import costmodel
    from extract.job import Job, load_job

    prices = pricing.load_prices(inputs.prices)
    job = inputs.job if isinstance(inputs.job, Job) else load_job(inputs.job)
    with tempfile.TemporaryDirectory(prefix="considered-") as workdir:
        config, _, _ = costmodel.model_config(job, inputs.model_config, pathlib.Path(workdir))
    outputs = costmodel.job_outputs(job, config)
    flops = plan["compute"]["flops"]
    tasks = plan["tasks"]["count"]
    fixed = plan["storage"]["dollars"] + plan["operations"]["dollars"]  # the same on every row
    rounds = math.ceil(tasks / inputs.machines) if tasks else 0
    rows = []
    for name in dict.fromkeys(names):
        try:
            machine = prices.accelerator(name)
        except pricing.PriceError as err:
            rows.append({"accelerator": name, "error": str(err), "chosen": name == inputs.accelerator, "cheapest": False})
            continue
        hours = flops / (machine.peak_flops * inputs.mfu) / 3600
        memory = memory_plan(job, config, outputs, machine, prices)
        # The run's own type: the plan's fixed seconds (measured by the queue's ledgers where it has them).
        fixed_s = plan["tasks"]["fixed"] if name == inputs.accelerator else task_fixed_seconds(
            job, config, config.depth_for(outputs), machine, prices, given=inputs.fixed_seconds)
        fixed_hours = fixed_machine_hours(fixed_s, tasks, inputs.machines)
        rows.append({
            "accelerator": name, "family": machine.family, "chips": machine.chips, "hosts": machine.hosts,
            "machine_hours": hours, "wall_clock_hours": rounds * hours / tasks if tasks else 0.0,
            "fixed_machine_hours": fixed_hours,
            "spot_dollars": (hours + fixed_hours) * machine.spot_per_hour + fixed,
            "on_demand_dollars": (hours + fixed_hours) * machine.on_demand_per_hour + fixed,
            "fits": memory["fits"], "max_batch_size": memory["max_batch_size"],
            "chosen": name == inputs.accelerator, "cheapest": False, "error": None,
        })
    key = "spot_dollars" if spot else "on_demand_dollars"
    priced = [row for row in rows if not row["error"] and row["fits"] is not False]
    if priced:
        min(priced, key=lambda row: row[key])["cheapest"] = True
    return rows


def render_considered(rows: list[dict], machines: int, spot: bool, months: float) -> str:
    """The table, a line per type: chips, machine-hours, wall clock on `machines`, spot and on-demand dollars."""
    header = ("ACCELERATOR", "CHIPS", "MACHINE-HOURS", "WALL-CLOCK", "SPOT $", "ON-DEMAND $", "BATCH FITS", "")
    table = [header]
    for row in rows:
        mark = " ".join(word for word, on in (("<- run", row["chosen"]), ("cheapest", row["cheapest"])) if on)
        if row["error"]:
            table.append((row["accelerator"], "-", "-", "-", "-", "-", "-", f"not priced: {row['error']}"))
            continue
        fits = {True: "yes", False: f"no (max {row['max_batch_size']})", None: "unknown"}[row["fits"]]
        table.append((row["accelerator"], str(row["chips"]), _n(row["machine_hours"]),
                      f"{_n(row['wall_clock_hours'])} h", _n(row["spot_dollars"]), _n(row["on_demand_dollars"]),
                      fits, mark))
    widths = [max(len(line[i]) for line in table) for i in range(len(header) - 1)]
    lines = [f"considered resources ({machines} machines of each; $ to finish = compute + storage for "
             f"{months:g} month(s) + operations + the tasks' fixed seconds; cheapest by {'spot' if spot else 'on-demand'} price):"]
    for line in table:
        lines.append("  " + "  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1])
    return "\n".join(line.rstrip() for line in lines)

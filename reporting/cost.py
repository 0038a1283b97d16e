"""What a fleet has cost so far, and will cost to finish: machine records priced from reporting/prices.json.

Machine time comes from the machine records' listing alone (fleet/machines.py: `spent` per
state, plus the current spell from `since` to when it stops being billed: now while the machine is
up or silent, the moment it was declared lost once lost, its last record once final;
reporting.machinestate.billed_until says which and why). It is split by priced type
(`machine_type`), provisioning model (spot, standard) and state:

- `booting`, `installing`, `working`, `idle`: the machine's own spells (a silent or lost
  machine's current spell counts in the state it last recorded); `deleting` and `exited` spells
  count as idle (the machine is up, doing nothing);
- `failed`: the booting and installing seconds of a machine whose record ends `failed`: a boot
  that never became a worker is all loss.

Waste is booting + installing + idle + failed. Only worker 0 of a TPU slice is priced (`host`
absent or 0), at the slice's price: the other hosts' records are the same bill. A type that the
price table does not hold is counted in seconds under `unpriced`, never guessed.

What these figures cannot know, and so leave out: sustained-use discounts, committed-use
contracts, negotiated prices, network egress, disks and IP addresses, storage and operations,
the seconds before the kernel booted, after a final record (a deletion takes a minute), and after
a lost machine was declared lost (if it still runs, it is billed on: delete it).

The JSON holds seconds; the text view and the page show machine-hours (`hours_text`), one unit
for one figure in both.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Mapping

from reporting.machinestate import UP, billed_until, classify, is_worker
from reporting.pricing import PriceError, PriceTable

STATES = ("booting", "installing", "working", "idle", "failed")
WASTE = ("booting", "installing", "idle", "failed")
#: Machine states whose spells are priced as idle: the machine is up and does no work.
AS_IDLE = ("deleting", "exited")
SPOT = "spot"


@dataclasses.dataclass
class _Group:
    seconds: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(STATES, 0.0))
    machines: int = 0


def machine_seconds(row: Mapping, now: dt.datetime) -> dict[str, float]:
    """One machine's seconds per cost state (STATES), from its listed record `row`."""
    seconds = dict.fromkeys(STATES, 0.0)
    spent = dict(row["spent"])
    end = billed_until(row, now)
    if end is not None:
        spent[row["state"]] = spent.get(row["state"], 0) + max(0.0, (end - row["since"]).total_seconds())
    for state, s in spent.items():
        key = "idle" if state in AS_IDLE else state
        if key in seconds:
            seconds[key] += s
    if row["state"] == "failed":
        seconds["failed"] += seconds["booting"] + seconds["installing"]
        seconds["booting"] = seconds["installing"] = 0.0
    return seconds


def _money(value: float) -> float:
    return round(value, 4)


def _per_hour(prices: PriceTable, machine_type: str, provisioning: str) -> float:
    price = prices.machine_price(machine_type)
    return price.spot_per_hour if provisioning == SPOT else price.on_demand_per_hour


def fleet_cost(rows: Iterable[Mapping], prices: PriceTable, now: dt.datetime) -> dict:
    """Cost so far, by (machine type, provisioning model) and state, in seconds and dollars; the
    burn rate is the price of the machines up now (reporting.machinestate.UP)."""
    groups: dict[tuple[str, str], _Group] = {}
    unpriced: dict[str, float] = {}
    burn_per_hour = 0.0
    for row in rows:
        if not is_worker(row) or row["since"] is None:
            continue
        machine_type = row["machine_type"] or "unknown"
        provisioning = row["provisioning"] or "standard"
        seconds = machine_seconds(row, now)
        try:
            per_hour = _per_hour(prices, machine_type, provisioning)
        except PriceError:
            unpriced[machine_type] = unpriced.get(machine_type, 0.0) + sum(seconds.values())
            continue
        group = groups.setdefault((machine_type, provisioning), _Group())
        group.machines += 1
        for state, s in seconds.items():
            group.seconds[state] += s
        if classify(row) in UP:
            burn_per_hour += per_hour  # up now: it goes on costing this much per hour
    by_type = []
    totals_s = dict.fromkeys(STATES, 0.0)
    totals_d = dict.fromkeys(STATES, 0.0)
    for (machine_type, provisioning), group in sorted(groups.items()):
        per_hour = _per_hour(prices, machine_type, provisioning)
        dollars = {state: s * per_hour / 3600 for state, s in group.seconds.items()}
        for state in STATES:
            totals_s[state] += group.seconds[state]
            totals_d[state] += dollars[state]
        by_type.append({
            "machine_type": machine_type,
            "provisioning": provisioning,
            "machines": group.machines,
            "per_hour": per_hour,
            "seconds": {state: round(s, 1) for state, s in group.seconds.items()},
            "dollars": {state: _money(d) for state, d in dollars.items()},
        })  # fmt: skip
    # The types priced here whose figures are an older reading the table's last refresh could not confirm.
    older = {t: prices.read_on(t) for t, _ in sorted(groups) if prices.read_on(t) != prices.as_of}
    return {
        "prices": {"file": prices.source, "as_of": prices.as_of, "older": older},
        "seconds": {state: round(s, 1) for state, s in totals_s.items()},
        "dollars": {state: _money(d) for state, d in totals_d.items()},
        "total_seconds": round(sum(totals_s.values()), 1),
        "total_dollars": _money(sum(totals_d.values())),
        "waste_seconds": round(sum(totals_s[s] for s in WASTE), 1),
        "waste_dollars": _money(sum(totals_d[s] for s in WASTE)),
        "burn_per_hour": _money(burn_per_hour),
        "by_type": by_type,
        "unpriced_seconds": {t: round(s, 1) for t, s in sorted(unpriced.items())},
        "not_included": "sustained-use discounts, committed-use contracts, negotiated prices, network egress, "
        "disks, storage; spot prices vary daily",
    }


def to_finish(cost: Mapping, eta_s: float | None, eta_range_s: tuple[float | None, float | None] | None, done: int) -> dict:
    """The projected cost to finish: the live fleet's burn rate (dollars per hour of the machines up
    now) over the ETA and its range; and the measured dollars per finished task."""
    burn = cost["burn_per_hour"] / 3600

    def over(seconds: float | None) -> float | None:
        return None if seconds is None else _money(burn * seconds)

    low, high = eta_range_s if eta_range_s else (None, None)
    return {
        "dollars": over(eta_s),
        "dollars_range": [over(low), over(high)],
        "dollars_per_task": _money(cost["total_dollars"] / done) if done else None,
        "projected_total_dollars": None if eta_s is None else _money(cost["total_dollars"] + burn * eta_s),
    }


def render_cost(cost: Mapping, finish: Mapping | None) -> list[str]:
    """The text status's cost and waste lines."""
    s, d = cost["seconds"], cost["dollars"]
    lines = [
        f"spent   ${cost['total_dollars']:,.2f} over {hours_text(cost['total_seconds'])} machine-hours: "
        + ", ".join(f"{state} {hours_text(s[state])}h ${d[state]:,.2f}" for state in STATES)
        + f"  (prices {prices_text(cost['prices'])})",
        f"waste   ${cost['waste_dollars']:,.2f}, {hours_text(cost['waste_seconds'])} machine-hours "
        "(boot, install, idle, failed boots)",
    ]
    for group in cost["by_type"]:
        lines.append(
            f"  {group['machine_type']} {group['provisioning']} x{group['machines']} at ${group['per_hour']:,.2f}/h: "
            f"${sum(group['dollars'].values()):,.2f}"
        )
    for machine_type, seconds in cost["unpriced_seconds"].items():
        lines.append(f"  {machine_type}: {hours_text(seconds)} machine-hours, not in the price table")
    if finish is not None:
        low, high = finish["dollars_range"]
        if finish["dollars"] is None:
            lines.append(f"finish  ? (no completion rate yet); burning ${cost['burn_per_hour']:,.2f}/h")
        else:
            span = f"${low:,.2f} to " + (f"${high:,.2f}" if high is not None else "unbounded")
            lines.append(
                f"finish  ${finish['dollars']:,.2f} more ({span}) at ${cost['burn_per_hour']:,.2f}/h; "
                f"${finish['dollars_per_task'] or 0:,.4f} per task so far"
            )
    return lines


def prices_text(prices: Mapping) -> str:
    """`2026-11-27; g2-standard-8 as read on 2025-06-01, not confirmed since`: the table's date, and the types
    priced from an older reading its last refresh kept (reporting/prices.json, `figures`)."""
    by_date: dict[str, list[str]] = {}
    for machine_type, read in (prices.get("older") or {}).items():
        by_date.setdefault(read, []).append(machine_type)
    older = "; ".join(f"{', '.join(types)} as read on {read}, not confirmed since" for read, types in sorted(by_date.items()))
    return prices["as_of"] + (f"; {older}" if older else "")


def hours_text(seconds: float) -> str:
    """Machine-seconds as the machine-hours both views show: `1,234.57`."""
    return f"{seconds / 3600:,.2f}"

"""The fleet's goodput: how much of the consumers' time went to the forward pass, and what the rest cost.

Each task's consumer counts its phases (extract/phases.py) into its progress records' `counters`; the queue sums
them into the done marker's `counters` metadata, and status already lists those (reporting/status.py). From the
sums over every done task:

- **goodput** = steady-state seconds / the consumers' wall seconds (process start to last stored shard);
- **fixed seconds a task** = the other phases' seconds / the attempts that reported them (`goodput_attempts`);
- **fixed dollars** ≈ the fleet's `working` dollars (reporting/cost.py) × the fixed share of the consumers' time.
  Working time also holds the spawner's own seconds around each consumer (claims, the task file, the done
  marker), which the consumers cannot see: the figure is an estimate of what start-ups cost, not a bill line.

Tasks done by consumers older than these counters report none; the block then says nothing rather than zero.
"""

from __future__ import annotations

from collections.abc import Mapping

from extract.phases import ATTEMPTS, FIXED_PHASES, PHASES, STEADY, counter_name, is_goodput_counter


def split_counters(counters: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """(the other counters, the goodput counters): status lists the first and summarises the second."""
    others = {k: v for k, v in counters.items() if not is_goodput_counter(k)}
    return others, {k: v for k, v in counters.items() if is_goodput_counter(k)}


def summary(counters: Mapping[str, int]) -> dict | None:
    """Goodput, fixed seconds and seconds per phase from summed counters; None when no task reported phases."""
    ms = {phase: int(counters.get(counter_name(phase), 0)) for phase in PHASES}
    wall_ms = sum(ms.values())
    if wall_ms <= 0:
        return None
    attempts = int(counters.get(ATTEMPTS, 0))
    fixed_ms = wall_ms - ms[STEADY]
    return {
        "goodput": round(ms[STEADY] / wall_ms, 4),
        "attempts": attempts,
        "wall_s": wall_ms / 1000,
        "steady_s": ms[STEADY] / 1000,
        "fixed_s": fixed_ms / 1000,
        "fixed_s_per_attempt": round(fixed_ms / 1000 / attempts, 2) if attempts else None,
        "phases_s": {phase: ms[phase] / 1000 for phase in PHASES},
    }


def with_cost(goodput: dict | None, cost: Mapping | None) -> dict | None:
    """`goodput` with `fixed_dollars` and `working_dollars` from the fleet's cost, when there is one."""
    if goodput is None or not cost:
        return goodput
    working = float(cost["dollars"]["working"])
    share = goodput["fixed_s"] / goodput["wall_s"]
    return {**goodput, "working_dollars": working, "fixed_dollars": round(working * share, 4)}


def render_goodput(goodput: Mapping | None) -> list[str]:
    """The text status's goodput line (none without reported phases)."""
    if goodput is None:
        return []
    per = goodput["fixed_s_per_attempt"]
    phases = ", ".join(f"{phase.replace('_', ' ')} {goodput['phases_s'][phase] / max(1, goodput['attempts']):.1f}"
                       for phase in FIXED_PHASES)  # fmt: skip
    line = (f"goodput {goodput['goodput']:.1%} of consumer time in the steady forward over {goodput['attempts']} "
            f"attempts; fixed {per if per is not None else '?'} s an attempt ({phases})")  # fmt: skip
    if "fixed_dollars" in goodput:
        line += f"; ~${goodput['fixed_dollars']:,.2f} of ${goodput['working_dollars']:,.2f} working"
    return [line]

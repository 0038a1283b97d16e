"""The plan as text: `render` turns the dict `reporting.plan.make_plan` returns into the lines `gcs-spawner plan`
prints, one figure a line, warnings last. Nothing here computes a figure; `_n` and `_si` write them for people."""

from __future__ import annotations


def _n(value: float) -> str:
    """A figure for people: thousands separated, and small values still visible (0.000412, not 0.00)."""
    if value == 0 or abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:,.2f}"
    return f"{value:.3g}"


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:,.2f} {prefix}{unit}"
    return f"{value:,.0f} {unit}"


def _memory_line(m: dict) -> str:
    mesh = f"mesh data={m['mesh']['data']},model={m['mesh']['model']}"
    if m["usable_bytes_per_chip"] is None:
        return f"  memory      {m['chip']}: unknown; {m['attention']} attention, {mesh}"
    return (
        f"  memory      {_si(m['step_bytes_per_chip'], 'B')} a chip for a step of batch_size {m['batch_size']} of "
        f"{_si(m['usable_bytes_per_chip'], 'B')} usable ({m['attention']} attention, {mesh}); up to batch_size "
        f"{m['max_batch_size']} fits ({m['max_tokens_per_step']:,} tokens a step)"
    )


def _fixed_line(fixed: dict) -> str:
    share = f", {fixed['share_of_job']:.1%} of the tasks' time" if fixed["share_of_job"] is not None else ""
    programs = f"{fixed['programs']} program{'s' if fixed['programs'] != 1 else ''}"
    return (
        f"  fixed       ~{_n(fixed['warm_s'])} s a task on a {fixed['platform'].upper()} machine that ran the job "
        f"before{share}; ~{_n(fixed['first_task_extra_s'])} s more on its first (the weights from the bucket, "
        f"{programs} compiled): {_n(fixed['machine_hours'])} machine-hours, on-demand {_n(fixed['on_demand'])} "
        f"spot {_n(fixed['spot'])} $ (in total $); {fixed['source'].replace('assumed:', 'ASSUMED:', 1)}"
    )


def render(plan: dict) -> str:
    t, c, a, tm = plan["tokens"], plan["compute"], plan["accelerator"], plan["time"]
    o, s, ops, tk = plan["output"], plan["storage"], plan["operations"], plan["tasks"]
    d, total = plan["compute_dollars"], plan["total_dollars"]
    sp = plan["sampling"]
    lines = [
        f"plan for {plan['job']}",
        f"  model       {plan['model']['name']} ({plan['model']['model_type']}, hidden {plan['model']['hidden_size']}, "
        f"{plan['model']['num_hidden_layers']} layers; config: {plan['model']['config']})",
        f"  layers      {plan['layers']}" + (f", sites {plan['sites']}" if plan["sites"] else "")
        + f": {plan['layers_computed']} decoder layers computed",
        f"  rows        {t['rows']:,} ({t['rows_source']})",
        f"  tokens      {t['rows']:,} rows x {t['tokens_per_row']:,.1f} tokens/row = {_si(t['tokens'], 'tokens')}"
        f"  ({t['source']})",
        f"  compute     {_si(c['flops'], 'FLOP')} = {_si(c['flops_per_token'], 'FLOP')}/token to layer "
        f"{plan['layers_computed']}",
        f"  accelerator {a['name']}: {a['chips']} x {a['family']}, peak {_si(a['peak_flops'], 'FLOP/s')}, "
        f"assumed MFU {a['mfu']:.2f}",
        f"  time        {_n(tm['machine_hours'])} machine-hours ({_n(tm['chip_hours'])} chip-hours); "
        f"{_n(tm['wall_clock_hours'])} h wall clock on {tm['machines']} machines ({tm['rounds']} rounds of tasks)",
        f"  compute $   on-demand {_n(d['on_demand'])}   spot {_n(d['spot'])}   "
        f"({_n(a['on_demand_per_hour'])} / {_n(a['spot_per_hour'])} $/machine-hour)",
        f"  stored      {_si(sp['stored_tokens'], 'tokens')} of {_si(sp['processed_tokens'], 'tokens')} processed "
        f"({sp['stored_fraction']:.1%}; token_sample {sp['token_sample']:g}, drop_first {sp['drop_first']}); "
        f"{sp['documents_covered']:,.0f} documents keep at least one token ({sp['documents_covered_fraction']:.1%}), "
        f"{_n(sp['stored_tokens_per_covered_document'])} tokens each",
        f"  output      {_si(o['bytes'], 'B')} ({o['bytes_per_token']:,} B/token in {o['dtype']}, {o['shards']:,} shards "
        f"of ~{_si(o['shard_bytes'], 'B')}, {o['shard_rows']:,} rows each: cut by {o['shard_cut_by']})",
        f"  storage $   {_n(s['dollars_per_month'])} per month ({s['location']} Standard, "
        f"{s['per_gib_month']} $/GiB-month); {_n(s['dollars'])} for {s['months']:g} month(s)",
        f"  operations  {ops['class_a_total']:,} Class A ({_n(ops['per_task'])}/task: "
        + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in ops["class_a"].items())
        + f") = {_n(ops['dollars'])} $",
        _memory_line(plan["memory"]),
        f"  tasks       {tk['count']:,} tasks ({tk['from']}), ~{_n(tk['mean_minutes'])} min each",
        _fixed_line(tk["fixed"]),
        f"  recommend   --rows-per-task {tk['recommended_rows_per_task']}: ~{_n(tk['recommended_task_minutes'])} min a "
        f"task on {a['name']} (target {tk['target_minutes']:g} min; at least {_n(tk['fixed']['min_task_minutes'])} "
        f"keeps the fixed seconds under {tk['fixed']['max_share']:.0%})",
        f"  total $     on-demand {_n(total['on_demand'])}   spot {_n(total['spot'])}   "
        f"(compute + fixed + storage for {s['months']:g} month(s) + operations)",
        f"  prices      {plan['prices']['file']} as of {plan['prices']['as_of']}; spot figures are approximate",
    ]
    budget = plan.get("storage_budget")
    if budget is not None and budget["token_sample"] is None:
        lines.append(f"  budget      {budget['tb']:g} TB: no token_sample fits; the per-row and per-shard bytes alone "
                     "exceed it (fewer rows or layers)")  # fmt: skip
    elif budget is not None:
        lines.append(
            f"  budget      {budget['tb']:g} TB: token_sample {budget['token_sample']:g} stores "
            f"{_si(budget['stored_tokens'], 'tokens')} in {_si(budget['bytes'], 'B')} ({budget['shards']:,} shards, "
            f"{_n(budget['dollars_per_month'])} $/month); {budget['documents_covered']:,.0f} documents keep a token "
            f"({budget['documents_covered_fraction']:.1%}), {_n(budget['stored_tokens_per_covered_document'])} each; "
            f"every token of fewer rows would cover {budget['rows_if_unsampled']:,}"
        )
    for warning in plan["warnings"]:
        lines.append("")
        lines.append("!!! WARNING: " + warning)
    return "\n".join(lines)

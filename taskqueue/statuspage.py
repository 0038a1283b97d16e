"""The status page: one self-contained HTML file drawn from the view that `tools/status.py --json` prints.

It holds no script, no font and no link: charts are SVG that matplotlib draws here (text as
paths), styles are inline, so the file opens offline, from a disk or from the bucket's
authenticated object URL. Every figure on it is a value of the view, marked `data-key="<path>"`
(a dotted path into the JSON), so a test can hold the page to `--json`.
"""

from __future__ import annotations

import collections
import datetime as dt
import html
import io
from collections.abc import Mapping

from taskqueue.status import duration_text

STATE_COLOURS = {"booting": "#9ecae1", "installing": "#4292c6", "working": "#31a354", "idle": "#fdae6b",
                 "failed": "#de2d26", "deleting": "#969696", "exited": "#636363"}  # fmt: skip
COST_STATES = ("booting", "installing", "working", "idle", "failed")

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;max-width:1100px;color:#222;padding:0 16px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:22px 0 8px;border-bottom:1px solid #ddd;padding-bottom:3px}
.sub{color:#666;margin-bottom:14px}.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(170px,1fr));gap:10px}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px}.card .v{font-size:22px;font-weight:600}
.card .l{color:#666;font-size:12px}table{border-collapse:collapse;width:100%;margin:6px 0}
td,th{border-bottom:1px solid #eee;padding:3px 8px;text-align:left;vertical-align:top}th{background:#f6f6f6}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}.bar{height:14px;background:#eee;border-radius:7px;overflow:hidden}
.bar span{display:block;height:100%;background:#31a354}.charts{display:grid;grid-template-columns:1fr 1fr;gap:16px}
figure{margin:0}figure svg{width:100%;height:auto}.warn{color:#b30000}.muted{color:#777}code{font-size:12px}
"""


def _key(view: Mapping, path: str):
    value: object = view
    for part in path.split("."):
        value = value[part] if isinstance(value, Mapping) else value[int(part)]  # type: ignore[index]
    return value


def _num(value, digits: int = 0) -> str:
    if value is None:
        return "?"
    return f"{value:,.{digits}f}" if isinstance(value, float) or digits else f"{value:,}"


class _Page:
    """Collects the page's HTML; `value(path, text)` emits a figure tied to the view's JSON."""

    def __init__(self, view: Mapping):
        self.view = view
        self.parts: list[str] = []

    def add(self, text: str) -> None:
        self.parts.append(text)

    def value(self, path: str, text: str | None = None, digits: int = 0, tag: str = "span", cls: str = "") -> str:
        raw = _key(self.view, path)
        shown = text if text is not None else _num(raw, digits)
        attr = f' class="{cls}"' if cls else ""
        return f'<{tag}{attr} data-key="{html.escape(path)}" data-value="{html.escape(str(raw))}">{html.escape(shown)}</{tag}>'


def _svg(fig) -> str:
    import matplotlib.pyplot as plt

    out = io.StringIO()
    fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = out.getvalue()
    return text[text.index("<svg") :]


def _figure():
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the status page draws its charts with matplotlib: pip install '.[status]'") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Glyphs as paths (no font needed to view it) and stable ids (a re-render of one view is identical).
    matplotlib.rcParams.update({"svg.fonttype": "path", "svg.hashsalt": "status", "font.size": 9})
    return plt.subplots(figsize=(5.2, 2.8))


def completion_chart(view: Mapping) -> str | None:
    curve = view.get("curve")
    if not curve:
        return None
    fig, ax = _figure()
    start = dt.datetime.fromisoformat(curve["start"])
    times = [start + dt.timedelta(seconds=s) for s, _ in curve["points"]]
    ax.plot(times, [n for _, n in curve["points"]], color="#31a354", lw=2, label="done")
    ax.axhline(view["total"], color="#888", ls="--", lw=1, label=f"total {view['total']:,}")
    ax.set_ylim(0, max(view["total"], 1) * 1.05)
    ax.set_ylabel("tasks done")
    ax.set_title("Completion curve (UTC)")
    ax.legend(loc="upper left", frameon=False)
    fig.autofmt_xdate()
    return _svg(fig)


def machines_chart(fleet: Mapping) -> str | None:
    if not fleet.get("machines"):
        return None
    fig, ax = _figure()
    states = list(fleet["by_state"])
    counts = [fleet["by_state"][s] for s in states]
    ax.barh(states, counts, color=[STATE_COLOURS.get(s, "#999") for s in states])
    for y, n in enumerate(counts):
        ax.text(n, y, f" {n}", va="center")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("machines")
    ax.set_title("Machines by state")
    ax.invert_yaxis()
    return _svg(fig)


def cost_chart(cost: Mapping) -> str | None:
    if not cost["total_seconds"]:
        return None
    fig, ax = _figure()
    dollars = [cost["dollars"][s] for s in COST_STATES]
    ax.bar(COST_STATES, dollars, color=[STATE_COLOURS[s] for s in COST_STATES])
    for x, d in enumerate(dollars):
        ax.text(x, d, f"${d:,.2f}", ha="center", va="bottom")
    ax.margins(y=0.15)  # room for the labels above the bars
    ax.set_ylabel("US dollars")
    ax.set_title("Cost so far by machine state")
    return _svg(fig)


def render_html(view: Mapping, generated: dt.datetime | None = None) -> str:
    """The page for `view` (tools/status.py's --json object: the queue's snapshot with `fleet` and `finish`)."""
    generated = generated or dt.datetime.now(dt.timezone.utc)
    page = _Page(view)
    total = view["total"] or 1
    pct = 100 * view["done"] / total
    page.add(f"<h1>Queue status</h1><div class='sub'><code>{html.escape(view['queue'])}</code> &middot; "
             f"{'estimate' if view['estimate'] else 'exact'} &middot; as of {generated.isoformat(timespec='seconds')} "
             f"&middot; {page.value('requests')} requests</div>")  # fmt: skip

    # Progress and ETA
    page.add("<h2>Progress</h2>")
    page.add(f"<div class='bar'><span style='width:{pct:.2f}%'></span></div>")
    cards = [("done", "done"), ("total", "total"), ("pending", "pending"), ("leased", "leased"), ("stale", "stale"),
             ("failed", "failed")]  # fmt: skip
    page.add("<div class='grid' style='margin-top:10px'>" + "".join(
        f"<div class='card'><div class='v'>{page.value(k)}</div><div class='l'>{label}</div></div>" for k, label in cards
    ) + "</div>")  # fmt: skip
    eta = view.get("eta_s")
    span = view.get("eta_range_s")
    rate = view.get("tasks_per_s")
    eta_html = page.value("eta_s", duration_text(eta) if eta is not None else "?")
    if view["complete"]:
        eta_html = "complete"
    elif span:
        eta_html += (f" (range {page.value('eta_range_s.0', duration_text(span[0]))} to "
                     f"{page.value('eta_range_s.1', duration_text(span[1]))})")  # fmt: skip
    if view.get("eta_fleet_s") is not None and not view["complete"]:
        eta_html += (f"; {page.value('workers_up')} machines up need about "
                     f"{page.value('eta_fleet_s', duration_text(view['eta_fleet_s']))}")  # fmt: skip
    elif view.get("workers_up") == 0 and not view["complete"]:
        eta_html = "<span class='warn'>never: no machine is up</span>"
    rate_html = page.value("tasks_per_s", f"{rate * 60:,.1f} tasks/min") if rate else "no recent completions"
    median = view.get("median_task_s")
    page.add(f"<p>ETA <b>{eta_html}</b> &middot; rate {rate_html} over the last "
             f"{page.value('recent_done')} completions ({view['rate_window_s'] / 60:.0f} min window)"
             + (f" &middot; median task {page.value('median_task_s', duration_text(median))}" if median is not None else "")
             + f" &middot; {pct:.1f}% done</p>")  # fmt: skip

    fleet = view.get("fleet") or {}
    cost = fleet.get("cost")
    charts = [("chart-completion", completion_chart(view)), ("chart-machines", machines_chart(fleet)),
              ("chart-cost", cost_chart(cost) if cost else None)]  # fmt: skip
    drawn = [(name, chart) for name, chart in charts if chart]
    if drawn:
        page.add("<div class='charts'>" + "".join(f"<figure class='chart' id='{n}'>{c}</figure>" for n, c in drawn) + "</div>")

    # Cost
    if cost:
        finish = view.get("finish") or {}
        page.add("<h2>Cost</h2>")
        page.add(f"<p>So far <b>${page.value('fleet.cost.total_dollars', digits=2)}</b> over "
                 f"{page.value('fleet.cost.total_seconds', digits=0)} machine-seconds; "
                 f"<span class='warn'>waste ${page.value('fleet.cost.waste_dollars', digits=2)}</span> "
                 f"({page.value('fleet.cost.waste_seconds', digits=0)} s of boot, install, idle and failed boots). "
                 f"Burning ${page.value('fleet.cost.burn_per_hour', digits=2)}/h now.</p>")  # fmt: skip
        if finish.get("dollars") is not None:
            low, high = finish["dollars_range"]
            page.add(f"<p>To finish: <b>${page.value('finish.dollars', digits=2)}</b> (range "
                     f"${page.value('finish.dollars_range.0', digits=2)} to "
                     + (f"${page.value('finish.dollars_range.1', digits=2)}" if high is not None else "unbounded")
                     + f"), projected total ${page.value('finish.projected_total_dollars', digits=2)}; "
                     f"${page.value('finish.dollars_per_task', digits=4)} per finished task so far.</p>")  # fmt: skip
        else:
            page.add("<p>To finish: unknown until tasks complete at a measurable rate.</p>")
        rows = "".join(
            f"<tr><td>{s}</td><td class='n'>{page.value(f'fleet.cost.seconds.{s}', digits=0)}</td>"
            f"<td class='n'>${page.value(f'fleet.cost.dollars.{s}', digits=2)}</td></tr>" for s in COST_STATES
        )
        page.add(f"<table id='cost-by-state'><tr><th>state</th><th class='n'>machine-seconds</th><th class='n'>dollars</th></tr>{rows}</table>")
        rows = "".join(
            f"<tr><td>{html.escape(g['machine_type'])}</td><td>{html.escape(g['provisioning'])}</td>"
            f"<td class='n'>{g['machines']}</td><td class='n'>${g['per_hour']:,.2f}</td>"
            f"<td class='n'>${sum(g['dollars'].values()):,.2f}</td></tr>" for g in cost["by_type"]
        )
        page.add("<table id='cost-by-type'><tr><th>type</th><th>provisioning</th><th class='n'>machines</th>"
                 f"<th class='n'>per hour</th><th class='n'>so far</th></tr>{rows}</table>")  # fmt: skip
        for machine_type, seconds in cost["unpriced_seconds"].items():
            page.add(f"<p class='muted'>{html.escape(machine_type)}: {seconds:,.0f} machine-seconds, not in the price table.</p>")
        page.add(f"<p class='muted'>List prices of {html.escape(cost['prices']['as_of'])}. Not included: "
                 f"{html.escape(cost['not_included'])}.</p>")  # fmt: skip

    # Stragglers and machines without progress
    page.add("<h2>Stragglers</h2>")
    stragglers = fleet.get("stragglers") or []
    stuck = fleet.get("no_progress") or []
    silent = fleet.get("silent") or []
    if not (stragglers or stuck or silent or view.get("stale_leases")):
        page.add("<p class='muted'>None.</p>")
    if stragglers:
        rows = "".join(f"<tr><td>{html.escape(s['machine'])}</td><td>{html.escape(str(s['task']))}</td>"
                       f"<td class='n'>{duration_text(s['held_s'])}</td></tr>" for s in stragglers)  # fmt: skip
        page.add(f"<table id='stragglers'><tr><th>machine</th><th>task</th><th class='n'>held</th></tr>{rows}</table>")
    for s in stuck:
        page.add(f"<p>No progress: <code>{html.escape(s['machine'])}</code> {s['state']} for {duration_text(s['for_s'])}</p>")
    if silent:
        page.add(f"<p>Silent for more than {fleet['silent_after_s']:.0f} s: {html.escape(', '.join(silent))}</p>")
    for s in view.get("stale_leases") or []:
        page.add(f"<p>Stale lease: {html.escape(s['task'])} held by {html.escape(s['worker'])}, silent {s['silent_s']:.0f} s</p>")

    # Failures grouped by reason
    page.add("<h2>Failures</h2>")
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for task_id, reason in view.get("failed_reasons", {}).items():
        groups[reason].append(task_id)
    if not groups and not fleet.get("failures"):
        page.add("<p class='muted'>None.</p>")
    for reason, tasks in sorted(groups.items()):
        rows = "".join(
            f"<tr><td><code>{html.escape(t)}</code></td><td>{html.escape(view['failed_details'].get(t) or '')}</td></tr>"
            for t in tasks
        )
        page.add(f"<p><b>{html.escape(reason)}</b> &times; {len(tasks)}</p><table class='dead-letters'>{rows}</table>")
    if view["failed"] > len(view.get("failed_reasons", {})):
        page.add(f"<p class='muted'>{view['failed'] - len(view['failed_reasons'])} more dead letters not read.</p>")
    for reason, names in (fleet.get("failures") or {}).items():
        page.add(f"<p>Machines failed: <b>{html.escape(reason)}</b> &times; {len(names)}: {html.escape(', '.join(names[:10]))}</p>")

    # Skipped rows and the other counters
    page.add("<h2>Skipped rows</h2>")
    counters = view.get("counters") or {}
    page.add(f"<p>{page.value('counters.skipped_rows') if 'skipped_rows' in counters else '0'} rows skipped</p>")
    others = {k: v for k, v in counters.items() if k != "skipped_rows"}
    if others:
        page.add("<p class='muted'>" + ", ".join(f"{html.escape(k)}: {v:,}" for k, v in others.items()) + "</p>")

    body = "\n".join(page.parts)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>status {html.escape(view['queue'])}</title><style>{STYLE}</style></head>\n<body>\n{body}\n</body></html>\n"
    )

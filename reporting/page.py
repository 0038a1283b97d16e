"""The status page: one self-contained HTML file drawn from the view that `tools/status.py --json` prints.

It holds no script, no font and no link: charts are SVG that matplotlib draws here (text as
paths), styles are inline, so the file opens offline, from a disk or from the bucket's
authenticated object URL. Every figure on it is a value of the view, marked `data-key="<path>"`
(a dotted path into the JSON), so a test can hold the page to `--json`.

It reads on any screen and in either colour scheme:

- one column below NARROW_PX, tables that scroll inside themselves, text that wraps;
- each chart is drawn twice, for a phone and for a wide screen, and CSS shows the one that fits,
  so its text is as large as the page's on both (a chart scaled down to a phone is unreadable);
- colours are CSS custom properties with a `prefers-color-scheme: dark` set. The charts are drawn
  with placeholder colours that are then replaced by `var(--ink)`, `var(--s-working)`, ..., so
  one drawing follows the page's scheme.

One figure, one form: machine time is in machine-hours here as in the text view
(reporting.cost.hours_text), chart axes group thousands and show the decimals their step needs
(`_AxisNumbers`), and charts side by side are drawn at one size, so they stand equally high.
"""

from __future__ import annotations

import collections
import datetime as dt
import html
import io
import re
import warnings
from collections.abc import Mapping

from reporting.cost import hours_text, prices_text
from reporting.status import dead_letter_groups, detail_text, duration_text, eta_gap_text, reported_counters

#: Below this width the page is one column and the charts are the phone drawings.
NARROW_PX = 700
#: Rows of a machine table on the page; the rest are counted (tools/status.py --machines lists them).
PAGE_ROWS = 100
#: Names listed per machine failure reason.
NAMES_PER_REASON = 20

#: The roles the page colours, light and dark. Text colours keep a contrast of 4.5:1 or more with
#: the page and panel backgrounds in both schemes (WCAG 2.x, AA); state colours fill bars and
#: legend swatches, and any two of them differ by a CIEDE2000 colour difference of 20 or more in
#: each scheme (the browser test measures it), so no two conditions read as one.
PALETTE = {
    "bg": ("#ffffff", "#0d1117"),
    "panel": ("#f3f5f7", "#161b22"),
    "ink": ("#1b1f24", "#e6edf3"),
    "muted": ("#57606a", "#9da7b3"),
    "line": ("#d0d7de", "#30363d"),
    "warn": ("#b42318", "#ff7b72"),
    "accent": ("#1a7f37", "#3fb950"),
    "s-booting": ("#38a8e8", "#9ae4fe"),
    "s-installing": ("#12619c", "#238ef4"),
    "s-working": ("#219824", "#5fcf7b"),
    "s-idle": ("#f79226", "#e59f47"),
    "s-silent": ("#d4cb04", "#fdf13c"),
    "s-lost": ("#69209a", "#bc6ffd"),
    "s-failed": ("#b7313b", "#f74346"),
    "s-preempted": ("#845c17", "#9a5a2a"),
    "s-deleting": ("#f24ed7", "#ffb9d9"),
    "s-exited": ("#2f2f2f", "#a3a3a3"),
    "s-unknown": ("#c8c8c8", "#4a4a4a"),
}
#: Placeholder colours the charts are drawn in, one per role, replaced by `var(--role)` afterwards.
_PLACEHOLDER = {role: f"#0102{k + 16:02x}" for k, role in enumerate(PALETTE)}
COST_STATES = ("booting", "installing", "working", "idle", "failed")


def _style() -> str:
    light = ";".join(f"--{role}:{light}" for role, (light, _) in PALETTE.items())
    dark = ";".join(f"--{role}:{dark}" for role, (_, dark) in PALETTE.items())
    return f"""
:root{{color-scheme:light dark;{light}}}
@media (prefers-color-scheme:dark){{:root{{{dark}}}}}
html{{background:var(--bg);color:var(--ink)}}
body{{font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1180px;padding:12px 20px 32px}}
h1{{font-size:22px;margin:8px 0 2px}}h2{{font-size:18px;margin:26px 0 8px;border-bottom:1px solid var(--line);padding-bottom:3px}}
h3{{font-size:15px;margin:14px 0 4px}}p{{margin:6px 0}}
.sub,.muted{{color:var(--muted)}}.warn{{color:var(--warn)}}b.warn,.warn b{{font-weight:600}}
code{{font-size:13px;overflow-wrap:anywhere}}
.bar{{height:14px;background:var(--line);border-radius:7px;overflow:hidden;margin:4px 0 10px}}
.bar span{{display:block;height:100%;background:var(--accent)}}
.cards{{display:grid;grid-template-columns:repeat(auto-fit,minmax(110px,1fr));gap:8px}}
.card{{border:1px solid var(--line);border-radius:6px;padding:6px 10px;background:var(--panel)}}
.card .v{{font-size:22px;font-weight:600;font-variant-numeric:tabular-nums}}.card .l{{color:var(--muted);font-size:13px}}
.states{{display:flex;flex-wrap:wrap;gap:6px 14px;padding:0;margin:6px 0;list-style:none}}
.states li::before{{content:"";display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:5px;background:var(--c)}}
.scroll{{overflow-x:auto;max-width:100%}}
table{{border-collapse:collapse;width:100%;margin:6px 0}}
td,th{{border-bottom:1px solid var(--line);padding:4px 8px;text-align:left;vertical-align:top}}
th{{background:var(--panel);font-weight:600}}
td.n,th.n{{text-align:right;font-variant-numeric:tabular-nums}}td.n,th,td.id{{white-space:nowrap}}
.charts{{display:grid;grid-template-columns:1fr;gap:18px;margin-top:14px}}
@media (min-width:1000px){{.charts{{grid-template-columns:1fr 1fr}}.charts .full{{grid-column:1/-1}}}}
figure{{margin:0;min-width:0}}figure svg{{display:block;width:100%;height:auto}}
.half svg{{max-width:720px}}
.phone{{display:none}}
@media (max-width:{NARROW_PX}px){{body{{padding:8px 12px 24px}}.phone{{display:block}}.screen{{display:none}}
h1{{font-size:20px}}.card .v{{font-size:19px}}
table.stack,table.stack tbody,table.stack tr{{display:block}}table.stack thead{{display:none}}
table.stack tr{{border-bottom:1px solid var(--line);padding:5px 0}}
table.stack td{{display:inline;border:0;padding:0 10px 0 0}}table.stack td:first-child{{font-weight:600}}
table.stack td[data-label]::before{{content:attr(data-label) " ";color:var(--muted)}}}}
details{{margin:4px 0}}summary{{cursor:pointer}}
pre{{white-space:pre-wrap;overflow-wrap:anywhere;background:var(--panel);border:1px solid var(--line);border-radius:4px;
padding:8px;margin:4px 0;font-size:12.5px;max-height:24em;overflow:auto}}
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


# ---- charts ------------------------------------------------------------------------------------

#: (width, height per unit) in inches of a chart drawn for a phone (about 370 px wide) and for a wide
#: screen; text is 10 pt in both, so it shows at about 13 px on a phone and 14 px on a wide screen.
PHONE_IN, SCREEN_FULL_IN, SCREEN_HALF_IN = 3.9, 10.5, 5.4


def _matplotlib():
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the status page draws its charts with matplotlib: pip install '.[status]'") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ink = _PLACEHOLDER["ink"]
    # Glyphs as paths (no font needed to view it) and stable ids (a re-render of one view is identical).
    matplotlib.rcParams.update({
        "svg.fonttype": "path", "svg.hashsalt": "status", "font.size": 10, "text.color": ink, "axes.labelcolor": ink,
        "axes.edgecolor": _PLACEHOLDER["muted"], "xtick.color": ink, "ytick.color": ink, "axes.titlesize": 11,
        "axes.titleweight": "bold", "grid.color": _PLACEHOLDER["line"], "axes.spines.top": False, "axes.spines.right": False,
    })  # fmt: skip
    return plt


def _svg(fig, scope: str, title: str, tight: bool = True) -> str:
    """The figure as inline SVG: placeholder colours become CSS variables, ids get `scope` as a
    prefix (several drawings share one page), and its size follows its container. `tight` crops it
    to what is drawn; without it the figure keeps the size it was drawn at (charts side by side)."""
    import matplotlib.pyplot as plt

    out = io.StringIO()
    fig.savefig(out, format="svg", bbox_inches="tight" if tight else None, transparent=True, metadata={"Date": None})
    plt.close(fig)
    text = out.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text, flags=re.S)
    for role, colour in _PLACEHOLDER.items():
        text = text.replace(colour, f"var(--{role})")
    ids = set(re.findall(r'\bid="([^"]+)"', text))
    text = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{scope}-{m.group(1)}"', text)
    text = re.sub(r'(href="#|url\(#)([^")]+)', lambda m: m.group(1) + (f"{scope}-{m.group(2)}" if m.group(2) in ids else m.group(2)), text)
    # width/height in pt would fix its size; the viewBox keeps its shape at any width.
    text = re.sub(r'<svg ([^>]*?)width="[^"]*" height="[^"]*"', r'<svg \1role="img" aria-label="' + html.escape(title) + '"', text, count=1)
    return text


def _both(name: str, draw, title: str, half: bool = False) -> str:
    """A figure holding the chart drawn for a phone and for a wide screen; CSS shows one. A `half`
    chart keeps the size it is drawn at, so two drawn at one size stand equally high side by side."""
    wide = SCREEN_HALF_IN if half else SCREEN_FULL_IN
    return (f"<figure class='chart{' half' if half else ' full'}' id='chart-{name}'>"
            f"<div class='phone'>{_svg(draw(PHONE_IN, True), f'{name}-phone', title, tight=not half)}</div>"
            f"<div class='screen'>{_svg(draw(wide, False), f'{name}-screen', title, tight=not half)}</div></figure>")  # fmt: skip


def _axis_numbers():
    """A formatter for a numeric axis, one form on every chart: thousands grouped (`6,000`), and as
    many decimals as the ticks' step needs (`0.02`), the same for every tick of the axis."""
    import matplotlib.ticker as mticker

    class AxisNumbers(mticker.Formatter):
        def __call__(self, x, pos=None):
            return self.format_ticks([x])[0]

        def format_ticks(self, values):
            digits = next((d for d in range(7) if all(abs(v - round(v, d)) <= 1e-9 * max(1.0, abs(v)) for v in values)), 6)
            return [f"{v:,.{digits}f}" for v in values]

    return AxisNumbers()


def _time_ticks(span_s: float):
    """A formatter for a UTC time axis: `HH:MM` (`HH:MM:SS` over a few minutes), with the date
    (`Nov 24`) on the first tick and wherever the day changes."""
    import matplotlib.dates as mdates
    import matplotlib.ticker as mticker

    clock = "%H:%M:%S" if span_s < 300 else "%H:%M"

    class TimeTicks(mticker.Formatter):
        def __call__(self, x, pos=None):
            return self.format_ticks([x])[0]

        def format_ticks(self, values):
            labels, day = [], None
            for value in values:
                at = mdates.num2date(value, tz=dt.timezone.utc)
                labels.append(at.strftime(clock if at.date() == day else f"%b %d\n{clock}"))
                day = at.date()
            return labels

    return TimeTicks()


def completion_chart(view: Mapping) -> str | None:
    curve = view.get("curve")
    if not curve:
        return None
    plt = _matplotlib()
    import matplotlib.dates as mdates
    import matplotlib.ticker as mticker

    start = dt.datetime.fromisoformat(curve["start"])
    times = [start + dt.timedelta(seconds=s) for s, _ in curve["points"]]
    done = [n for _, n in curve["points"]]
    span_s = curve["points"][-1][0] if curve["points"] else 0.0
    title = "Tasks done over time"

    def draw(width: float, phone: bool):
        fig, ax = plt.subplots(figsize=(width, 2.9 if phone else 3.1))
        ax.plot(times, done, color=_PLACEHOLDER["s-working"], lw=2.2, label="done")
        ax.axhline(view["total"], color=_PLACEHOLDER["muted"], ls="--", lw=1.2, label=f"total {view['total']:,}")
        ax.set_ylim(0, max(view["total"], 1) * 1.08)
        ax.yaxis.set_major_formatter(_axis_numbers())
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.grid(axis="y", lw=0.6)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a span AutoDateLocator has no interval for
            # Ticks a whole second apart at least: the labels show no fractions (a run of seconds
            # would otherwise get ticks every 0.2 s, labelled 08:05:17, 08:05:17, ...).
            # (AutoDateLocator goes finer than seconds when the span holds fewer whole seconds than minticks.)
            least = max(1, min(3 if phone else 6, int(span_s)))
            ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=least, maxticks=5 if phone else 12))
        ax.xaxis.set_major_formatter(_time_ticks(span_s))
        end = times[-1] if times else start
        ax.set_xlabel(f"UTC, {start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M}")
        ax.set_ylabel("tasks done")
        ax.set_title(title, loc="left")
        ax.legend(loc="lower right", frameon=False)
        return fig

    return _both("completion", draw, title)


def _hbars(labels: list[str], values: list[float], colours: list[str], texts: list[str], title: str, xlabel: str,
           name: str, integer: bool = False, rows: int = 0):
    """Horizontal bars, a half-width chart; `rows`: the bars its height is drawn for (at least the
    labels'), the most of the charts beside it, so they are drawn at one size."""
    plt = _matplotlib()

    def draw(width: float, phone: bool):
        fig, ax = plt.subplots(figsize=(width, 0.9 + 0.36 * max(len(labels), rows, 2)), layout="constrained")
        ax.barh(labels, values, color=colours, height=0.66)
        top = max(values) if values and max(values) > 0 else 1
        for y, text in enumerate(texts):
            ax.text(values[y] + top * 0.01, y, f" {text}", va="center")
        ax.set_xlim(0, top * (1.32 if phone else 1.2))
        if integer:
            ax.xaxis.get_major_locator().set_params(integer=True)
        ax.xaxis.set_major_formatter(_axis_numbers())
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        ax.set_title(title, loc="left")
        ax.grid(axis="x", lw=0.6)
        ax.set_axisbelow(True)
        return fig

    return _both(name, draw, title, half=True)


def machines_chart(fleet: Mapping, rows: int = 0) -> str | None:
    by_state = fleet.get("by_state") or {}
    if not by_state:
        return None
    states = list(by_state)
    counts = [by_state[s] for s in states]
    return _hbars(states, counts, [_PLACEHOLDER.get(f"s-{s}", _PLACEHOLDER["s-unknown"]) for s in states],
                  [f"{n:,}" for n in counts], "Machines by state", "machines", "machines", integer=True, rows=rows)  # fmt: skip


def cost_chart(cost: Mapping, rows: int = 0) -> str | None:
    if not cost["total_seconds"]:
        return None
    dollars = [cost["dollars"][s] for s in COST_STATES]
    return _hbars(list(COST_STATES), dollars, [_PLACEHOLDER[f"s-{s}"] for s in COST_STATES],
                  [f"${d:,.2f}" for d in dollars], "Cost so far by machine state", "US dollars", "cost", rows=rows)  # fmt: skip


# ---- sections ----------------------------------------------------------------------------------


def _states_list(page: _Page, path: str, by_state: Mapping[str, int]) -> str:
    items = "".join(f"<li style='--c:var(--s-{html.escape(s)})'>{html.escape(s)} {page.value(f'{path}.{s}')}</li>"
                    for s in by_state)  # fmt: skip
    return f"<ul class='states'>{items}</ul>"


def _table(table_id: str, head: list[str], rows: list[str], numeric: set[int] = frozenset(), stack: bool = False,
           cls: str = "") -> str:
    """A table that scrolls inside itself when it is wider than the page; `stack`: on a phone each
    row is a line of text instead, its figures named by their cells' `data-label`."""
    cells = "".join(f"<th{' class=n' if k in numeric else ''}>{h}</th>" for k, h in enumerate(head))
    if stack:  # a space between cells: where a stacked row, its cells inline, may break into lines
        rows = [row.replace("</td><td", "</td> <td") for row in rows]
    classes = " ".join(c for c in (cls, "stack" if stack else "") if c)
    attr = f" class='{classes}'" if classes else ""
    return (f"<div class='scroll'><table id='{table_id}'{attr}><thead><tr>{cells}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>")  # fmt: skip


def _progress(page: _Page, view: Mapping) -> None:
    total = view["total"] or 1
    pct = 100 * view["done"] / total
    page.add("<h2>Progress</h2>")
    page.add(f"<div class='bar' role='img' aria-label='{pct:.1f}% done'><span style='width:{pct:.2f}%'></span></div>")
    cards = [("done", "done"), ("total", "total"), ("pending", "pending"), ("leased", "leased"), ("stale", "stale"),
             ("failed", "failed")]  # fmt: skip
    page.add("<div class='cards'>" + "".join(
        f"<div class='card'><div class='v'>{page.value(k)}</div><div class='l'>{label}</div></div>" for k, label in cards
    ) + "</div>")  # fmt: skip
    page.add(f"<p>{_eta_html(page, view)}</p>")
    rate = view.get("tasks_per_s")
    median = view.get("median_task_s")
    rate_html = page.value("tasks_per_s", f"{rate * 60:,.1f} tasks/min") if rate else "no recent completions"
    page.add(f"<p class='muted'>Rate {rate_html} over the last {page.value('recent_done')} completions "
             f"({view['rate_window_s'] / 60:.0f} min window)"
             + (f" &middot; median task {page.value('median_task_s', duration_text(median))}" if median is not None else "")
             + f" &middot; {pct:.1f}% done</p>")  # fmt: skip


def _eta_html(page: _Page, view: Mapping) -> str:
    """The ETA, which is the measured rate's; beside it the machines up running the median task back
    to back, and why the two differ when they are far apart (reporting.status.with_fleet_size)."""
    if view["complete"] and view["failed"]:
        return (f"ETA <b class='warn'>finished with {view['failed']:,} dead letter{'s' if view['failed'] != 1 else ''}"
                f"</b>: {view['done']:,} done")  # fmt: skip
    if view["complete"]:
        return "ETA <b>complete</b>: every task has a done or failed marker"
    if view.get("workers_up") == 0:
        return "ETA <b class='warn'>never: no machine is up</b>"
    eta, span = view.get("eta_s"), view.get("eta_range_s")
    text = "ETA <b>" + page.value("eta_s", duration_text(eta) if eta is not None else "unknown") + "</b>"
    if span:
        text += (f" (range {page.value('eta_range_s.0', duration_text(span[0]))} to "
                 f"{page.value('eta_range_s.1', duration_text(span[1]))})")  # fmt: skip
    text += " at the measured rate" if eta is not None else ": no measured rate yet"
    if view.get("workers_up") is not None:
        text += f" with the {page.value('workers_up')} machines up now"
        changed = view.get("fleet_changed")
        if changed:
            before = page.value("fleet_changed.from", f"{changed['from']:g}")
            old_eta = page.value("fleet_changed.eta_at_recent_rate_s", duration_text(changed["eta_at_recent_rate_s"]))
            text += (f"; <span class='warn'>the fleet changed: the rate was measured with {before} machines on "
                     f"average</span> (at that rate: {old_eta})")  # fmt: skip
        if view.get("eta_fleet_s") is not None:
            median = page.value("median_task_s", duration_text(view["median_task_s"]))
            text += (f". Running the {median} median task back to back, they would take "
                     f"{page.value('eta_fleet_s', duration_text(view['eta_fleet_s']))}")  # fmt: skip
            why = eta_gap_text(view)
            if why:
                text += f"; {html.escape(why)}"
    return text + "."


def _machines(page: _Page, view: Mapping, fleet: Mapping) -> None:
    page.add("<h2>Machines</h2>")
    if not fleet.get("machines"):
        page.add("<p class='muted'>No machine records yet: machines write <code>machines/&lt;name&gt;.json</code> as they boot "
                 "and work (local workers write none).</p>")  # fmt: skip
        return
    cost = fleet.get("cost") or {}
    burn = (f" &middot; burning ${page.value('fleet.cost.burn_per_hour', digits=2)}/h" if cost else "")
    page.add(f"<p><b>{page.value('fleet.workers_up')}</b> of {page.value('fleet.machines')} machines up{burn} "
             "<span class='muted'>(a TPU slice counts once)</span></p>")  # fmt: skip
    page.add(_states_list(page, "fleet.by_state", fleet["by_state"]))
    if len(fleet["by_type"]) > 1 or any(set(g["by_state"]) != set(fleet["by_state"]) for g in fleet["by_type"]):
        rows = [f"<tr><td class='id'>{html.escape(g['machine_type'])}</td><td>{html.escape(g['provisioning'])}</td>"
                f"<td class='n' data-label='machines'>{page.value(f'fleet.by_type.{k}.machines')}</td>"
                f"<td>{html.escape(', '.join(f'{s} {n:,}' for s, n in g['by_state'].items()))}</td></tr>"
                for k, g in enumerate(fleet["by_type"])]  # fmt: skip
        page.add(_table("machines-by-type", ["type", "provisioning", "machines", "states"], rows, {2}, stack=True))
    page.add(f"<p class='muted'>A worker missing its beat for {fleet['silent_after_s']:.0f} s is silent and for "
             f"{fleet['lost_after_s']:.0f} s lost (boot records: {fleet['boot_lost_after_s'] / 60:.0f} min); "
             "neither counts as up, burns money here, or carries the ETA. Each is priced until it is declared lost, "
             f"and a <code>deleting</code> machine counts as exited after {fleet['deleting_gone_s'] / 60:.0f} min.</p>")  # fmt: skip


def _attention(page: _Page, fleet: Mapping) -> None:
    from reporting.fleetview import attention_line

    page.add("<h2>Needs attention</h2>")
    attention = fleet.get("attention") or []
    stale = page.view.get("stale_leases") or []
    if not attention and not stale:
        page.add("<p class='muted'>Nothing: no machine is silent, lost, failed or straggling, and no lease is stale."
                 if fleet.get("machines") else "<p class='muted'>No machine records yet; no stale lease.</p>")  # fmt: skip
    if attention:
        kinds = collections.Counter(a["condition"] for a in attention)
        page.add("<p>" + ", ".join(f"{html.escape(k)} {n:,}" for k, n in kinds.items()) + "</p>")
        rows = [f"<tr><td class='id'><code>{html.escape(a['machine'])}</code></td><td>{html.escape(a['condition'])}</td>"
                f"<td class='id'>{html.escape(a['machine_type'] or '?')}</td><td>{html.escape(attention_line(a))}</td></tr>"
                for a in attention[:PAGE_ROWS]]  # fmt: skip
        page.add(_table("attention", ["machine", "condition", "type", "what"], rows, stack=True))
        if len(attention) > PAGE_ROWS:
            page.add(f"<p class='muted'>{len(attention) - PAGE_ROWS:,} more not shown: "
                     "<code>tools/status.py QUEUE --machines</code> lists them all.</p>")  # fmt: skip
    if stale:
        rows = [f"<tr><td class='id'><code>{html.escape(s['task'])}</code></td><td>{html.escape(s['worker'])}</td>"
                f"<td class='n' data-label='silent'>{s['silent_s']:,.0f} s</td></tr>" for s in stale[:PAGE_ROWS]]  # fmt: skip
        page.add("<h3>Stale leases</h3>" + _table("stale-leases", ["task", "held by", "silent"], rows, {2}, stack=True))


def _cost(page: _Page, view: Mapping, cost: Mapping | None) -> None:
    page.add("<h2>Cost</h2>")
    if not cost or not view["fleet"].get("machines"):
        page.add("<p class='muted'>No machine records yet, so no machine time to price.</p>")
        return
    finish = view.get("finish") or {}
    waste = cost["waste_dollars"]
    waste_html = (f"waste ${page.value('fleet.cost.waste_dollars', digits=2)} "
                  f"({page.value('fleet.cost.waste_seconds', hours_text(cost['waste_seconds']))} machine-hours of boot, "
                  "install, idle and failed boots)")  # fmt: skip
    page.add(f"<p>So far <b>${page.value('fleet.cost.total_dollars', digits=2)}</b> over "
             f"{page.value('fleet.cost.total_seconds', hours_text(cost['total_seconds']))} machine-hours; "
             + (f"<span class='warn'>{waste_html}</span>" if waste > 0 else waste_html)
             + f". Burning ${page.value('fleet.cost.burn_per_hour', digits=2)}/h now.</p>")  # fmt: skip
    if view["complete"]:
        up = view["fleet"].get("workers_up", 0)
        still_up = f"; <span class='warn'>{up:,} machine{'s' if up != 1 else ''} still up</span>" if up else ""
        page.add(f"<p>The queue is complete{still_up}.</p>")
    elif finish.get("dollars") is not None:
        high = finish["dollars_range"][1]
        page.add(f"<p>To finish: <b>${page.value('finish.dollars', digits=2)}</b> (range "
                 f"${page.value('finish.dollars_range.0', digits=2)} to "
                 + (f"${page.value('finish.dollars_range.1', digits=2)}" if high is not None else "unbounded")
                 + f"), projected total ${page.value('finish.projected_total_dollars', digits=2)}.</p>")  # fmt: skip
    else:
        page.add("<p>To finish: unknown until tasks complete at a measurable rate.</p>")
    if finish.get("dollars_per_task") is not None:
        page.add(f"<p class='muted'>${page.value('finish.dollars_per_task', digits=4)} per finished task so far.</p>")
    if cost["total_seconds"]:
        rows = [f"<tr><td>{s}</td><td class='n'>{page.value(f'fleet.cost.seconds.{s}', hours_text(cost['seconds'][s]))}</td>"
                f"<td class='n'>${page.value(f'fleet.cost.dollars.{s}', digits=2)}</td></tr>" for s in COST_STATES]  # fmt: skip
        page.add(_table("cost-by-state", ["state", "machine-hours", "dollars"], rows, {1, 2}))
    if cost["by_type"]:
        rows = [f"<tr><td class='id'>{html.escape(g['machine_type'])}</td><td>{html.escape(g['provisioning'])}</td>"
                f"<td class='n' data-label='machines'>{g['machines']:,}</td>"
                f"<td class='n' data-label='per hour'>${g['per_hour']:,.2f}</td>"
                f"<td class='n' data-label='so far'>${sum(g['dollars'].values()):,.2f}</td></tr>" for g in cost["by_type"]]  # fmt: skip
        page.add(_table("cost-by-type", ["type", "provisioning", "machines", "per hour", "so far"], rows, {2, 3, 4}, stack=True))
    else:
        page.add("<p class='muted'>No priced machine time yet.</p>")
    for machine_type, seconds in cost["unpriced_seconds"].items():
        page.add(f"<p class='warn'>{html.escape(machine_type)}: {hours_text(seconds)} machine-hours, not in the price table "
                 "(reporting/prices.json): not counted.</p>")  # fmt: skip
    page.add(f"<p class='muted'>List prices of {html.escape(prices_text(cost['prices']))} (reporting/prices.json). Not included: "
             f"{html.escape(cost['not_included'])}.</p>")  # fmt: skip


def _goodput(page: _Page, view: Mapping) -> None:
    """One line under the cost: the share of the consumers' time in the forward pass (reporting/goodput.py)."""
    goodput = view.get("goodput")
    if not goodput:
        return
    dollars = (f"; about ${page.value('goodput.fixed_dollars', digits=2)} of the "
               f"${page.value('goodput.working_dollars', digits=2)} working" if "fixed_dollars" in goodput else "")  # fmt: skip
    share = f"{goodput['goodput']:.1%}"
    page.add(f"<p>Goodput <b>{page.value('goodput.goodput', share)}</b> of the consumers' time "
             f"in the steady forward; start-up and tail {page.value('goodput.fixed_s_per_attempt', digits=1)} s "
             f"a task over {page.value('goodput.attempts')} attempts{dollars}.</p>")  # fmt: skip


def _failures(page: _Page, view: Mapping, fleet: Mapping) -> None:
    page.add("<h2>Failures</h2>")
    failures = fleet.get("failures") or {}
    reasons = view.get("failed_reasons", {})
    if not failures and not view["failed"]:
        page.add("<p class='muted'>None.</p>")
        return
    tails = fleet.get("log_tails") or {}
    for reason, names in failures.items():
        listed = ", ".join(names[:NAMES_PER_REASON]) + (f" and {len(names) - NAMES_PER_REASON:,} more" if len(names) > NAMES_PER_REASON else "")
        page.add(f"<h3>{len(names):,} machine{'s' if len(names) != 1 else ''} failed: {html.escape(reason)}</h3>"
                 f"<p><code>{html.escape(listed)}</code></p>")  # fmt: skip
        for name in names:
            if name in tails:
                page.add(f"<details class='log-tail'><summary>log tail of <code>{html.escape(name)}</code></summary>"
                         f"<pre>{html.escape(tails[name])}</pre></details>")  # fmt: skip
    if view["failed"]:
        groups, unknown = dead_letter_groups(view)
        page.add(f"<h3>{page.value('failed')} dead letter{'s' if view['failed'] != 1 else ''}</h3>")
        if unknown:
            page.add(f"<p class='muted'>{unknown:,} of them are older than the reason in the listing and were not "
                     f"among the {len(reasons):,} read: their reasons are not known here.</p>")  # fmt: skip
        for k, (reason, count, tasks) in enumerate(groups):
            rows = [f"<tr><td class='id'><code>{html.escape(t)}</code></td><td>{html.escape(detail_text(view, t))}</td></tr>"
                    for t in tasks]  # fmt: skip
            shown = f" (the first lines of {len(tasks):,} read)" if 0 < len(tasks) < count else ""
            page.add(f"<p><b>{html.escape(reason)}</b>: {count:,}{shown}</p>")
            if rows:
                page.add(_table(f"dead-letters-{k}", ["task", "first line"], rows, stack=True, cls="dead-letters"))


def _counters(page: _Page, view: Mapping) -> None:
    """Skipped rows and the other counters, only those above zero: nothing to report says nothing."""
    counters = reported_counters(view)
    if "skipped_rows" in counters:
        page.add("<h2>Skipped rows</h2>")
        page.add(f"<p>{page.value('counters.skipped_rows')} rows skipped</p>")
    others = {k: v for k, v in counters.items() if k != "skipped_rows"}
    if others:
        page.add("<h2>Counted</h2><p class='muted'>"
                 + ", ".join(f"{html.escape(k)} {page.value(f'counters.{k}')}" for k in others) + "</p>")  # fmt: skip


def render_html(view: Mapping, generated: dt.datetime | None = None) -> str:
    """The page for `view` (tools/status.py's --json object: the queue's snapshot with `fleet` and `finish`)."""
    generated = (generated or dt.datetime.now(dt.timezone.utc)).astimezone(dt.timezone.utc)
    page = _Page(view)
    page.add(f"<h1>Queue status</h1><p class='sub'><code>{html.escape(view['queue'])}</code> &middot; "
             f"{'estimate' if view['estimate'] else 'exact'} &middot; as of {generated:%Y-%m-%d %H:%M:%S} UTC "
             f"&middot; {page.value('requests')} requests</p>")  # fmt: skip
    _progress(page, view)
    fleet = view.get("fleet") or {}
    cost = fleet.get("cost")
    rows = max(len(fleet.get("by_state") or {}), len(COST_STATES))  # the two bar charts side by side: one height
    charts = [completion_chart(view), machines_chart(fleet, rows), cost_chart(cost, rows) if cost else None]
    if any(charts):
        page.add("<div class='charts'>" + "".join(c for c in charts if c) + "</div>")
    _machines(page, view, fleet)
    _attention(page, fleet)
    _cost(page, view, cost)
    _goodput(page, view)
    _failures(page, view, fleet)
    _counters(page, view)
    body = "\n".join(page.parts)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'><meta name='color-scheme' content='light dark'>"
        f"<title>status {html.escape(view['queue'])}</title><style>{_style()}</style></head>\n<body>\n{body}\n</body></html>\n"
    )

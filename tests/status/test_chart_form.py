"""The charts' numbers and sizes, one form across the page: axis numbers group thousands and carry
the decimals their step needs on every chart ("1200" beside "6,000" was the defect), and the two
bar charts side by side are drawn at one size, so they stand equally high (they were not). The
SVG carries each text's string as a comment beside its glyph paths, which is what is read here."""

from __future__ import annotations

import datetime as dt
import re

from reporting.page import completion_chart, cost_chart, machines_chart, render_html

NUMBER = re.compile(r"-?[\d,.]+")


def axis_labels(svg: str, drawing: str, axis: str) -> list[str]:
    """The numeric tick labels of one axis ('x' or 'y') of one drawing ('phone' or 'screen')."""
    part = svg[svg.index(f"<div class='{drawing}'>") :]
    part = part[: part.index("</div>")]
    ticks = re.findall(rf'<g id="[\w-]+-{axis}tick_\d+">(.*?)</g>\s*</g>\s*</g>', part, flags=re.S)
    return [t for block in ticks for t in re.findall(r"<!-- (.*?) -->", block) if NUMBER.fullmatch(t)]


def one_form(labels: list[str]) -> bool:
    """Thousands grouped, and every label with the same number of decimals."""
    grouped = all(re.fullmatch(r"-?\d{1,3}(,\d{3})*(\.\d+)?", label) for label in labels)
    return grouped and len({len(label.partition(".")[2]) for label in labels}) == 1


def test_axis_numbers_group_thousands_and_keep_one_form_on_every_chart():
    start = dt.datetime(2026, 11, 24, 8, tzinfo=dt.timezone.utc)
    curve = {"start": start.isoformat(), "points": [[s, s * 2] for s in range(0, 3001, 100)]}
    charts = {
        "completion": (completion_chart({"total": 6000, "curve": curve}), "y"),
        "machines": (machines_chart({"by_state": {"working": 1200, "idle": 6000, "lost": 3}}), "x"),
        "cost": (cost_chart({"total_seconds": 10.0, "dollars": {"booting": 0.01, "installing": 0.025, "working": 0.05,
                                                                 "idle": 0.0, "failed": 0.0}}), "x"),  # fmt: skip
    }
    for name, (svg, axis) in charts.items():
        for drawing in ("phone", "screen"):
            labels = axis_labels(svg, drawing, axis)
            assert len(labels) >= 3 and one_form(labels), (name, drawing, labels)
    assert "6,000" in axis_labels(charts["machines"][0], "screen", "x")
    assert all("." in label for label in axis_labels(charts["cost"][0], "screen", "x"))  # dollars under 1: decimals


def view_box(svg: str, drawing: str) -> tuple[float, float]:
    part = svg[svg.index(f"<div class='{drawing}'>") :]
    _, _, width, height = map(float, re.search(r'viewBox="([^"]+)"', part).group(1).split())
    return width, height


def test_the_bar_charts_side_by_side_are_drawn_at_one_size():
    """Five machine states beside the five cost states, then eight beside five: each pair is drawn at
    one size (a viewBox of one shape renders at one height in columns of one width)."""
    cost = {"total_seconds": 100.0, "seconds": {}, "dollars": {"booting": 0.5, "installing": 1.25, "working": 3.0,
                                                                "idle": 0.25, "failed": 0.0}}  # fmt: skip
    for by_state in ({"idle": 2, "silent": 1, "lost": 1, "failed": 1, "preempted": 1},
                     {s: 1 for s in ("booting", "installing", "working", "idle", "silent", "lost", "failed", "deleting")}):  # fmt: skip
        page = render_html(minimal_view(by_state, cost))
        machines = page[page.index("id='chart-machines'") :]
        costs = page[page.index("id='chart-cost'") :]
        for drawing in ("phone", "screen"):
            assert view_box(machines, drawing) == view_box(costs, drawing), (by_state, drawing)


def minimal_view(by_state: dict, cost: dict) -> dict:
    """A status view with a fleet and its cost and nothing else, as render_html reads it."""
    fleet = {"machines": sum(by_state.values()), "by_state": by_state, "by_type": [], "workers_up": 0, "attention": [],
             "failures": {}, "silent_after_s": 90.0, "lost_after_s": 180.0, "boot_lost_after_s": 1800.0,
             "deleting_gone_s": 900.0,
             "cost": {**cost, "waste_dollars": 0.0, "waste_seconds": 0.0, "total_dollars": 5.0, "burn_per_hour": 0.0,
                      "by_type": [], "unpriced_seconds": {}, "prices": {"as_of": "2026-11-27"}, "not_included": "x",
                      "seconds": {s: 20.0 for s in ("booting", "installing", "working", "idle", "failed")}}}  # fmt: skip
    return {"queue": "q", "estimate": False, "requests": 1, "total": 1, "done": 0, "pending": 1, "leased": 0, "stale": 0,
            "failed": 0, "complete": False, "rate_window_s": 600.0, "recent_done": 0, "tasks_per_s": None,
            "median_task_s": None, "eta_s": None, "eta_range_s": None, "curve": None, "fleet": fleet, "finish": {},
            "failed_reasons": {}, "failed_details": {}, "counters": {}}  # fmt: skip

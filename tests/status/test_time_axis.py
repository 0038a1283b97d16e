"""The completion chart's time axis: full width, its ticks read as times, with the date on the first
tick and wherever the day changes (the old axis read like "24 08:05"). matplotlib writes each
text's string as a comment beside its glyph paths, which is what these tests read."""

from __future__ import annotations

import datetime as dt
import re

from reporting.page import completion_chart

START = dt.datetime(2026, 11, 24, 22, 30, tzinfo=dt.timezone.utc)


def tick_labels(svg: str, drawing: str) -> list[str]:
    """The x tick labels of one drawing ('phone' or 'screen'), each's lines joined by ' / '."""
    scope = f"completion-{drawing}"
    labels = []
    for ticks in re.findall(rf'<g id="{scope}-xtick_\d+">(.*?)(?=<g id="{scope}-(?:xtick_|matplotlib\.axis))', svg, flags=re.S):
        texts = re.findall(r"<!-- (.*?) -->", ticks)
        labels.append(" / ".join(t for t in texts if not t.startswith("UTC, ")))  # the last tick runs on to the axis label
    return labels


def chart(span_s: int, step_s: int) -> str:
    points = [[s, s // 120] for s in range(0, span_s + 1, step_s)]
    svg = completion_chart({"total": points[-1][1] + 10, "curve": {"start": START.isoformat(), "points": points}})
    assert svg is not None
    return svg


def test_time_ticks_carry_the_date_first_and_where_the_day_changes_and_the_chart_spans_the_page():
    svg = chart(3 * 3600, 600)  # 22:30 on Nov 24 to 01:30 on Nov 25
    assert "<figure class='chart full' id='chart-completion'>" in svg  # the page's width, not half of it
    assert "UTC, 2026-11-24 22:30 to 2026-11-25 01:30" in svg
    for drawing, fewest in (("phone", 3), ("screen", 6)):
        labels = tick_labels(svg, drawing)
        assert len(labels) >= fewest, labels
        assert labels[0].startswith("Nov 24 / "), labels
        assert sum(label.startswith("Nov 25 / 00:00") for label in labels) == 1, labels
        for label in labels:
            assert re.fullmatch(r"(Nov 2[45] / )?\d\d:\d\d", label), label  # never "24 08:05"


def test_a_span_of_minutes_shows_seconds_and_one_date():
    labels = tick_labels(chart(240, 20), "screen")
    assert labels[0].startswith("Nov 24 / 22:30:00"), labels
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d", label) for label in labels[1:]), labels


def test_a_span_of_seconds_ticks_whole_seconds_each_once():
    """A run of a few seconds (the browser test's queue) got ticks 0.2 s apart, labelled
    08:05:17, 08:05:17, 08:05:18, ...: the labels show whole seconds, so the ticks are whole seconds."""
    for drawing in ("phone", "screen"):
        labels = tick_labels(chart(3, 1), drawing)
        assert len(labels) >= 2 and len(set(labels)) == len(labels), labels

"""The status page in a real browser: the distribution's Chromium (/usr/bin/chromium, installed by
`make test`), driven by Selenium through /usr/bin/chromedriver, so nothing is downloaded.

The queue is drained by real spawn.py workers running the queue-test consumer, like `make run`'s
(one task dead-letters with exit 65), then a second batch waits for machines; machine records are
written as a cloud fleet's would be (up, silent, lost, preempted, a failed boot with its log tail).
The page is opened as a phone (390 px, the DevTools protocol's device metrics) and as a wide screen
(1280 px), each in the light and the dark scheme (`Emulation.setEmulatedMedia`), and must in each:
load without console errors, never scroll sideways, follow the scheme, keep every text (chart text
included) at a WCAG contrast of 4.5:1 or more with what is behind it, draw chart text at least 8 px
high, give every machine condition a colour at a CIEDE2000 difference of 20 or more from every
other's (as the browser resolves them), stand the charts side by side equally high, say nothing of
rows skipped when none were, and show exactly the numbers `status --json` prints for the same moment.
STATUS_PAGE_SCREENSHOTS=1 refreshes the screenshots README.md shows (docs/status-page-*.png).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import itertools
import math
import os
import statistics
from pathlib import Path

import pytest

from fleet import machines
from objectstore import open_store
from reporting.machinestate import CONDITIONS
from tests.queue.conftest import submit_tasks
from tests.workers import Workers
from tools import status as status_tool

REPO = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
LOG_TAIL = "Collecting jax[tpu]\nERROR: Could not find a version that satisfies the requirement libtpu\nexit 1 at line 300"
SCREENS = {"phone": 390, "wide": 1280}

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()), reason="no /usr/bin/chromium: `make test` installs it (apt)"
)


def status(url: str, now: dt.datetime, *args: str) -> str:
    """What `tools/status.py URL --now NOW ARGS` prints (run in this process: the imports are paid once)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert status_tool.main([url, "--now", now.isoformat(), *args]) == 0
    return out.getvalue()


def fleet_queue(url: str, logs: Path) -> None:
    """16 tasks done and one dead letter by real workers, 8 more waiting; a fleet of six machines."""
    manifests = [{"id": f"doc-{k:03d}", "sleep": 0.05} for k in range(16)] + [{"id": "doc-bad", "exit": 65}]
    submit_tasks(url, manifests)
    logs.mkdir()
    workers = Workers(url, logs)
    workers.start("local-0", "--idle-timeout", "1")
    workers.start("local-1", "--idle-timeout", "1")
    workers.wait(timeout=60)
    submit_tasks(url, [{"id": f"late-{k:03d}"} for k in range(8)])
    store = open_store(url)
    now = dt.datetime.now(dt.timezone.utc)
    ago = lambda s: now - dt.timedelta(seconds=s)  # noqa: E731
    for name, state, at, machine_type, provisioning, spent, fields in [
        ("vm-a", "idle", now, "g2-standard-8", "spot", {"booting": 45, "installing": 150, "working": 40}, {}),
        ("vm-b", "idle", now, "g2-standard-8", "standard", {"booting": 50, "installing": 170, "working": 30, "idle": 5}, {}),
        ("vm-c", "failed", now, "n2-standard-8", "spot", {"booting": 40, "installing": 90},
         {"reason": "install_failed: exit 1 at line 300", "log_tail": LOG_TAIL}),
        ("vm-d", "working", ago(120), "g2-standard-8", "spot", {"booting": 40, "installing": 90}, {"task": "doc-003"}),
        ("vm-e", "working", ago(900), "g2-standard-8", "spot", {"booting": 40, "installing": 90}, {"task": "doc-007"}),
        ("vm-f", "exited", ago(30), "g2-standard-8", "spot", {"booting": 40, "installing": 90, "working": 60},
         {"reason": "preempted"}),
    ]:  # fmt: skip
        body = machines.make_record(name, state, at=at, since=at.isoformat(timespec="seconds"), spent=spent, beat_s=60.0,
                                    machine_type=machine_type, provisioning=provisioning, accelerator="gpu", **fields)  # fmt: skip
        machines.write_record(store, body)


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> tuple[Path, dict]:
    """The page and the --json view of one queue at one moment."""
    tmp = tmp_path_factory.mktemp("page")
    url = str(tmp / "queue")
    fleet_queue(url, tmp / "logs")
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    view = json.loads(status(url, now, "--json", "--history"))  # the page lists what --history does
    path = tmp / "status.html"
    status(url, now, "--html", str(path))
    return path, view


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    yield driver
    driver.quit()


def show(driver, uri: str, width: int, scheme: str, height: int = 900) -> None:
    """Open `uri` as a screen `width` CSS px wide (a phone below 700: mobile viewport rules apply) in `scheme`."""
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": scheme}]})
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 700})  # fmt: skip
    driver.get(uri)


def luminance(rgb: tuple[float, float, float]) -> float:
    """WCAG 2.x relative luminance of an sRGB colour (0-255 channels)."""

    def linear(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a, b) -> float:
    la, lb = sorted((luminance(a), luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def lab(rgb: tuple[float, float, float]) -> tuple[float, float, float]:
    """CIELAB (D65) of an sRGB colour (0-255 channels)."""

    def linear(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in rgb)
    xyz = ((0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047, 0.2126 * r + 0.7152 * g + 0.0722 * b,
           (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883)  # fmt: skip
    fx, fy, fz = (t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116 for t in xyz)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def delta_e2000(c1, c2) -> float:
    """The CIEDE2000 colour difference of two CIELAB colours (Sharma, Wu and Dalal, 2005)."""
    (l1, a1, b1), (l2, a2, b2) = c1, c2
    c_mean = (math.hypot(a1, b1) + math.hypot(a2, b2)) / 2
    g = 0.5 * (1 - math.sqrt(c_mean**7 / (c_mean**7 + 25**7)))
    a1, a2 = (1 + g) * a1, (1 + g) * a2
    c1p, c2p = math.hypot(a1, b1), math.hypot(a2, b2)
    h1, h2 = (math.degrees(math.atan2(b, a)) % 360 for a, b in ((a1, b1), (a2, b2)))
    dh = 0.0 if c1p * c2p == 0 else (h2 - h1 + 180) % 360 - 180
    d_l, d_c, d_h = l2 - l1, c2p - c1p, 2 * math.sqrt(c1p * c2p) * math.sin(math.radians(dh / 2))
    l_mean, cp_mean = (l1 + l2) / 2, (c1p + c2p) / 2
    if c1p * c2p == 0:
        h_mean = h1 + h2
    elif abs(h1 - h2) <= 180:
        h_mean = (h1 + h2) / 2
    else:
        h_mean = (h1 + h2 + 360) / 2 if h1 + h2 < 360 else (h1 + h2 - 360) / 2
    t = (1 - 0.17 * math.cos(math.radians(h_mean - 30)) + 0.24 * math.cos(math.radians(2 * h_mean))
         + 0.32 * math.cos(math.radians(3 * h_mean + 6)) - 0.20 * math.cos(math.radians(4 * h_mean - 63)))  # fmt: skip
    s_l = 1 + 0.015 * (l_mean - 50) ** 2 / math.sqrt(20 + (l_mean - 50) ** 2)
    s_c, s_h = 1 + 0.045 * cp_mean, 1 + 0.015 * cp_mean * t
    r_t = (-2 * math.sqrt(cp_mean**7 / (cp_mean**7 + 25**7))
           * math.sin(math.radians(60 * math.exp(-(((h_mean - 275) / 25) ** 2)))))  # fmt: skip
    return math.sqrt((d_l / s_l) ** 2 + (d_c / s_c) ** 2 + (d_h / s_h) ** 2 + r_t * (d_c / s_c) * (d_h / s_h))


def test_delta_e2000_matches_the_published_test_data():
    """Pairs from Sharma, Wu and Dalal's CIEDE2000 test data (2005), table 1: pairs 1, 7, 17 and 25."""
    for c1, c2, expected in [((50, 2.6772, -79.7751), (50, 0, -82.7485), 2.0425),
                             ((50, 0, 0), (50, -1, 2), 2.3669),
                             ((50, 2.5, 0), (73, 25, -18), 27.1492),
                             ((60.2574, -34.0099, 36.2677), (60.4626, -34.1751, 39.4387), 1.2644)]:  # fmt: skip
        assert delta_e2000(c1, c2) == pytest.approx(expected, abs=1e-4)


#: The least CIEDE2000 difference between any two conditions' colours: about ten is two shades of
#: one colour (the dark scheme's silent and lost lavenders were 10.4 apart); twenty reads as two colours.
DISTINCT_COLOURS = 20.0


#: For every visible element with text of its own, and every visible chart's text: its colour, the
#: colour behind it (the nearest ancestor's opaque background; a chart is transparent), what it is.
#: Colours come back as [r, g, b, a] from the computed style, whatever syntax the browser uses.
TEXT_COLOURS_JS = """
const probe = document.createElement('canvas').getContext('2d');
function rgba(css) {
  probe.clearRect(0, 0, 1, 1); probe.fillStyle = '#000'; probe.fillStyle = css; probe.fillRect(0, 0, 1, 1);
  const d = probe.getImageData(0, 0, 1, 1).data; return [d[0], d[1], d[2], d[3] / 255];
}
function behind(el) {
  for (let e = el; e; e = e.parentElement) {
    const c = rgba(getComputedStyle(e).backgroundColor);
    if (c[3] > 0.99) return c;
  }
  return [255, 255, 255, 1];  // the canvas of a page that sets no background nor color-scheme
}
const seen = [];
for (const el of document.body.querySelectorAll('*')) {
  if (el.closest('svg') || !el.getClientRects().length) continue;
  const own = [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim());
  if (own) seen.push([rgba(getComputedStyle(el).color), behind(el), el.tagName + ': ' + el.textContent.trim().slice(0, 40)]);
}
for (const g of document.querySelectorAll('svg [id*="text_"] > g')) {
  if (!g.getClientRects().length) continue;
  seen.push([rgba(getComputedStyle(g).fill), behind(g.closest('svg')), 'chart text in ' + g.closest('figure').id]);
}
return seen;
"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
@pytest.mark.parametrize("screen", ["phone", "wide"])
def test_page_fits_the_screen_follows_the_scheme_keeps_contrast_and_shows_the_json_numbers(page, browser, screen, scheme):
    from selenium.webdriver.common.by import By

    path, view = page
    width = SCREENS[screen]
    show(browser, path.as_uri(), width, scheme)
    assert [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "ERROR")] == []

    # No sideways scroll: wide tables scroll inside themselves, long names wrap.
    assert browser.execute_script("return document.documentElement.scrollWidth") <= width
    assert browser.execute_script("return window.innerWidth") == width
    # Nor does any table hide a column on a phone: its rows stack into labelled lines there.
    tables = browser.execute_script("return [...document.querySelectorAll('table')].map(t => [t.id, t.scrollWidth, t.parentElement.clientWidth])")
    assert tables and [t for t in tables if t[1] > t[2]] == []

    # The scheme is followed, and every text stands out from what is behind it (WCAG AA: 4.5:1).
    seen = browser.execute_script(TEXT_COLOURS_JS)
    assert (luminance(seen[0][1][:3]) < 0.05) == (scheme == "dark"), seen[0]
    assert any(what.startswith("chart text") for _, _, what in seen)
    low = [(round(contrast(fg[:3], bg[:3]), 2), what) for fg, bg, what in seen if contrast(fg[:3], bg[:3]) < 4.5]
    assert low == []

    # Every condition's colour, as the browser resolves it in this scheme, stands apart from every other's.
    colours = browser.execute_script(TEXT_COLOURS_JS.split("const seen")[0] + """
        const root = getComputedStyle(document.documentElement);
        return Object.fromEntries(arguments[0].map(c => [c, rgba(root.getPropertyValue('--s-' + c))]));""", list(CONDITIONS))
    assert set(colours) == set(CONDITIONS) and all(c[3] == 1 for c in colours.values())
    differences = {(a, b): delta_e2000(lab(colours[a][:3]), lab(colours[b][:3])) for a, b in itertools.combinations(CONDITIONS, 2)}
    assert min(differences.values()) >= DISTINCT_COLOURS, sorted(differences.items(), key=lambda kv: kv[1])[:3]

    # Each chart shows one drawing, as wide as the column, its text at least 8 px high.
    charts = [svg for svg in browser.find_elements(By.CSS_SELECTOR, "figure.chart svg") if svg.is_displayed()]
    assert len(charts) == 3
    [curve_width] = browser.execute_script("""return [...document.querySelectorAll('#chart-completion svg')]
        .filter(s => s.getClientRects().length).map(s => s.getBoundingClientRect().width)""")
    assert curve_width >= min(width - 40, 1000)  # the time axis spans the page
    # The two bar charts side by side on a wide screen stand equally high, their tops level.
    boxes = browser.execute_script("""return ['machines', 'cost'].map(n => [...document.querySelectorAll('#chart-' + n + ' svg')]
        .filter(s => s.getClientRects().length).map(s => { const r = s.getBoundingClientRect(); return [r.top, r.height]; })[0])""")
    if width >= 1000:
        (top_a, high_a), (top_b, high_b) = boxes
        assert abs(top_a - top_b) < 1 and abs(high_a - high_b) < 1, boxes
    heights = browser.execute_script("""return [...document.querySelectorAll('svg [id*="tick_"] [id*="text_"]')]
        .filter(g => g.getClientRects().length).map(g => g.getBoundingClientRect().height)""")
    assert heights and statistics.median(heights) >= 8, heights

    # The numbers are the --json view's.
    shown = {e.get_attribute("data-key"): e.get_attribute("data-value") for e in browser.find_elements(By.CSS_SELECTOR, "[data-key]")}
    fleet = view["fleet"]
    assert fleet["by_state"] == {"idle": 2, "silent": 1, "lost": 1, "failed": 1, "preempted": 1}
    assert (view["workers_up"], fleet["workers_up"], fleet["machines"]) == (2, 2, 6)
    expected_keys = {"done", "total", "failed", "pending", "workers_up", "fleet.workers_up", "fleet.machines",
                     "fleet.cost.total_dollars", "fleet.cost.waste_dollars", "fleet.cost.burn_per_hour",
                     *(f"fleet.by_state.{s}" for s in fleet["by_state"])}  # fmt: skip
    assert expected_keys <= set(shown)
    for key, value in shown.items():
        expected = view
        for part in key.split("."):
            expected = expected[int(part)] if isinstance(expected, list) else expected[part]
        assert value == str(expected), key
    assert (shown["done"], shown["failed"], shown["total"]) == ("16", "1", "25")

    # Failures: the dead letter's first line, the failed boot's log tail collapsed in <details>.
    assert "exiting with 65 as told" in browser.find_element(By.CSS_SELECTOR, "table.dead-letters").text
    tail = browser.find_element(By.CSS_SELECTOR, "details.log-tail")
    assert tail.get_attribute("open") is None and "libtpu" in tail.find_element(By.TAG_NAME, "pre").get_attribute("textContent")
    # No row was skipped: the page says nothing of it.
    assert view["counters"].get("skipped_rows", 0) == 0 and "skipped" not in browser.find_element(By.TAG_NAME, "body").text

    if os.environ.get("STATUS_PAGE_SCREENSHOTS"):
        height = browser.execute_script("return document.documentElement.scrollHeight")
        show(browser, path.as_uri(), width, scheme, height=height)
        browser.save_screenshot(str(REPO / "docs" / f"status-page-{screen}-{scheme}.png"))

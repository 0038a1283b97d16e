"""The status page in a real browser: the distribution's Chromium (/usr/bin/chromium, installed by
`make test`), driven by Selenium through /usr/bin/chromedriver, so nothing is downloaded.

The queue is drained by real spawn.py workers running the queue-test consumer, like `make run`'s
(one task dead-letters with exit 65); machine records for its two machines are written as a cloud
fleet's would be. The page must load without console errors, show the numbers `status --json`
prints for the same moment, and draw its charts with a non-zero size. It saves a screenshot
(STATUS_PAGE_SCREENSHOT=docs/status-page.png refreshes the one README.md shows).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet import machines
from objectstore import open_store
from tests.queue.conftest import submit_tasks
from tests.workers import Workers

REPO = Path(__file__).resolve().parents[2]
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()), reason="no /usr/bin/chromium: `make test` installs it (apt)"
)


def status(url: str, now: dt.datetime, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "tools/status.py", url, "--now", now.isoformat(), *args],
                         cwd=REPO, capture_output=True, text=True, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def drained_queue(url: str, logs: Path) -> None:
    manifests = [{"id": f"doc-{k:03d}", "sleep": 0.05} for k in range(16)] + [{"id": "doc-bad", "exit": 65}]
    submit_tasks(url, manifests)
    logs.mkdir()
    workers = Workers(url, logs)
    workers.start("local-0", "--idle-timeout", "1")
    workers.start("local-1", "--idle-timeout", "1")
    workers.wait(timeout=60)
    store = open_store(url)
    now = dt.datetime.now(dt.timezone.utc)
    for name, machine_type, provisioning, spent in [
        ("vm-a", "g2-standard-8", "spot", {"booting": 45, "installing": 150, "working": 40}),
        ("vm-b", "g2-standard-8", "standard", {"booting": 50, "installing": 170, "working": 30, "idle": 5}),
        ("vm-c", "g2-standard-8", "spot", {"booting": 40, "installing": 90}),
    ]:
        state = "failed" if name == "vm-c" else "idle"
        body = machines.make_record(name, state, at=now, since=now.isoformat(timespec="seconds"), spent=spent,
                                    machine_type=machine_type, provisioning=provisioning, accelerator="gpu",
                                    reason="install_failed: exit 1 at line 300" if state == "failed" else None)  # fmt: skip
        machines.write_record(store, body)


def test_status_page_loads_cleanly_shows_the_json_numbers_and_draws_its_charts(tmp_path: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    url = str(tmp_path / "queue")
    drained_queue(url, tmp_path / "logs")
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    view = json.loads(status(url, now, "--json", "--history"))  # the page lists what --history does
    page = tmp_path / "status.html"
    status(url, now, "--html", str(page))

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,1900"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    try:
        driver.get(page.as_uri())
        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
        assert errors == []
        shown = {}
        for element in driver.find_elements(By.CSS_SELECTOR, "[data-key]"):
            shown[element.get_attribute("data-key")] = element.get_attribute("data-value")
        assert {"done", "total", "failed", "fleet.cost.total_dollars", "fleet.cost.waste_dollars"} <= set(shown)
        for path, value in shown.items():
            expected = view
            for part in path.split("."):
                expected = expected[int(part)] if isinstance(expected, list) else expected[part]
            assert value == str(expected), path
        assert (shown["done"], shown["failed"], shown["total"]) == ("16", "1", "17")
        charts = driver.find_elements(By.CSS_SELECTOR, "figure.chart svg")
        assert len(charts) == 3
        for chart in charts:
            assert chart.size["width"] > 100 and chart.size["height"] > 50
        assert "exiting with 65 as told" in driver.find_element(By.CSS_SELECTOR, "table.dead-letters").text
        height = driver.execute_script("return document.body.scrollHeight")
        driver.set_window_size(1200, min(max(height + 200, 800), 5000))
        driver.save_screenshot(str(tmp_path / "status-page.png"))
        if os.environ.get("STATUS_PAGE_SCREENSHOT"):
            driver.save_screenshot(str(REPO / os.environ["STATUS_PAGE_SCREENSHOT"]))
    finally:
        driver.quit()
    assert (tmp_path / "status-page.png").stat().st_size > 10_000

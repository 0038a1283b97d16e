"""What one `gcs-spawner up` holds while it runs (`UpState`: the run, its project, queue, record and clients, and what
it has found and done so far), and what it reports (`UpReport`); shared by its checks (gcs_spawner/upcheck.py),
its steps (gcs_spawner/upsteps.py) and its order (gcs_spawner/up.py)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TextIO

from gcs_spawner import checks
from gcs_spawner.cloud import Clients
from gcs_spawner.record import RunRecord
from gcs_spawner.runfile import Run

log = logging.getLogger("gcs_spawner")


@dataclasses.dataclass
class UpReport:
    plan: dict | None = None
    considered: list[dict] = dataclasses.field(default_factory=list)
    steps: list[str] = dataclasses.field(default_factory=list)
    created: list[str] = dataclasses.field(default_factory=list)  # resources this call created
    existed: list[str] = dataclasses.field(default_factory=list)  # resources an earlier up had created
    submitted: dict = dataclasses.field(default_factory=dict)
    would: list[str] = dataclasses.field(default_factory=list)  # dry run: one line per call
    difference: list[str] = dataclasses.field(default_factory=list)  # the changes printed before the question
    deleted: list[str] = dataclasses.field(default_factory=list)  # resources this call deleted (a replace, a count down)
    resized: list[str] = dataclasses.field(default_factory=list)


def resolve_project(run: Run, project: str | None = None) -> str:
    from gcs_spawner import cloud

    return cloud.resolve_project(run.file, project or run.fields.project)


class UpState:
    def __init__(self, run: Run, *, project: str | None, dry_run: bool, yes: bool, out: TextIO,
                 confirm: Callable[[str], bool] | None, clients: Clients | None, preflight: bool, prices: str | None,
                 ask_price: Callable[[str], str | None] | None = None):
        from objectstore import open_store

        self.run, self.dry_run, self.yes, self.out = run, dry_run, yes, out
        self.confirm, self.clients = confirm, clients or Clients()
        self.preflight, self.prices = preflight, checks.prices_file(run, prices)
        self.project = resolve_project(run, project)
        self.store = open_store(run.queue)
        self.record = RunRecord(self.store)
        self.report = UpReport()
        self.tasks: list[tuple[str, bytes]] = []
        self.diff = None  # converge.Difference, once validated
        self.ask_price = ask_price  # a terminal's question for the price of an unpriced type (checks.price_for_limit)
        self.given_price: float | None = None  # the price the user gave, $ per machine-hour, recorded in run.json

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def would(self, line: str) -> None:
        self.report.would.append(line)
        self.say(f"would {line}")

    def done(self, step: str) -> None:
        self.report.steps.append(step)
        log.info("event=step_done step=%s run=%s", step, self.run.name)

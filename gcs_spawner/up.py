"""`gcs-spawner up RUN`: validate, show the plan, ask, then make everything the run needs, each step idempotent.

The steps, each logged as `event=step_done step=NAME` when it ends:

1. `validate`: the run file (already loaded), the tasks (by the model consume.py uses), the accelerator, the
   model's config.json and family, the queue's bucket (a write), a job already in the queue (the same, or refused),
   the code prefix (when the run does not upload it), the pre-flight (roles, quotas, bucket location), and the
   plan with its considered resources and the spending limit. Nothing is created before this step ends.
2. `record`: `run/run.json` in the queue (gcs_spawner/record.py).
3. `mirror`: the model copied into its mirror, unless the mirror already has its config.json (written last).
4. `code`: the checkout and its environment uploaded (a sync: unchanged files cost a listing), then checked.
5. `submit`: the job and the tasks, create-only, in batches of SUBMIT_CHUNK tasks (a batch marker each:
   docs/PROTOCOL.md, "Batches"), so a second `up` finds them all and creates none.
6. `machines`: the difference printed before the question, applied (gcs_spawner/fleetstep.py): VM: the
   instance template, then the managed instance group (NAME, in its zone or region), resized when the count
   changed; TPU: the queued resources through the keeper's own step (fleet/keeper.py: it lists what exists and
   adds only what is missing), or plain nodes NAME-NNNN; a spec change replaces them. Each create is recorded
   first (write-ahead) and a 409 on a resource the record holds is taken as done. Only then does run/run.json
   get the fleet as made (`fleet`, with its hashes: gcs_spawner/converge.py).

Before it asks, `up` compares the run file with the record and with what the cloud lists under the run's label,
and prints the difference (create, resize, replace, delete: gcs_spawner/converge.py); a change to what
identifies the run (name, queue, job, project) is refused before anything is made. `--dry-run` prints the same.

Ctrl-C (or SIGTERM) at any point leaves what was made recorded; `up` again continues and creates nothing twice,
and `down` deletes what is recorded. `dry_run` prints one line per call it would make and makes none.

The code follows the seams: what one `up` holds (gcs_spawner/upstate.py), step 1's checks, difference and plan
(gcs_spawner/upcheck.py), steps 3-5 (gcs_spawner/upsteps.py), step 6 (gcs_spawner/fleetstep.py), and here the
question, the record and their order.

`up(run, ...)` is the function the command calls: tests and the fleet rehearsal drive it directly, with the API
endpoints taken from FLEET_COMPUTE_ENDPOINT / FLEET_TPU_ENDPOINT / STORAGE_EMULATOR_HOST as everywhere else
(fleet/gapi.py), or clients passed in.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

from gcs_spawner import upcheck, upsteps
from gcs_spawner.cloud import Clients, Declined
from gcs_spawner.fleetstep import FleetStep, UpError
from gcs_spawner.runfile import Run
from gcs_spawner.upcheck import plan_inputs, run_tasks
from gcs_spawner.upstate import UpReport, UpState, resolve_project
from progress import Progress

__all__ = ["Clients", "Declined", "UpError", "UpReport", "up", "plan_inputs", "run_tasks", "resolve_project",
           "wait_for_machines"]

log = logging.getLogger("gcs_spawner")


class _Up(UpState):
    """One `up`: its checks (upcheck), the question, its record, its steps (upsteps, fleetstep), in this order."""

    def validate(self) -> None:
        upcheck.validate(self)

    # -- 2. ask --------------------------------------------------------------------------------------------------

    def ask(self) -> None:
        if self.yes or self.dry_run:
            return
        what = (f"create the {self.run.kind} fleet {self.run.name!r} ({self.run.machines} x {self.run.accelerator}"
                f"{', spot' if self.run.spec.spot else ''}) in project {self.project}")
        if self.record.read_run() is not None:
            changes = len(self.diff.changes) if self.diff else 0
            what = (f"continue run {self.run.name!r} in project {self.project}"
                    + (f", making the {changes} change{'s' if changes != 1 else ''} above" if changes else ""))
        if self.confirm is None:
            raise Declined("up asks before it creates anything, and stdin is not a terminal: pass --yes",
                           cannot_ask=True)
        if not self.confirm(f"{what}. Proceed? [y/N] "):
            raise Declined("not confirmed; nothing was created")

    # -- 3. record -----------------------------------------------------------------------------------------------

    def begin(self) -> None:
        """run/run.json: the run, and the fleet as an earlier `up` made it (the machines step records the new one
        once it is made)."""
        earlier = self.record.read_run() or {}
        summary = {"name": self.run.name, "project": self.project, "file": str(self.run.file),
                   "queue": self.run.queue, "code": self.run.fields.code.url, "tasks": len(self.tasks)}
        for kept in ("fleet", "added", "prices"):  # the fleet as made, add's machines, prices given
            if earlier.get(kept):
                summary[kept] = earlier[kept]
        if self.given_price is not None:  # status and keep price the fleet with it (gcs_spawner/keep.py, run_prices)
            summary["prices"] = {**(earlier.get("prices") or {}), self.run.accelerator: self.given_price}
        if self.dry_run:
            self.would(f"write {self.store.url('run/run.json')}")
        else:
            self.record.begin(summary)
        self.done("record")

    # -- 4-6. mirror, code, submit: gcs_spawner/upsteps.py. 7. machines -----------------------------------------

    def machines(self) -> None:
        from gcs_spawner import converge

        step = FleetStep(self.run, self.project, self.record, self.clients, self.report, self.dry_run, self.would,
                         len(self.tasks), upcheck.queue_work(self), self.say)
        step.apply(self.diff)
        if not self.dry_run:
            self.record.update_run({"fleet": converge.record_fleet(self.run)})
        self.done("machines")

    # -- 8. where to watch -------------------------------------------------------------------------------------

    def where_to_watch(self) -> None:
        run_file = self.run.file
        self.say("")
        if self.dry_run:
            self.say(f"dry run: {len(self.report.would)} calls shown, none made")
            return
        made, there = len(self.report.created), len(self.report.existed)
        changed = [f"{n} {what}" for n, what in ((len(self.report.resized), "resized"),
                                                 (len(self.report.deleted), "deleted")) if n]
        self.say(f"up: run {self.run.name!r} is up ({made} resource{'s' if made != 1 else ''} created now, "
                 f"{there} there already{''.join(', ' + c for c in changed)}). Watch it:")
        self.say(f"  gcs-spawner status {run_file} --watch            progress, machines, cost, ETA")
        self.say(f"  gcs-spawner status {run_file} --publish --watch 60   the page at "
                 f"{self.store.url('status.html')}")
        if self.run.kind == "tpu" and self.run.fields.fleet.keeper:
            self.say(f"  gcs-spawner keep {run_file}                     replaces preempted TPU VMs and deletes lost "
                     "machines until the queue is drained (anywhere with credentials)")
        else:
            self.say(f"  gcs-spawner keep {run_file}                     deletes lost machines the cloud still has, "
                     "until the queue is drained")
        self.say(f"  gcs-spawner logs {run_file} MACHINE              a failed machine's log tail")
        self.say(f"  gcs-spawner down {run_file}                     deletes what up made; the data stays")

def up(run: Run, *, project: str | None = None, dry_run: bool = False, yes: bool = False, out: TextIO | None = None,
       confirm: Callable[[str], bool] | None = None, clients: Clients | None = None, preflight: bool = True,
       prices: str | None = None, ask_price: Callable[[str], str | None] | None = None) -> UpReport:
    """Bring the run up (the module docstring's steps). `confirm(question)` asks the user (None: cannot ask, so
    only `yes` or `dry_run` go on); `ask_price(question)` asks for the hourly price of a type the price table lacks,
    which a spending limit needs (None: cannot ask, so the limit is refused, naming --prices). Raises CheckError
    (bad input: nothing created), Declined, or UpError."""
    doer = _Up(run, project=project, dry_run=dry_run, yes=yes, out=out or sys.stdout, confirm=confirm, clients=clients,
               preflight=preflight, prices=prices, ask_price=ask_price)
    doer.validate()
    doer.ask()
    doer.begin()
    upsteps.mirror(doer)
    upsteps.code(doer)
    upsteps.submit(doer)
    doer.machines()
    doer.where_to_watch()
    return doer.report


def wait_for_machines(store, want: int, timeout_s: float, out: TextIO | None = None,
                      sleep: Callable[[float], None] = time.sleep) -> int:
    """Poll the machine records (`machines/`, one listing per 1000) until `want` machines are working or idle, or
    `timeout_s` passes; the count reached. A progress bar on a terminal, a line every 10 s in a log."""
    from fleet.machines import PREFIX

    deadline = time.monotonic() + timeout_s
    up_now = 0
    with Progress("machines", want, "machines up") as progress:
        while True:
            states = [e.metadata.get("state") for e in store.list(PREFIX)]
            up_now = sum(state in ("working", "idle") for state in states)
            progress.set(up_now)
            if up_now >= want or time.monotonic() >= deadline:
                return up_now
            sleep(5)

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

`up(run, ...)` is the function the command calls: tests and the fleet rehearsal drive it directly, with the API
endpoints taken from FLEET_COMPUTE_ENDPOINT / FLEET_TPU_ENDPOINT / STORAGE_EMULATOR_HOST as everywhere else
(fleet/gapi.py), or clients passed in.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import sys
import time
from collections.abc import Callable
from typing import TextIO

from gcs_spawner import checks
from gcs_spawner.cloud import Clients, Declined
from gcs_spawner.fleetstep import FleetStep, UpError, vm_resources
from gcs_spawner.record import RunRecord
from gcs_spawner.runfile import Run
from progress import Progress

__all__ = ["Clients", "Declined", "UpError", "UpReport", "up", "plan_inputs", "wait_for_machines"]

log = logging.getLogger("gcs_spawner")

#: Tasks per submit call: each call is one batch (its marker, its regions), and the progress moves per call.
SUBMIT_CHUNK = 2000


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


class _Up:
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

    # -- 1. validate -------------------------------------------------------------------------------------------

    def validate(self) -> None:
        from gcs_spawner import tasks as tasks_module

        run = self.run
        checks.accelerator(run, self.prices)
        checks.model_config(run)
        checks.job_addresses(run)
        self.tasks, task_models = _run_tasks(run, tasks_module)
        self._job_in_queue()
        if self.dry_run:
            self._bucket_exists()
        else:
            checks.bucket_writable(self.store, f"{run.file}: queue")
        if not run.fields.code.upload:
            checks.code_environment(run)
        checks.zones_offer(run, self.project, self.clients)
        if self.preflight:
            checks.preflight_holds(self.run, self.project, self.say)
        self._difference()
        self._names_are_ours()
        self._plan(task_models)
        self.done("validate")

    def _difference(self) -> None:
        """The run file against the record and the cloud (gcs_spawner/converge.py), printed; refused when it
        changes what identifies the run."""
        from gcs_spawner import cloud, converge

        fleet = self.run.fields.fleet
        recorded = self.record.read_run()
        before = (recorded or {}).get("fleet") or {}
        zones = [*fleet.zones, *(before.get("zones") or ())]
        regions = [r for r in (fleet.region, before.get("region")) if r]
        found = cloud.find_run(self.clients, self.project, self.run.name, None, zones, regions)
        claimable = None if self.dry_run or recorded is None else self._work()().claimable
        self.diff = converge.difference(self.run, self.project, recorded, found, len(self.tasks), claimable)
        self.report.difference = self.diff.lines()
        if self.diff.changes:
            self.say(f"up: the run file against its record and the cloud (project {self.project}):")
            for line in self.report.difference:
                self.say(line)
        else:
            self.say(f"up: the cloud already holds what {self.run.file.name} asks for: nothing to create, resize, "
                     "replace or delete")

    def _work(self):
        """What the keeper's step asks the queue (gcs_spawner/keep.py); a dry run submitted nothing, so all the
        run's tasks are claimable."""
        from fleet import keeper
        from gcs_spawner.keep import queue_work

        if self.dry_run:
            return lambda: keeper.Work(claimable=len(self.tasks), held=0, complete=False)
        return queue_work(self.store)

    def _names_are_ours(self) -> None:
        """The template and group this run would make (VMs) are absent, or this run's own (record.py's contract):
        a name taken by something else stops `up` here, before anything is made."""
        if self.run.kind != "vm":
            return  # TPU VMs: the keeper counts only NAME-NNNN it lists, and the names are the run's own
        for resource, exists in vm_resources(self.run, self.project, self.clients):
            if exists() and not self.record.is_ours(resource):
                raise checks.CheckError(f"{resource.describe()} exists in project {resource.project} and was not "
                                        f"made by run {self.run.name!r}; delete it, or rename the run")

    def _job_in_queue(self) -> None:
        import json

        from objectstore import NotFound

        try:
            stored = json.loads(self.store.read("job.json").data)
        except NotFound:
            return
        if stored != self.run.job_raw:
            raise checks.CheckError(
                f"{self.run.file}: job: {self.store.url('job.json')} already holds another job (a queue holds one "
                "job, and its tasks were made for it); give the run a new queue prefix, or put the stored job back")

    def _bucket_exists(self) -> None:
        from objectstore import StoreError

        try:
            self.store.list_page("", page_size=1)
        except StoreError as err:
            raise checks.CheckError(f"{self.run.file}: queue: cannot list {self.run.queue}: {err}") from None

    def _plan(self, task_models) -> None:
        from extract.errors import BadInput
        from reporting import pricing
        from reporting.considered import considered_resources, render_considered
        from reporting.plan import make_plan, render

        if checks.cpu_fleet(self.run):
            self.say(checks.cpu_fleet_price(self.run, self.prices))
            return
        if checks.accelerator(self.run, self.prices) is None:
            limit = self.run.fields.max_dollars
            self.given_price = checks.price_for_limit(self.run, self.prices, self.ask_price, limit)
            if self.given_price is None:
                self.say(checks.unpriced(self.run, self.prices))
                return
            machines, per_hour = self.run.machines, self.given_price
            self.say(f"plan: {machines} x {self.run.accelerator} at {per_hour:g} $ per machine-hour (the price given, "
                     f"recorded in {self.store.url('run/run.json')}): {machines * per_hour:g} $ per hour for the fleet; "
                     f"max_dollars {limit:,.2f} $ lasts {limit / (machines * per_hour):,.1f} h of the whole fleet. No "
                     "hours or total $ of the job can be stated (the price table has no peak FLOPs for the type); "
                     "status prices the fleet's machine-hours at it, and keep makes no machine past the limit")
            return
        inputs = plan_inputs(self.run, task_models, self.prices)
        try:
            plan = make_plan(inputs)
            names = [self.run.accelerator, *self.run.fields.fleet.alternatives]
            rows = considered_resources(inputs, plan, names, spot=self.run.spec.spot)
        except (BadInput, pricing.PriceError) as err:  # a transient read (TransientIOError) stays a failure
            raise checks.CheckError(f"{self.run.file}: plan: {err}") from None
        self.report.plan, self.report.considered = plan, rows
        self.say(render(plan))
        self.say("")
        self.say(render_considered(rows, inputs.machines, self.run.spec.spot, inputs.months))
        limit = self.run.fields.max_dollars
        total = plan["total_dollars"]["spot" if self.run.spec.spot else "on_demand"]
        if limit is not None and total > limit:
            raise checks.CheckError(
                f"{self.run.file}: max_dollars: the plan's {'spot' if self.run.spec.spot else 'on-demand'} estimate "
                f"is {total:,.2f} $, above the limit of {limit:,.2f} $; raise max_dollars, or shrink the job "
                "(fewer rows, layers or tokens)")

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

    # -- 4. mirror -----------------------------------------------------------------------------------------------

    def mirror(self) -> None:
        from objectstore import NotFound, open_store

        run, mirror = self.run, self.run.job.model
        source = run.model_source
        try:
            open_store(mirror).read("config.json")
            mirrored = True
        except NotFound:
            mirrored = False
        if mirrored or source is None:
            self.done("mirror")
            return
        if self.dry_run:
            self.would(f"mirror the model {source} into {mirror}")
            self.done("mirror")
            return
        from extract import hub  # JAX-free: the base install mirrors

        if pathlib.Path(source).is_dir():
            files = [p for p in pathlib.Path(source).iterdir() if p.is_file() and hub.is_model_file(p.name)]
            total = sum(p.stat().st_size for p in files)
            with Progress("mirror", total, "bytes") as progress:
                hub.upload_model_dir(source, mirror, on_file=lambda name, size: progress.advance(size))
        else:
            with Progress("mirror", None, "bytes") as progress:
                hub.mirror_hub_snapshot(source, mirror, revision=run.fields.model.revision,
                                            on_file=lambda name, size: progress.advance(size))
        self.done("mirror")

    # -- 5. code -------------------------------------------------------------------------------------------------

    def code(self) -> None:
        from fleet import environment

        code = self.run.fields.code
        if not code.upload:
            self.done("code")
            return
        lock = environment.LOCK_OF_PLATFORM[self.run.platform]
        if self.dry_run:
            self.would(f"upload {self.run.code_source} to {code.url}"
                       + (f" with locks/{lock}.txt and uv/uv" if code.environment else ""))
            self.done("code")
            return
        with Progress("code", None, "bytes") as progress:  # files the client uploads; gcloud shows its own
            environment.upload_code(
                self.run.code_source, code.url, code.exclude, python_version=self.run.spec.python,
                extras=self.run.spec.extras, locks=(lock,) if code.environment else None, wheelhouse=code.wheelhouse,
                python_mirror=code.python_mirror, on_file=lambda name, size: progress.advance(size))
        checks.code_environment(self.run)
        self.done("code")

    # -- 6. submit -----------------------------------------------------------------------------------------------

    def submit(self) -> None:
        from taskqueue.submit import submit

        if self.dry_run:
            batches = -(-len(self.tasks) // SUBMIT_CHUNK)
            self.would(f"submit {self.store.url('job.json')} and {len(self.tasks)} task{'s' if len(self.tasks) != 1 else ''} "
                       f"(create-only, {batches} batch{'es' if batches != 1 else ''})")
            self.done("submit")
            return
        created = existing = 0
        with Progress("submit", len(self.tasks), "tasks") as progress:
            for start in range(0, max(1, len(self.tasks)), SUBMIT_CHUNK):
                chunk = self.tasks[start:start + SUBMIT_CHUNK]
                # A done batch of the first chunk means its job.json was created before it (taskqueue.submit).
                if chunk and self._submitted(chunk):
                    existing += len(chunk)
                else:
                    report = submit(self.store, self.run.job_bytes if start == 0 else None, chunk)
                    created, existing = created + report.created, existing + report.existing
                progress.advance(len(chunk))
        self.report.submitted = {"created": created, "existing": existing, "tasks": len(self.tasks)}
        log.info("event=submitted run=%s created=%d already_existed=%d", self.run.name, created, existing)
        self.done("submit")

    def _submitted(self, chunk: list[tuple[str, bytes]]) -> bool:
        """Whether an earlier `up` submitted this chunk whole: its batch marker (named from its ids) is `done` and
        did not give up (docs/PROTOCOL.md, "Batches"). One listing instead of a create per task; a marker pruned
        since (10 minutes after) only means the chunk is submitted again, creating nothing."""
        from taskqueue import layout
        from taskqueue.submit import batch_name

        name = batch_name(task_id for task_id, _ in chunk)
        entry = next((e for e in self.store.list_page(name, page_size=1).entries if e.name == name), None)
        return (entry is not None and entry.metadata.get("state") == layout.BATCH_DONE
                and not {"gave_up", "refused"} & set(entry.metadata))

    # -- 7. machines ---------------------------------------------------------------------------------------------

    def machines(self) -> None:
        from gcs_spawner import converge

        step = FleetStep(self.run, self.project, self.record, self.clients, self.report, self.dry_run, self.would,
                         len(self.tasks), self._work(), self.say)
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


def plan_inputs(run: Run, task_models, prices: str | None = None):
    """The planner's inputs for a run: its job and tasks, its accelerator and machines, its `plan` section. A run
    with a model source is planned from the source (its config.json and tokenizer, or the planner's built-in
    configs for a Hub id), so that the plan comes before the mirror; without one, from the mirror."""
    from reporting.plan import PlanInputs

    section = run.fields.plan
    job = run.job.model_copy(update={"model": run.model_source}) if run.model_source else run.job
    return PlanInputs(
        job=job, job_label=f"{run.file} (run {run.name})", accelerator=run.accelerator, task_list=task_models,
        tokens_per_row=section.tokens_per_row, sample_rows=section.sample_rows,
        model_config=str(run.file.parent / section.model_config_file) if section.model_config_file else None,
        tokenizer=str(run.file.parent / section.tokenizer) if section.tokenizer else None, mfu=section.mfu,
        machines=run.machines, target_minutes=section.target_minutes, fixed_seconds=section.fixed_seconds,
        months=section.months,
        storage_budget_tb=section.storage_budget_tb, prices=prices, queue=run.queue)


def _run_tasks(run: Run, tasks_module):
    """(encoded tasks for submit, Task models) of the run: its tasks file, or its data cut by rows_per_task."""
    from extract.errors import BadInput, ExtractError

    try:
        if run.tasks_file is not None:
            return tasks_module.read_tasks(run.tasks_file)
        models = tasks_module.make_tasks(run.job, run.fields.tasks.rows_per_task, run.fields.tasks.id_prefix)
        return tasks_module.encode(models), models
    except BadInput as err:
        raise checks.CheckError(f"{run.file}: tasks: {err}") from None
    except ExtractError as err:
        raise UpError(f"{run.file}: tasks: reading the data files failed: {err}") from None


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
    doer.mirror()
    doer.code()
    doer.submit()
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

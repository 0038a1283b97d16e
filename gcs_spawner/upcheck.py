"""`up`'s first step, before anything is made: every check (gcs_spawner/checks.py), the difference between the run
file, its record and the cloud (gcs_spawner/converge.py), printed, and the plan against the spending limit. What
`validate` runs alone. Each function takes the run's `UpState` (gcs_spawner/upstate.py)."""

from __future__ import annotations

from gcs_spawner import checks
from gcs_spawner.fleetstep import UpError, vm_resources
from gcs_spawner.runfile import Run


def validate(state) -> None:
    from gcs_spawner import tasks as tasks_module

    run = state.run
    checks.accelerator(run, state.prices)
    checks.model_config(run)
    checks.job_addresses(run)
    state.tasks, task_models = run_tasks(run, tasks_module)
    _job_in_queue(state)
    if state.dry_run:
        _bucket_exists(state)
    else:
        checks.bucket_writable(state.store, f"{run.file}: queue")
    if not run.fields.code.upload:
        checks.code_environment(run)
    checks.zones_offer(run, state.project, state.clients)
    if state.preflight:
        checks.preflight_holds(state.run, state.project, state.say)
    _difference(state)
    _names_are_ours(state)
    _plan(state, task_models)
    state.done("validate")

def _difference(state) -> None:
    """The run file against the record and the cloud (gcs_spawner/converge.py), printed; refused when it
    changes what identifies the run."""
    from gcs_spawner import cloud, converge

    fleet = state.run.fields.fleet
    recorded = state.record.read_run()
    before = (recorded or {}).get("fleet") or {}
    zones = [*fleet.zones, *(before.get("zones") or ())]
    regions = [r for r in (fleet.region, before.get("region")) if r]
    found = cloud.find_run(state.clients, state.project, state.run.name, None, zones, regions)
    claimable = None if state.dry_run or recorded is None else queue_work(state)().claimable
    state.diff = converge.difference(state.run, state.project, recorded, found, len(state.tasks), claimable)
    state.report.difference = state.diff.lines()
    if state.diff.changes:
        state.say(f"up: the run file against its record and the cloud (project {state.project}):")
        for line in state.report.difference:
            state.say(line)
    else:
        state.say(f"up: the cloud already holds what {state.run.file.name} asks for: nothing to create, resize, "
                 "replace or delete")

def queue_work(state):
    """What the keeper's step asks the queue (gcs_spawner/keep.py); a dry run submitted nothing, so all the
    run's tasks are claimable."""
    from fleet import keeper
    from gcs_spawner.keep import queue_work

    if state.dry_run:
        return lambda: keeper.Work(claimable=len(state.tasks), held=0, complete=False)
    return queue_work(state.store)

def _names_are_ours(state) -> None:
    """The template and group this run would make (VMs) are absent, or this run's own (record.py's contract):
    a name taken by something else stops `up` here, before anything is made."""
    if state.run.kind != "vm":
        return  # TPU VMs: the keeper counts only NAME-NNNN it lists, and the names are the run's own
    for resource, exists in vm_resources(state.run, state.project, state.clients):
        if exists() and not state.record.is_ours(resource):
            raise checks.CheckError(f"{resource.describe()} exists in project {resource.project} and was not "
                                    f"made by run {state.run.name!r}; delete it, or rename the run")

def _job_in_queue(state) -> None:
    import json

    from objectstore import NotFound

    try:
        stored = json.loads(state.store.read("job.json").data)
    except NotFound:
        return
    if stored != state.run.job_raw:
        raise checks.CheckError(
            f"{state.run.file}: job: {state.store.url('job.json')} already holds another job (a queue holds one "
            "job, and its tasks were made for it); give the run a new queue prefix, or put the stored job back")

def _bucket_exists(state) -> None:
    from objectstore import StoreError

    try:
        state.store.list_page("", page_size=1)
    except StoreError as err:
        raise checks.CheckError(f"{state.run.file}: queue: cannot list {state.run.queue}: {err}") from None

def _plan(state, task_models) -> None:
    from extract.errors import BadInput
    from reporting import pricing
    from reporting.considered import considered_resources, render_considered
    from reporting.plan import make_plan, render

    if checks.cpu_fleet(state.run):
        state.say(checks.cpu_fleet_price(state.run, state.prices))
        return
    if checks.accelerator(state.run, state.prices) is None:
        limit = state.run.fields.max_dollars
        state.given_price = checks.price_for_limit(state.run, state.prices, state.ask_price, limit)
        if state.given_price is None:
            state.say(checks.unpriced(state.run, state.prices))
            return
        machines, per_hour = state.run.machines, state.given_price
        state.say(f"plan: {machines} x {state.run.accelerator} at {per_hour:g} $ per machine-hour (the price given, "
                 f"recorded in {state.store.url('run/run.json')}): {machines * per_hour:g} $ per hour for the fleet; "
                 f"max_dollars {limit:,.2f} $ lasts {limit / (machines * per_hour):,.1f} h of the whole fleet. No "
                 "hours or total $ of the job can be stated (the price table has no peak FLOPs for the type); "
                 "status prices the fleet's machine-hours at it, and keep makes no machine past the limit")
        return
    inputs = plan_inputs(state.run, task_models, state.prices)
    try:
        plan = make_plan(inputs)
        names = [state.run.accelerator, *state.run.fields.fleet.alternatives]
        rows = considered_resources(inputs, plan, names, spot=state.run.spec.spot)
    except (BadInput, pricing.PriceError) as err:  # a transient read (TransientIOError) stays a failure
        raise checks.CheckError(f"{state.run.file}: plan: {err}") from None
    state.report.plan, state.report.considered = plan, rows
    state.say(render(plan))
    state.say("")
    state.say(render_considered(rows, inputs.machines, state.run.spec.spot, inputs.months))
    limit = state.run.fields.max_dollars
    total = plan["total_dollars"]["spot" if state.run.spec.spot else "on_demand"]
    if limit is not None and total > limit:
        raise checks.CheckError(
            f"{state.run.file}: max_dollars: the plan's {'spot' if state.run.spec.spot else 'on-demand'} estimate "
            f"is {total:,.2f} $, above the limit of {limit:,.2f} $; raise max_dollars, or shrink the job "
            "(fewer rows, layers or tokens)")


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


def run_tasks(run: Run, tasks_module):
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

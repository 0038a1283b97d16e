"""`gcs-spawner`: one command for a run, its verbs as subcommands.

    gcs-spawner plan run.yaml          what it will cost, on each accelerator the run allows
    gcs-spawner up run.yaml            validate, show the plan, ask, then make it (each step idempotent)
    gcs-spawner status run.yaml        progress, machines, cost, ETA (or a queue: gs://bucket/prefix, a directory)
    gcs-spawner down run.yaml          delete exactly what up made; the data stays

and `validate`, `add` (more machines of another spec on the run's queue), `keep` (delete lost machines; TPU:
replace preempted ones), `logs RUN MACHINE`, `merge`, `export`, plus the steps `up` takes, each on its own for a
queue: `tasks`, `submit`, `mirror`, `upload-code`. The tools in tools/ are these subcommands under their old names.

One name per concept in every subcommand: the queue is QUEUE (or `--queue`), the count `--count`, a zone
`--zone` (repeatable, or comma-separated), the project `--project`, an output file `-o/--output`, and `--yes`,
`--dry-run`, `--json` mean the same everywhere. Exit codes: 0 done, 1 failed (the cloud or the store refused,
interrupted, not confirmed), 2 usage, 65 bad input (a run, job, task, spec or address that cannot work; nothing
was created).

Only argparse is imported here: each subcommand imports what it uses (JAX, the Google clients) when it runs, so
`--help` answers at once.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import signal
import sys

from exitcodes import EX_FAILED, EX_OK, EX_USAGE

log = logging.getLogger("gcs_spawner")


class UsageError(Exception):
    """A command line that cannot mean anything (exit 2)."""


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # SIGTERM, like Ctrl-C, lets a submit finish its batch


def _confirm(question: str) -> bool:
    print(question, end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _confirmer(args):
    """How to ask the user: on a terminal, a question on stderr; anywhere else, no way (so --yes is needed)."""
    return _confirm if sys.stdin.isatty() else None


def _ask(question: str) -> str | None:
    """A question on stderr, the answer's line from stdin (None at the end of input)."""
    print(question, end="", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    return line if line else None


def _price_asker(args):
    """How to ask for a price (checks.price_for_limit): on a terminal, and not told --yes; else no way."""
    return _ask if sys.stdin.isatty() and not getattr(args, "yes", False) else None


# -- what the user typed ------------------------------------------------------------------------------------------


def _queue(args, what: str = "QUEUE") -> str:
    """The queue of a command that takes RUN|QUEUE: the run file's queue, or the address checked."""
    from gcs_spawner.runfile import is_run_file, queue_of
    from objectstore.address import check_address

    given = [v for v in (getattr(args, "target", None), getattr(args, "queue", None)) if v]
    if len(given) != 1:
        raise UsageError(f"give the run file or the queue once: as {what}, or as --queue (got {len(given)})")
    if is_run_file(given[0]):
        return queue_of(given[0])
    _not_a_run_file(given[0])
    return check_address(given[0], "--queue" if args.queue else what)


def _not_a_run_file(text: str) -> None:
    """A RUN|QUEUE that names a run file (.yaml, .yml, .json) which does not exist is a misspelt or moved run file,
    not a queue directory to create: say so, with the nearest run files beside it."""
    import difflib

    from gcs_spawner.runfile import RunFileError

    path = pathlib.Path(text).expanduser()
    if path.suffix not in (".yaml", ".yml", ".json") or path.exists():
        return
    near = sorted(p.name for p in (path.parent if str(path.parent) else pathlib.Path(".")).glob("*")
                  if p.suffix in (".yaml", ".yml") and p.is_file()) if path.parent.is_dir() else []
    close = difflib.get_close_matches(path.name, near, n=3)
    raise RunFileError(f"{text}: no such run file" + (f"; did you mean {', '.join(close)}?" if close else
                                                      "; give the run file (run.yaml) or the queue (gs://bucket/prefix)"))


def _load_run(path: pathlib.Path):
    """The run file, loaded (runfile.load_run); one that does not exist is named with the run files nearest to it
    (beside it, or here when its directory does not exist)."""
    import difflib

    from gcs_spawner.runfile import RunFileError, load_run

    if not path.exists():
        where = path.parent if path.parent.is_dir() else pathlib.Path(".")
        near = sorted(str(p) for p in where.glob("*") if p.suffix in (".yaml", ".yml", ".json") and p.is_file())
        close = difflib.get_close_matches(str(where / path.name) if where != path.parent else str(path), near, n=3,
                                          cutoff=0.7)
        raise RunFileError(f"{path}: no such run file" + (f"; did you mean {' or '.join(close)}?" if close else
                           f"; {'its directory does not exist; ' if not path.parent.is_dir() else ''}give the run "
                           "file's path (cp templates/run.yaml run.yaml makes one)"))
    return load_run(path)


def zone_list(values: list[str]) -> list[str]:
    """--zone a --zone b and --zone a,b alike, in order, without repeats."""
    return list(dict.fromkeys(z.strip() for value in values for z in value.split(",") if z.strip()))


def _add_target(p: argparse.ArgumentParser, help_text: str = "a run file (run.yaml), or a queue: gs://bucket/prefix "
                                                                  "or a directory") -> None:
    p.add_argument("target", nargs="?", metavar="RUN|QUEUE", help=help_text)
    p.add_argument("--queue", help="the queue, when no RUN|QUEUE is given")


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.INFO if verbose or not sys.stderr.isatty() else logging.WARNING,
                        stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")


# -- run verbs ------------------------------------------------------------------------------------------------------


def cmd_validate(args) -> int:
    from gcs_spawner import up
    from gcs_spawner.runfile import load_run

    run = _load_run(args.run)
    doer = up._Up(run, project=args.project, dry_run=True, yes=True, out=sys.stdout, confirm=None, clients=None,
                  preflight=not args.no_preflight, prices=args.prices)
    doer.validate()
    if run.fields.code.upload:
        print(f"code: {run.fields.code.url} is checked after up uploads it (code.upload: true)")
    print(f"valid: run {run.name!r} ({run.machines} x {run.accelerator}, {len(doer.tasks)} tasks)")
    return EX_OK


def cmd_plan(args) -> int:
    import json

    from extract.errors import BadInput
    from gcs_spawner import checks
    from gcs_spawner import tasks as tasks_module
    from gcs_spawner.checks import CheckError
    from gcs_spawner.runfile import load_run
    from gcs_spawner.upcheck import plan_inputs, run_tasks
    from reporting import plan as planner
    from reporting.considered import considered_resources, render_considered
    from reporting.plan import make_plan, render
    from reporting.pricing import PriceError
    from reporting.planflags import JOB_FLAGS, add_job_arguments

    if args.accelerator is not None:  # a job file alone: JOB --accelerator TYPE [its flags]
        plan = make_plan(planner.job_inputs(args))
        print(json.dumps(plan, indent=1) if args.json else render(plan))
        return EX_OK
    defaults = argparse.ArgumentParser(add_help=False)
    add_job_arguments(defaults)
    given = [name for name in JOB_FLAGS if getattr(args, name) != getattr(defaults.parse_args([]), name)]
    if given:
        raise UsageError(f"--{given[0].replace('_', '-')}: a flag of a job planned alone (JOB --accelerator TYPE); a "
                         "run file's plan takes it from the file (its plan section and fleet)")
    run = _load_run(args.run)
    prices = checks.prices_file(run, args.prices)
    _, task_models = run_tasks(run, tasks_module)
    if checks.accelerator(run, prices) is None:
        line = checks.unpriced(run, prices, False)
        print(json.dumps({"plan": None, "why": line}, indent=1) if args.json else line)
        return EX_OK
    inputs = plan_inputs(run, task_models, prices)
    try:
        plan = make_plan(inputs)
        rows = considered_resources(inputs, plan, [run.accelerator, *run.fields.fleet.alternatives], run.spec.spot)
    except PriceError as err:
        if not checks.cpu_fleet(run):
            raise CheckError(f"{run.file}: plan: {err}") from None
        # A CPU machine type the table prices without a peak (peak_fp32_gflops_per_vcpu): its hourly price alone.
        line = checks.cpu_fleet_price(run, prices)
        print(json.dumps({"plan": None, "why": f"{line} ({err})"}, indent=1) if args.json else f"{line}\n{err}")
        return EX_OK
    except BadInput as err:  # a transient read (TransientIOError) stays a failure, exit 1
        raise CheckError(f"{run.file}: plan: {err}") from None
    if args.json:
        print(json.dumps({**plan, "considered": rows}, indent=1))
    else:
        print(render(plan))
        print()
        print(render_considered(rows, inputs.machines, run.spec.spot, inputs.months))
    return EX_OK


def cmd_up(args) -> int:
    from gcs_spawner import up
    from gcs_spawner.runfile import load_run
    from objectstore import open_store

    run = _load_run(args.run)
    report = up.up(run, project=args.project, dry_run=args.dry_run, yes=args.yes, confirm=_confirmer(args),
                   preflight=not args.no_preflight, prices=args.prices, ask_price=_price_asker(args))
    if args.wait and not args.dry_run:
        reached = up.wait_for_machines(open_store(run.queue), run.machines if run.kind == "vm" else
                                       min(run.machines, len(report.created) + len(report.existed)), args.wait)
        print(f"machines up: {reached}")
    if args.keep and not args.dry_run:
        from gcs_spawner import keep

        keep.keep(run, project=args.project, interval_s=args.interval)
    return EX_OK


def cmd_add(args) -> int:
    from gcs_spawner import add
    from gcs_spawner.runfile import load_run

    if args.count < 1:
        raise UsageError(f"--count: {args.count}; add makes 1 or more machines")
    add.add(_load_run(args.run), args.spec, args.count, zone=args.zone, project=args.project, dry_run=args.dry_run,
            yes=args.yes, confirm=_confirmer(args), preflight=not args.no_preflight, prices=args.prices,
            ask_price=_price_asker(args))
    return EX_OK


def cmd_down(args) -> int:
    from gcs_spawner import down
    from gcs_spawner.runfile import is_run_file, run_fields
    from objectstore import open_store

    target = getattr(args, "target", None)
    fields = run_fields(target) if target and is_run_file(target) else None
    down.down(open_store(_queue(args, "RUN|QUEUE")), dry_run=args.dry_run, yes=args.yes, confirm=_confirmer(args),
              run=fields, project=args.project)
    return EX_OK


def cmd_keep(args) -> int:
    from gcs_spawner import keep
    from gcs_spawner.runfile import load_run

    report, lost = keep.keep(_load_run(args.run), project=args.project, interval_s=args.interval, once=args.once,
                             dry_run=args.dry_run, prices=args.prices)
    line = f"lost_deleted={len(lost.deleted)}"
    if report is not None:
        line = (f"claimable={report.work.claimable} held={report.work.held} alive={len(report.alive)} "
                f"deleted={len(report.deleted)} created={len(report.created)} {line}")
    print(line)
    return EX_OK


def cmd_status(args) -> int:
    import datetime as dt
    import json
    import time

    from objectstore import StoreError, open_store
    from reporting.pricing import load_prices
    from reporting.status import RegionCache
    from reporting.view import PAGE_OBJECT, job_view, render_text

    if args.estimate is not None and args.estimate < 1:
        raise UsageError(f"--estimate must list at least 1 region, got {args.estimate}")
    now = None
    if args.now:
        try:
            now = dt.datetime.fromisoformat(args.now)
        except ValueError:
            raise UsageError(f"--now {args.now!r} is not an ISO 8601 time; write e.g. 2026-11-23T15:00:00+00:00") from None
        now = now if now.tzinfo else now.replace(tzinfo=dt.timezone.utc)
    store = open_store(_queue(args))
    from gcs_spawner.keep import run_prices

    prices = run_prices(store, load_prices(args.prices))
    cache = RegionCache() if args.watch else None
    while True:
        at = now or dt.datetime.now(dt.timezone.utc)
        view = job_view(store, prices, at, args.estimate, cache, history=bool(args.html or args.publish or args.history))
        if args.html or args.publish:
            from reporting.page import render_html

            page = render_html(view, generated=at).encode()
            if args.html:
                pathlib.Path(args.html).write_bytes(page)
            if args.publish:
                try:
                    store.put(PAGE_OBJECT, page, content_type="text/html; charset=utf-8")
                except StoreError as exc:
                    print(f"status: could not publish {store.url(PAGE_OBJECT)}: {exc}", file=sys.stderr)
                    if not args.watch:
                        return EX_FAILED
        if view["total"] == 0 and not _is_queue(store):
            print(f"status: {store.root_url} holds no job.json and no tasks: is this the queue's prefix?",
                  file=sys.stderr)
        text = json.dumps(view, indent=1) if args.json else "\n".join(
            [render_text(view, all_machines=args.machines), *_run_lines(args, store, view)])
        if args.watch and sys.stdout.isatty():
            print("\033[H\033[2J", end="")
        print(text, flush=True)
        if not args.watch or view["complete"]:
            return EX_OK
        time.sleep(args.watch)


def _run_lines(args, store, view) -> list[str]:
    """Beneath the queue's view: the run's record, its lost machines and the command that deletes them, and with
    --cloud the cloud's own view (gcs_spawner/cloudstatus.py)."""
    from gcs_spawner import cloudstatus
    from gcs_spawner.runfile import is_run_file, run_fields

    target = args.target or args.queue
    lines = cloudstatus.record_lines(store)
    still_there = None
    if args.cloud:
        fields = run_fields(args.target) if args.target and is_run_file(args.target) else None
        cloud, still_there = cloudstatus.cloud_lines(store, fields, args.project)
        lines += cloud
    return lines + cloudstatus.lost_lines(view["fleet"]["lost"], target, still_there)


def _is_queue(store) -> bool:
    """Whether a prefix holds a queue: its job.json, or at least a done marker (two requests at most)."""
    from objectstore import NotFound

    try:
        store.read("job.json")
        return True
    except NotFound:
        return bool(store.list_page("done/", page_size=1).entries)


def cmd_merge(args) -> int:
    import json

    from reporting import jobindex
    from objectstore import open_store

    store = open_store(_queue(args))
    if not _is_queue(store):
        from gcs_spawner.checks import CheckError

        raise CheckError(f"{store.root_url} holds neither job.json nor done markers: it is not a queue; give the "
                         "prefix submit wrote the job to (nothing was written)")
    index = jobindex.build_index(store)
    if args.output == "-":
        json.dump(index, sys.stdout, indent=2, sort_keys=True)
        print()
    elif args.output:
        pathlib.Path(args.output).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    else:
        jobindex.write_index(store, index)
    from reporting.goodput import split_counters

    shown, _ = split_counters(index["totals"])  # the phase counters stay in the index; status shows goodput
    print(" ".join(f"{k}={v}" for k, v in shown.items()), file=sys.stderr)
    return EX_OK


def cmd_logs(args) -> int:
    import json

    from fleet.machines import MachineRecordError, record_object
    from objectstore import NotFound, open_store

    store = open_store(_queue(args))
    try:
        name = record_object(args.machine)
        record = json.loads(store.read(name).data)
    except MachineRecordError as err:
        raise UsageError(str(err)) from None
    except NotFound:
        from gcs_spawner.checks import CheckError

        known = [e.name[len("machines/"):-len(".json")] for e in store.list_page("machines/", page_size=20).entries]
        raise CheckError(f"{store.url(name)} does not exist: no machine {args.machine!r} has written a record; "
                         f"machines that have: {', '.join(known) or 'none'}") from None
    head = " ".join(f"{key}={record[key]}" for key in ("machine", "state", "at", "zone", "machine_type", "task", "reason")
                    if record.get(key) not in (None, ""))
    print(head)
    tail = record.get("log_tail")
    print(tail.rstrip("\n") if tail else f"(no log tail: a machine leaves one when it fails; this one is "
                                         f"{record.get('state')})")
    return EX_OK


def cmd_export(args) -> int:
    import json

    from activations.saelens import export_cached_activations
    from gcs_spawner.runfile import is_run_file, queue_of
    from objectstore.address import check_address

    source = args.source
    if is_run_file(source) and source.endswith((".yaml", ".yml")):
        source = queue_of(source)
    elif not pathlib.Path(source).exists():
        source = check_address(source, "RUN|QUEUE")  # a gs:// queue, marker or shards prefix, well formed
    summary = export_cached_activations(source, args.directory, layer=args.layer, site=args.site,
                                        context_size=args.context_size, dtype=args.dtype)
    print(json.dumps({"directory": args.directory, **summary}))
    return EX_OK


# -- steps, each on its own ----------------------------------------------------------------------------------------


def cmd_tasks(args) -> int:
    import json

    from extract.errors import BadInput
    from extract.job import load_job
    from gcs_spawner import tasks as tasks_module

    job = load_job(args.job)
    files = tasks_module.count_rows(job, args.workers)
    if args.rows_per_task == "auto":
        if not args.accelerator:
            raise BadInput("--accelerator: missing; --rows-per-task auto sizes tasks for an accelerator, e.g. v6e-8")
        rows_per_task = tasks_module.auto_rows_per_task(job, files, args.accelerator, args.mfu, args.target_minutes,
                                                        args.sample_rows, args.model_config, args.tokenizer,
                                                        args.fixed_seconds)
    else:
        try:
            rows_per_task = int(args.rows_per_task)
        except ValueError:
            raise BadInput(f"--rows-per-task: got {args.rows_per_task!r}; use a positive integer or auto") from None
    tasks = tasks_module.make_tasks(job, rows_per_task, args.id_prefix, files=files)
    lines = "".join(json.dumps(task.to_dict()) + "\n" for task in tasks)
    if args.output == "-":
        sys.stdout.write(lines)
    else:
        pathlib.Path(args.output).write_text(lines)
    return EX_OK


def cmd_submit(args) -> int:
    from gcs_spawner import tasks as tasks_module
    from objectstore import open_store
    from taskqueue.submit import finish_batch, submit

    if (args.tasks is None) == (args.finish_batch is None):
        raise UsageError("give --tasks to submit, or --finish-batch ID to finish a dead submit's batch")
    queue = _queue(args)
    if args.finish_batch:
        print(finish_batch(open_store(queue), args.finish_batch))
        return EX_OK
    # Everything is checked before the first write: the job and every manifest by the models consume.py uses.
    if args.any_consumer:
        from taskqueue.submit import read_tasks

        job = args.job.read_bytes() if args.job else None
        encoded = read_tasks(args.tasks)
    else:
        job = check_job_file(args.job) if args.job else None
        encoded, _ = tasks_module.read_tasks(args.tasks)
    store = open_store(queue)
    if job is None:
        _require_job(store)
    report = submit(store, job, encoded)
    print(report)
    return EX_OK


def _require_job(store) -> None:
    """A submit without --job adds tasks only to a queue that has job.json: a worker claims nothing at
    a prefix without one (docs/PROTOCOL.md, "A queue is where its job is"), so the tasks would wait forever."""
    from extract.errors import BadInput
    from objectstore.base import NotFound
    from taskqueue import layout

    try:
        store.read(layout.JOB)
    except NotFound:
        raise BadInput(
            f"no job.json at {store.root_url}: pass --job JOB.json (a first submit stores it), or check the queue URL"
        ) from None


def check_job_file(path: pathlib.Path) -> bytes:
    """The job file's bytes, once `extract.job.Job` (what consume.py validates with) has accepted them."""
    import json

    from extract.errors import BadInput
    from extract.job import Job

    try:
        data = path.read_bytes()
        Job.from_dict(json.loads(data))
    except OSError as err:
        raise BadInput(f"--job: cannot read {path}: {err.strerror or err}") from None
    except ValueError as err:  # JSONDecodeError, and BadInput (a ValueError) naming the field
        raise BadInput(f"--job {path}: {err}") from None
    return data


def cmd_mirror(args) -> int:
    from extract.hub import mirror_hub_snapshot, need_hub_client, upload_model_dir  # JAX-free: the base install mirrors
    from progress import Progress
    from objectstore.address import check_address

    dest = args.dest if pathlib.Path(args.dest).is_dir() else check_address(args.dest, "DEST", directory=False)
    if not pathlib.Path(args.source).is_dir():
        need_hub_client()  # a Hub source needs the extract extra: said in one line, before any progress
    with Progress("mirror", None, "bytes") as progress:
        if pathlib.Path(args.source).is_dir():
            if args.revision:
                raise UsageError("--revision applies to hub ids, not to a local directory")
            names = upload_model_dir(args.source, dest, on_file=lambda name, size: progress.advance(size))
        else:
            names = mirror_hub_snapshot(args.source, dest, revision=args.revision,
                                        on_file=lambda name, size: progress.advance(size))
    print(f"mirrored {len(names)} files to {dest}: {' '.join(names)}")
    return EX_OK


def cmd_upload_code(args) -> int:
    from fleet import environment
    from objectstore.address import check_address

    dest = check_address(args.dest, "DEST", directory=False)
    glibc = tuple(int(part) for part in args.glibc.split(".") if part.isdigit())
    if len(glibc) != 2 or args.glibc.count(".") != 1:
        raise UsageError(f"--glibc {args.glibc!r}: expected a version such as 2.35")
    from progress import Progress

    with Progress("upload", None, "bytes") as progress:  # files the client uploads; gcloud shows its own
        environment.upload_code(
            args.source, dest, args.exclude, python_version=args.python, extras=[e for e in args.extras.split(",") if e],
            locks=None if args.no_locks else (args.lock or tuple(environment.LOCKS)), wheelhouse=args.wheelhouse,
            glibc=glibc, uv=args.uv_version, python_mirror=args.python_mirror,
            use_gcloud=False if args.no_gcloud else None, on_file=lambda name, size: progress.advance(size))
    return EX_OK


# -- the parser -----------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gcs-spawner", description=__doc__.split("\n\n")[0],
                                     epilog="Run `gcs-spawner COMMAND --help` for a command's flags. docs/CLOUD.md "
                                            "walks through a run.", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log every event (key=value lines on stderr)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func, help_text: str, description: str | None = None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=description or help_text)
        p.set_defaults(func=func)
        return p

    run_help = "the run file (run.yaml; docs/schema/run.json)"
    p = command("plan", cmd_plan, "what the run will cost: tokens, FLOPs, hours, $, TB, on every accelerator it allows",
                "What the run will cost: tokens, FLOPs, hours, $, TB, on every accelerator it allows. With "
                "--accelerator, the file is a job.json planned alone (tools/plan.py), with the flags below.")
    p.add_argument("run", type=pathlib.Path, metavar="RUN|JOB", help=f"{run_help}, or job.json with --accelerator")
    p.add_argument("--json", action="store_true", help="print the plan (and the considered resources) as JSON")
    p.add_argument("--prices", help="price table JSON (default: the run file's plan.prices, else reporting/prices.json)")
    _add_plan_flags(p)

    p = command("validate", cmd_validate, "check everything up would check, create nothing")
    p.add_argument("run", type=pathlib.Path, help=run_help)
    p.add_argument("--project", help="default: the run's project, else gcloud config")
    p.add_argument("--no-preflight", action="store_true", help="skip the roles, quotas and bucket-location checks")
    p.add_argument("--prices", help="price table JSON (default: reporting/prices.json)")

    p = command("up", cmd_up, "validate, show the plan, ask, then mirror, upload, submit and create the machines",
                "Validate the run, print its plan and the accelerators it allows, ask to proceed, then mirror the "
                "model, upload the code, submit the job and tasks, and create the template and group (VMs) or the "
                "TPU VMs. Every step is idempotent and recorded in the queue: run it again after Ctrl-C to continue.")
    p.add_argument("run", type=pathlib.Path, help=run_help)
    p.add_argument("-y", "--yes", action="store_true", help="do not ask (needed without a terminal)")
    p.add_argument("--dry-run", action="store_true", help="validate and print one line per call it would make")
    p.add_argument("--project", help="default: the run's project, else gcloud config")
    p.add_argument("--no-preflight", action="store_true", help="skip the roles, quotas and bucket-location checks")
    p.add_argument("--wait", type=float, metavar="SECONDS", help="then wait this long for the machines to be up")
    p.add_argument("--keep", action="store_true", help="TPU: then keep the fleet alive (gcs-spawner keep) until done")
    p.add_argument("--interval", type=float, default=60.0, help="with --keep: seconds between checks (default 60)")
    p.add_argument("--prices", help="price table JSON (default: reporting/prices.json)")

    p = command("add", cmd_add, "make N more machines of another spec on a run's queue, recorded like up's",
                "Make --count machines of another machine spec (a v5litepod-8 beside the run's slices, a GPU group) "
                "on the run's queue, named RUN-SPECNAME and labelled with the run, recorded in its queue before "
                "each create: status shows them, down deletes them, keep deletes the lost ones, and up leaves them "
                "alone. Checked as up checks: the zone offers the type, its price and the run's max_dollars, the "
                "code's lock, the pre-flight. Run it again to add more.")
    p.add_argument("run", type=pathlib.Path, help=run_help)
    p.add_argument("--spec", type=pathlib.Path, required=True, help="the machine spec (templates/vm.yaml, "
                                                                    "templates/tpu.yaml or a copy)")
    p.add_argument("--count", type=int, required=True, help="how many more (TPU: times the spec's slices)")
    p.add_argument("--zone", help="default: the run's first zone (a VM group: or its region)")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask (needed without a terminal)")
    p.add_argument("--dry-run", action="store_true", help="check and print one line per call it would make")
    p.add_argument("--project", help="default: the run's project, else gcloud config")
    p.add_argument("--no-preflight", action="store_true", help="skip the roles, quotas and bucket-location checks")
    p.add_argument("--prices", help="price table JSON (default: the run file's plan.prices, else reporting/prices.json)")

    p = command("down", cmd_down, "delete exactly what up made (machines, group, template, TPUs); the data stays")
    _add_target(p)
    p.add_argument("-y", "--yes", action="store_true", help="do not ask, even if the job is not complete")
    p.add_argument("--dry-run", action="store_true", help="print one line per delete it would send")
    p.add_argument("--project", help="where to look for the run's resources by its label (default: the run's "
                                     "project, its record's, else gcloud config)")

    p = command("keep", cmd_keep, "delete lost machines the cloud still has; TPU: replace preempted queued resources",
                "Every --interval seconds until the queue is complete: deletes the run's machines that status shows "
                "lost while the cloud still has them (VM group members and TPU VMs alike, each with a note saying "
                "why), and for a TPU run on queued resources replaces the preempted ones while the queue has work.")
    p.add_argument("run", type=pathlib.Path, help=run_help)
    p.add_argument("--project", help="default: the run's project, else gcloud config")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between checks (default 60)")
    p.add_argument("--once", action="store_true", help="one check, then exit")
    p.add_argument("--dry-run", action="store_true", help="list, and print the deletes and creates it would send")
    p.add_argument("--prices", help="price table JSON (default: reporting/prices.json), for max_dollars")

    p = command("status", cmd_status, "progress, holders, machines, cost and ETA of a run's queue, from listings")
    _add_target(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--estimate", nargs="?", type=int, const=8, default=None, metavar="REGIONS",
                   help="list only this many random open regions (default 8) and extrapolate")
    p.add_argument("--watch", nargs="?", type=float, const=10.0, default=None, metavar="SECONDS", help="refresh view")
    p.add_argument("--html", metavar="FILE", help="also write the status page to FILE")
    p.add_argument("--publish", action="store_true", help="also write the status page to the queue as status.html")
    p.add_argument("--prices", metavar="FILE", help="price table (default: reporting/prices.json)")
    p.add_argument("--history", action="store_true",
                   help="list swept regions' done markers too, for the completion curve (as --html does)")
    p.add_argument("--now", metavar="TIME", help="compute the view as of this UTC time (ISO 8601), e.g. for a report")
    p.add_argument("--machines", action="store_true",
                   help="list every machine, holder and stale lease, and the blockers and failure reasons status "
                        "reads (20 of a kind, with the count of the rest; the default view fits a screen)")
    p.add_argument("--cloud", action="store_true",
                   help="also list the run's resources as the cloud has them (by its label): group members, queued "
                        "resources and their states, and which lost machines still exist")
    p.add_argument("--project", help="with --cloud: default the run's project, its record's, else gcloud config")

    p = command("logs", cmd_logs, "the log tail a machine left in its record (machines/NAME.json)")
    _add_target(p)
    p.add_argument("machine", metavar="MACHINE", help="the machine's name, as status lists it")

    p = command("merge", cmd_merge, "write the job's index (index.json): every shard its done markers list, totals")
    _add_target(p)
    p.add_argument("-o", "--output", help="a local file to write, or - for stdout (default: index.json in the queue)")

    p = command("export", cmd_export, "export a job's activations to another tool's layout (SAELens)",
                "Export to SAELens's cached-activations directory: a Hugging Face datasets directory with one column "
                "named after the TransformerLens hook and token_ids, rows of exactly --context-size tokens "
                "(docs/TRAINING.md).")
    p.add_argument("source", metavar="RUN|QUEUE", help="a run file, a queue, a done marker, or a prefix of shards")
    p.add_argument("directory", help="where to write it (a local directory)")
    p.add_argument("--format", default="saelens", choices=["saelens"], help="the layout to write (default saelens)")
    p.add_argument("--layer", type=int, required=True,
                   help="hidden-state index, as in the job's layers; with --site, a decoder layer from 0")
    p.add_argument("--site", default="hidden", help="a hook site the job kept (its sites), or hidden (default)")
    p.add_argument("--context-size", type=int, default=128, help="tokens per row")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"])

    p = command("tasks", cmd_tasks, "cut a job's data files into task manifests (JSON lines), from metadata only",
                "Parquet row counts come from each file's footer; JSON lines are counted. --rows-per-task auto sizes "
                "tasks to last about --target-minutes on --accelerator at --mfu, as the planner recommends.")
    p.add_argument("job", help="job.json")
    p.add_argument("--rows-per-task", required=True, help="rows (samples) per task, or auto (needs --accelerator)")
    p.add_argument("--accelerator", help="with --rows-per-task auto: the TPU or GPU machine type, e.g. v6e-8")
    p.add_argument("--mfu", type=float, default=0.35, help="with auto: assumed MFU (default 0.35)")
    p.add_argument("--target-minutes", type=float, default=10.0, help="with auto: task length (default 10)")
    p.add_argument("--fixed-seconds", type=float,
                   help="with auto: a task's fixed seconds on a warm machine, measured (status's goodput line); "
                   "default: the platform's figure")
    p.add_argument("--sample-rows", type=int, default=1024, help="with auto: rows tokenised (default 1024)")
    p.add_argument("--model-config", help="with auto: config.json when the job's model is not local")
    p.add_argument("--tokenizer", help="with auto: tokenizer directory when the job's model is not local")
    p.add_argument("-o", "--output", required=True, help="tasks file to write (JSON Lines), or - for stdout")
    p.add_argument("--id-prefix", default="t", help="task ids are PREFIX + zero-padded index (default: t)")
    p.add_argument("--workers", type=int, default=16, help="files whose footers are read concurrently")

    p = command("submit", cmd_submit, "write job.json and the task manifests into a queue, create-only",
                "Checks the job and every manifest by the models consume.py uses, then writes them create-only. A "
                "submit that fails (a task that exists with another manifest, a store error, Ctrl-C, SIGTERM) "
                "finishes its batch before it exits. --finish-batch ID finishes a batch whose submit died with its "
                "machine (status names it).")
    _add_target(p, "the queue: gs://bucket/prefix or an existing directory (or a run file)")
    p.add_argument("--job", type=pathlib.Path, help="job.json to store at the queue root")
    p.add_argument("--tasks", type=pathlib.Path, help="JSON lines, one task manifest with an 'id' each")
    p.add_argument("--finish-batch", metavar="ID",
                   help="finish the running batch ID whose submit will never run again (status names it)")
    p.add_argument("--any-consumer", action="store_true",
                   help="the job and tasks are for a consumer other than consume.py: check only that each task is a "
                        "JSON object with an id")

    p = command("mirror", cmd_mirror, "copy a model checkpoint into a bucket (the machines read it there)")
    p.add_argument("source", help="hub id (org/name) or a local model directory")
    p.add_argument("dest", help="gs://bucket/prefix (or an existing directory)")
    p.add_argument("--revision", help="hub branch, tag or commit (default: main)")

    from_checkout = pathlib.Path(__file__).resolve().parent.parent
    p = command("upload-code", cmd_upload_code, "mirror this checkout and its locked environment to a bucket prefix",
                "Skips .git, virtualenvs, caches and what git ignores; deletes objects whose files are gone. Then "
                "compiles locks/<lock>.txt for the machines' Python and glibc, checks a wheel exists for every pin, "
                "and uploads them with uv/uv (docs/CLOUD.md, section 1).")
    p.add_argument("dest", help="gs://bucket/prefix to mirror to")
    p.add_argument("--source", type=pathlib.Path, default=from_checkout, help="default: this checkout")
    p.add_argument("--exclude", action="append", default=[], help="glob to skip as well (repeatable)")
    p.add_argument("--no-gcloud", action="store_true", help="use google-cloud-storage even if gcloud is installed")
    p.add_argument("--python", default="3.11", help="the fleet's CPython version (the spec's python; default 3.11)")
    p.add_argument("--lock", action="append", choices=("cpu", "cuda12", "tpu"), help="locks to make (default: all)")
    p.add_argument("--extras", default="extract", help="package extras the machines install (default: extract)")
    p.add_argument("--no-locks", action="store_true", help="upload the code only (machines then install unpinned)")
    p.add_argument("--wheelhouse", action="store_true", help="also upload every locked wheel (firewalled fleets)")
    p.add_argument("--glibc", default="2.35", help="the machines' glibc (default 2.35, Ubuntu 22.04's)")
    p.add_argument("--uv-version", help="the uv the machines run (default: the version of this uv)")
    p.add_argument("--python-mirror", action="store_true",
                   help="also upload the fleet's CPython archive as that uv downloads it (firewalled fleets)")
    return parser


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a job planned alone (reporting/planflags.py: argparse only, so --help stays light)."""
    from reporting.planflags import add_job_arguments

    add_job_arguments(p)


#: The extra (setup.cfg extras_require) that brings each module a command may need beyond the base install
#: (`pip install .`): a command that reaches one without it says so in one line instead of a traceback.
EXTRA_OF = {
    **dict.fromkeys(("jax", "jaxlib", "flax", "transformers", "tokenizers", "datasets", "huggingface_hub",
                     "safetensors", "pyarrow"), "extract"),
    "ml_dtypes": "train", "matplotlib": "status",
}  # fmt: skip


def missing_extra(err: BaseException) -> str | None:
    """The one line for a module of an extra that this install lacks; None for any other error."""
    root = (getattr(err, "name", None) or "").split(".")[0]
    if not isinstance(err, ModuleNotFoundError) or root not in EXTRA_OF:
        return None
    return (f"this command needs {root}, which the base install does not have: pip install "
            f"'gcs-spawner[{EXTRA_OF[root]}]' (or, in a checkout, pip install -e '.[{EXTRA_OF[root]}]')")


def _error(prog: str, err: BaseException) -> None:
    print(f"{prog}: error: {err}", *getattr(err, "__notes__", ()), sep="\n", file=sys.stderr)


def _misspelt_verb(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """A first word that is no verb, said with the verbs nearest to it (exit 2), rather than argparse's list of all
    of them."""
    import difflib

    words = [a for a in argv if a not in ("-v", "--verbose")]
    verbs = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if not words or words[0].startswith("-") or words[0] in verbs:
        return
    near = difflib.get_close_matches(words[0], list(verbs), n=3, cutoff=0.5)
    parser.print_usage(sys.stderr)
    print(f"gcs-spawner: error: {words[0]!r} is not a verb" + (f"; did you mean {' or '.join(near)}?" if near else
          f"; the verbs: {', '.join(verbs)}"), file=sys.stderr)
    raise SystemExit(EX_USAGE)


def main(argv: list[str] | None = None) -> int:
    prog = "gcs-spawner"
    parser = build_parser()
    _misspelt_verb(parser, sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)  # exits 2 on a usage error, 0 after --help
    _setup_logging(args.verbose)
    if args.command in ("up", "add", "submit", "mirror", "upload-code", "keep", "down"):
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        return args.func(args)
    except UsageError as err:
        parser.print_usage(sys.stderr)
        _error(f"{prog} {args.command}", err)
        return EX_USAGE
    except KeyboardInterrupt as err:
        print(f"{prog} {args.command}: interrupted ({str(err) or 'Ctrl-C'}); what was done is kept: run the same command "
              "again to continue", *getattr(err, "__notes__", ()), sep="\n", file=sys.stderr)
        return EX_FAILED
    except Exception as err:  # noqa: BLE001 - failed() re-raises what is a bug, with its traceback
        return failed(f"{prog} {args.command}", err)


def failed(prog: str, err: Exception) -> int:
    """Print `err` as one line (with its notes) and return its exit code: 65 for input that cannot work, 1 for a
    step that failed (or was not confirmed), 2 for a question that could not be asked; a missing credential is the
    one line saying how to log in. Anything else is a bug: re-raised, traceback and all."""
    from gcs_spawner.cloud import Declined

    if isinstance(err, Declined):
        _error(prog, err)
        return EX_USAGE if err.cannot_ask else EX_FAILED
    extra = missing_extra(err)
    if extra:
        _error(prog, extra)
        return EX_FAILED
    login = _credentials(err)
    if login:
        _error(prog, login)
        return EX_FAILED
    # Each error type says what a command that ends on it exits with (its `exit_code`: 65 for input that cannot
    # work, 1 for a step the cloud, the store or the network failed); an OSError is a failed step too.
    code = getattr(type(err), "exit_code", EX_FAILED if isinstance(err, OSError) else None)
    if code is None:
        raise err
    _error(prog, err)
    return code


def _credentials(err: BaseException) -> str | None:
    """The one line saying how to log in, when `err` comes from missing or refused credentials."""
    if "google.auth" not in sys.modules:
        return None
    from fleet.gapi import credentials_problem

    return credentials_problem(err)


def tool(name: str, argv: list[str] | None = None) -> int:
    """tools/<old name>.py: the subcommand `name`, with the tool's arguments."""
    return main([name, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

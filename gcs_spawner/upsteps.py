"""`up`'s steps that make what the run needs besides its machines, each idempotent: the model's mirror, the code and
its environment, the job and its tasks (submitted in batches of SUBMIT_CHUNK). Each takes the run's `UpState`
(gcs_spawner/upstate.py) and, with `dry_run`, prints one line per call it would make."""

from __future__ import annotations

import logging
import pathlib

from gcs_spawner import checks
from progress import Progress

log = logging.getLogger("gcs_spawner")

#: Tasks per submit call: each call is one batch (its marker, its regions), and the progress moves per call.
SUBMIT_CHUNK = 2000


# -- mirror --------------------------------------------------------------------------------------------------

def mirror(state) -> None:
    from objectstore import NotFound, open_store

    run, mirror = state.run, state.run.job.model
    source = run.model_source
    try:
        open_store(mirror).read("config.json")
        mirrored = True
    except NotFound:
        mirrored = False
    if mirrored or source is None:
        state.done("mirror")
        return
    if state.dry_run:
        state.would(f"mirror the model {source} into {mirror}")
        state.done("mirror")
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
    state.done("mirror")

# -- 5. code -------------------------------------------------------------------------------------------------

def code(state) -> None:
    from fleet import environment

    code = state.run.fields.code
    if not code.upload:
        state.done("code")
        return
    lock = environment.LOCK_OF_PLATFORM[state.run.platform]
    if state.dry_run:
        state.would(f"upload {state.run.code_source} to {code.url}"
                   + (f" with locks/{lock}.txt and uv/uv" if code.environment else ""))
        state.done("code")
        return
    with Progress("code", None, "bytes") as progress:  # files the client uploads; gcloud shows its own
        environment.upload_code(
            state.run.code_source, code.url, code.exclude, python_version=state.run.spec.python,
            extras=state.run.spec.extras, locks=(lock,) if code.environment else None, wheelhouse=code.wheelhouse,
            python_mirror=code.python_mirror, on_file=lambda name, size: progress.advance(size))
    checks.code_environment(state.run)
    state.done("code")

# -- 6. submit -----------------------------------------------------------------------------------------------

def submit(state) -> None:
    from taskqueue.submit import submit as submit_tasks

    if state.dry_run:
        batches = -(-len(state.tasks) // SUBMIT_CHUNK)
        state.would(f"submit {state.store.url('job.json')} and {len(state.tasks)} task{'s' if len(state.tasks) != 1 else ''} "
                   f"(create-only, {batches} batch{'es' if batches != 1 else ''})")
        state.done("submit")
        return
    created = existing = 0
    with Progress("submit", len(state.tasks), "tasks") as progress:
        for start in range(0, max(1, len(state.tasks)), SUBMIT_CHUNK):
            chunk = state.tasks[start:start + SUBMIT_CHUNK]
            # A done batch of the first chunk means its job.json was created before it (taskqueue.submit).
            if chunk and _submitted(state, chunk):
                existing += len(chunk)
            else:
                report = submit_tasks(state.store, state.run.job_bytes if start == 0 else None, chunk)
                created, existing = created + report.created, existing + report.existing
            progress.advance(len(chunk))
    state.report.submitted = {"created": created, "existing": existing, "tasks": len(state.tasks)}
    log.info("event=submitted run=%s created=%d already_existed=%d", state.run.name, created, existing)
    state.done("submit")

def _submitted(state, chunk: list[tuple[str, bytes]]) -> bool:
    """Whether an earlier `up` submitted this chunk whole: its batch marker (named from its ids) is `done` and
    did not give up (docs/PROTOCOL.md, "Batches"). One listing instead of a create per task; a marker pruned
    since (10 minutes after) only means the chunk is submitted again, creating nothing."""
    from taskqueue import layout
    from taskqueue.submit import batch_name

    name = batch_name(task_id for task_id, _ in chunk)
    entry = next((e for e in state.store.list_page(name, page_size=1).entries if e.name == name), None)
    return (entry is not None and entry.metadata.get("state") == layout.BATCH_DONE
            and not {"gave_up", "refused"} & set(entry.metadata))

"""Seeded worlds: what a seed draws, and running one (whole workers, submitters and status on one
simulated store, checked against every invariant).

In the spirit of FoundationDB's simulator and TigerBeetle's VOPR, the code under test is the
production code: `Claimer`, `HeldLease`, `submit`, `finish`-ing batches, `reporting.status.snapshot`,
the worker core (`taskqueue.worker.TaskRun`, the same decisions `taskqueue.spawner` makes) and the
store's retry loop and ambiguous-write rule (`objectstore.retry`). Around them a simulated world on
virtual time (`tests.simworld.scheduler`, `tests.simworld.store`) and a scripted consumer in place
of the subprocess. One seed decides everything, so a failure replays exactly
(`python -m bench.sim_seeds --seed N --verbose`). Every knob is passed in: the store's page limit,
the claim loop's `ClaimOptions` (cached regions, batch keep time), the submit's executor, region
size and keep time.

What a seed draws:
- a few workers (each with a clock that runs a few percent fast or slow; while a VM is suspended its
  actors do not run, and its clock either counts the suspension, as taskqueue.clock's does on Linux,
  or stands still, as CLOCK_MONOTONIC does), tens of tasks,
  regions of a few tasks, and listing pages of a few entries in half the worlds, so that the region
  map spans several pages as a million-task queue's does; in half the worlds the workers cache 2 or 3
  regions instead of 8, so that their view drops regions all the time;
- store faults during a chaos window: transient errors (some outages outlast the retry deadline),
  ambiguous writes (applied, then the response lost, or returned late), timeouts after which the
  store applies the write anyway (before the client's retry, or after it gave up), non-transient
  errors (403, an expired credential) on any call; a lifecycle rule moving objects' `updated` times;
- machines killed at any request or at any moment (requests in flight are applied after), SIGTERM and
  preemption at any time, suspensions, replacements booting after them;
- each attempt's consumer: outputs written, then exit 0, 1 or 65, a crash, or a hang (the stuck-task
  backstop stops it), and how it answers SIGTERM; in half the worlds the consumer is resident
  (`spawn.py --resident`): one process per worker serves its tasks while the worker core lets it
  (`TaskRun.consumer_stays`), and now and then dies between tasks (no consumer's start-up is timed: a
  resident world runs as its per-task twin would, so the seeds that found bugs replay the same worlds);
- late submissions of any size, before the first split, into existing regions and after the last,
  while workers run, wait or leave, their creates in flight together on a pool of 1 to 16; a
  submitter killed at any point, interrupted once or twice (Ctrl-C, SIGTERM) at any point, and one
  refused because a task of its batch exists with another manifest. What status tells their operator
  is done: a submit that died, failed or was left running is run again (the same command), a refused
  task is submitted again under a new id;
- `reporting.status.snapshot` at random times, on the same faulty store, some suspended midway;
- done batch markers deleted after a keep time of 30 s or two minutes, so that a world sees it;
- in a quarter of the worlds, at the end, a batch that comes and goes between the two listings of
  batches/ of a status snapshot, then of a worker's drained check, so that only layout.PRUNED tells
  (`tests.simworld.straddle`; invariants 8 and 4 see it).

The invariants every seed is checked against are in tests/simworld/invariants.py, one function each
(`invariant_1` to `invariant_10`, as docs/PROTOCOL.md numbers them). The world is built from:
- `world`: the store, the machines and their actors, and the ground truth the invariants read;
- `faults`: what goes wrong (kills, stops, suspensions, the store's faults, virtual time running away);
- `worker`: the worker's shell around the production worker core; `consumers`: scripted consumers;
- `submitters`: submit runs and their operator; `straddle`: the batch that comes and goes unseen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import random
import subprocess

from taskqueue.claims import ClaimOptions, default_poll_max
from tests.simworld.invariants import Violation
from tests.simworld.world import World

REPO = pathlib.Path(__file__).resolve().parents[2]
#: The claim loop's own cache size; worlds draw it or a smaller one.
CACHED_REGIONS = ClaimOptions.__dataclass_fields__["max_loaded_regions"].default


@dataclasses.dataclass(frozen=True)
class WorldConfig:
    """Everything a seed decides before the run; the rest is drawn as the run goes, from the same seed."""

    seed: int
    workers: int
    tasks: int
    lease_ttl_s: float
    heartbeat_s: float
    poll_max_s: float
    idle_timeout_s: float
    stuck_after_s: float
    max_attempts: int
    chaos_s: float  # faults, kills, stops and suspensions happen before this; replacements after it are fault-free
    p_transient: float
    p_lost: float
    p_late: float
    p_timeout: float  # a write the client gives up on, which the store applies later all the same
    p_forbidden: float
    outages: tuple[tuple[float, float], ...]  # (start, seconds) windows in which every request fails transiently
    retry_deadline_s: float
    p_kill: float  # chance a worker machine is killed at some request
    p_stop: float  # chance a worker gets SIGTERM or a preemption notice at some time
    p_suspend: float  # chance a worker or a status run is suspended (its clock stands still)
    late_batches: int
    cached_regions: int  # ClaimOptions.max_loaded_regions: small caches evict often
    region_tasks: int  # where submit cuts regions
    page_limit: int  # the store's most entries per listing page
    batch_keep_s: float  # done batch markers are deleted this long after
    submit_parallel: int  # a submit's creates in flight at once
    p_interrupt: float  # chance a submit gets Ctrl-C or SIGTERM (once or twice) at some moment
    lifecycle: bool  # a lifecycle rule moves objects' `updated` times now and then
    #: At the end, a batch comes and goes between the two listings of batches/ of a status snapshot, then
    #: of a worker's drained check (tests.simworld.straddle): only layout.PRUNED tells (invariants 8 and 4).
    straddle: bool = False
    #: Resident consumers (spawn.py --resident); drawn from a generator of its own, so that every other draw of
    #: a seed's world is what it was before resident consumers existed.
    resident: bool = False

    @property
    def pickup_bound_s(self) -> float:
        return 2 * self.poll_max_s + 10.0

    @classmethod
    def draw(cls, seed: int) -> "WorldConfig":
        rng = random.Random(f"config-{seed}")
        ttl = rng.choice([20.0, 30.0, 60.0])
        chaos = rng.uniform(100, 400)
        outages = tuple((rng.uniform(0, chaos), rng.choice([5.0, 20.0, 45.0])) for _ in range(rng.choice([0, 0, 1, 2])))
        return cls(
            seed=seed,
            workers=rng.randint(1, 4),
            tasks=rng.randint(1, 30),
            lease_ttl_s=ttl,
            heartbeat_s=ttl / rng.choice([3, 4]),
            poll_max_s=default_poll_max(1.0, ttl),
            idle_timeout_s=rng.choice([60.0, 150.0]),
            stuck_after_s=rng.choice([40.0, 90.0]),
            max_attempts=rng.choice([1, 2, 3]),
            chaos_s=chaos,
            p_transient=rng.choice([0.0, 0.02, 0.1]),
            p_lost=rng.choice([0.0, 0.02, 0.08]),
            p_late=rng.choice([0.0, 0.02]),
            p_timeout=rng.choice([0.0, 0.0, 0.02]),
            p_forbidden=rng.choice([0.0, 0.0, 0.005]),
            outages=outages,
            retry_deadline_s=rng.choice([10.0, 30.0]),
            p_kill=rng.choice([0.0, 0.3]),
            p_stop=rng.choice([0.0, 0.3]),
            p_suspend=rng.choice([0.0, 0.0, 0.3]),
            late_batches=rng.choice([0, 1, 2, 3, 4]),
            cached_regions=rng.choice([CACHED_REGIONS, CACHED_REGIONS, 3, 2]),
            region_tasks=rng.choice([3, 8]),
            page_limit=rng.choice([1000, 1000, 2, 4]),
            batch_keep_s=rng.choice([30.0, 120.0]),
            submit_parallel=rng.choice([1, 4, 16]),
            p_interrupt=rng.choice([0.0, 0.3]),
            lifecycle=rng.random() < 0.3,
            straddle=rng.random() < 0.25,  # drawn last: the draws before it make the same worlds as before it was
            resident=random.Random(f"resident-{seed}").random() < 0.5,
        )


@dataclasses.dataclass
class Result:
    seed: int
    violations: list[Violation]
    digest: str
    virtual_s: float
    tasks: int
    stats: dict

    @property
    def ok(self) -> bool:
        return not self.violations

    def replay_command(self) -> str:
        return f"python -m bench.sim_seeds --seed {self.seed} --verbose"


#: Seeds below this were run by hand (0 to 300,000, and 7,300,000 to 7,321,999); the moving range CI
#: runs starts above it.
FRESH_FROM = 1_000_000
FRESH_SPAN = 1_000_000_000
SOURCES = ("taskqueue", "objectstore", "reporting", "tests/simworld")  # what the fallback hashes


def moving_start(root: pathlib.Path = REPO) -> tuple[int, str]:
    """A first seed that changes with every commit, so that every CI run explores seeds no earlier
    run has, and the same commit always gets the same ones (a failure replays); and where it came
    from. Made from `git rev-parse HEAD`; outside a git checkout, from a hash of the sources the
    simulation runs; `SIM_SEED_START` sets it instead."""
    if os.environ.get("SIM_SEED_START"):
        return int(os.environ["SIM_SEED_START"]), "SIM_SEED_START"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()  # fmt: skip
        origin = f"commit {head[:12]}"
    except (OSError, subprocess.SubprocessError):
        digest = hashlib.sha256()
        for path in sorted(p for d in SOURCES for p in (root / d).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
        head, origin = digest.hexdigest(), "hash of the sources (no git checkout)"
    return FRESH_FROM + int(hashlib.sha256(head.encode()).hexdigest()[:15], 16) % FRESH_SPAN, origin


def run_seed(seed: int) -> Result:
    config = WorldConfig.draw(seed)
    world = World(config)
    try:
        world.run()
        world.check()
    except RuntimeError as exc:  # an actor raised something the world did not expect: that is a finding too
        cause = exc.__cause__ or exc
        world.violations.append(Violation(0, f"{exc}: {cause!r}"))
    return Result(seed, world.violations, world.trace.hexdigest()[:16], world.scheduler.now, len(world.existing_tasks()),
                  dict(world.stats))  # fmt: skip

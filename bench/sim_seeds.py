"""The deterministic simulation of whole workers (tests/simworld/seeds.py): run many seeds, or replay one.

    python -m bench.sim_seeds --seeds 100000 --start S --jobs 2   # many seeds; prints seeds per second
    python -m bench.sim_seeds --seed 1234 --verbose               # replay one seed, with the workers' logs

What a seed draws is in tests/simworld/seeds.py; the invariants every seed is checked against, in
tests/simworld/invariants.py.
A failing seed prints the command that replays it. The seeds CI runs: 0 to 199, and 200 from a start
that moves with the commit (`tests.simworld.seeds.moving_start`).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Iterator

from tests.simworld import world as worlds
from tests.simworld.seeds import Result, WorldConfig, run_seed


class _ActorName(logging.Filter):
    """Log lines name the simulated actor (every actor runs on the one thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduler = None

    def filter(self, record: logging.LogRecord) -> bool:
        current = self.scheduler.current if self.scheduler is not None else None
        record.actor = current.name if current is not None else "-"
        return True


def quiet() -> None:
    for noisy in ("taskqueue", "objectstore", "consumer"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)


def _quiet_seed(seed: int) -> Result:
    quiet()
    return run_seed(seed)


def _results(seed_range, jobs: int) -> Iterator[Result]:
    """Results in seed order; with `jobs` > 1 from that many processes (each seed is independent)."""
    if jobs <= 1:
        yield from map(run_seed, seed_range)
        return
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        yield from pool.map(_quiet_seed, seed_range, chunksize=16)


def replay(seed: int) -> Result:
    """One seed with its actors' logs: the scheduler is found as the world is built."""
    names = _ActorName()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(actor)s %(message)s"))
    handler.addFilter(names)
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    world_init = worlds.World.__init__

    def init(world, config):
        world_init(world, config)
        names.scheduler = world.scheduler

    worlds.World.__init__ = init  # a driver's hook for its log lines only; the world itself is untouched
    try:
        return run_seed(seed)
    finally:
        worlds.World.__init__ = world_init


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=1000, help="how many seeds to run")
    p.add_argument("--start", type=int, default=0, help="the first seed")
    p.add_argument("--seed", type=int, default=None, help="replay this one seed")
    p.add_argument("--verbose", action="store_true", help="the workers' logs (for a replay)")
    p.add_argument("--max-failures", type=int, default=20, help="stop after this many failing seeds")
    p.add_argument("--jobs", type=int, default=1, help="processes running seeds side by side")
    args = p.parse_args()
    if not args.verbose:
        logging.basicConfig(level=logging.WARNING)
        quiet()
    started = time.monotonic()
    failures: collections.Counter[int] = collections.Counter()
    ran = failing = 0
    if args.seed is not None:
        results: Iterator[Result] = iter([replay(args.seed) if args.verbose else run_seed(args.seed)])
    else:
        results = _results(range(args.start, args.start + args.seeds), args.jobs)
    for result in results:
        ran += 1
        if args.seed is not None:
            print(json.dumps({"seed": result.seed, "config": dataclasses.asdict(WorldConfig.draw(result.seed)),
                              "tasks": result.tasks, "virtual_s": round(result.virtual_s, 1), "digest": result.digest,
                              "stats": result.stats}))  # fmt: skip
        if not result.ok:
            failing += 1
            for v in result.violations:
                failures[v.invariant] += 1
            print(f"FAIL seed={result.seed} replay: {result.replay_command()}", flush=True)
            for v in result.violations[:5]:
                print(f"  {v}", flush=True)
            if failing >= args.max_failures and args.seed is None:
                break
    elapsed = time.monotonic() - started
    print(f"seeds={ran} failing={failing} by_invariant={dict(sorted(failures.items()))} seconds={elapsed:.1f} "
          f"seeds_per_s={ran / elapsed:.1f}")  # fmt: skip
    sys.exit(1 if failing else 0)


if __name__ == "__main__":
    main()

"""The phase ledger (extract/phases.py): every instant in one phase, drains that add up to the totals whatever the
cut points, and the process's own start read from the kernel."""

from __future__ import annotations

import random
import threading
import time

import pytest

from extract.phases import ATTEMPTS, PHASES, PhaseLedger, counter_name, process_age_s, summarize


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_time_goes_to_the_phase_entered_and_back_after_an_interruption():
    clock = Clock()
    ledger = PhaseLedger(started_at=97.0, clock=clock)  # the process began 3 s before the ledger
    clock.now = 101.0
    ledger.enter("weights")
    clock.now = 103.5
    ledger.enter("steady")
    clock.now = 104.0
    with ledger.during("compile"):
        clock.now = 106.0
    assert ledger.phase == "steady"
    clock.now = 107.0
    seconds = ledger.seconds()
    assert {p: s for p, s in seconds.items() if s} == {"imports": 4.0, "weights": 2.5, "steady": 1.5, "compile": 2.0}
    figures = summarize(seconds)
    assert figures["wall_s"] == 10.0 and figures["fixed_s"] == 8.5 and figures["goodput"] == pytest.approx(0.15)
    with pytest.raises(ValueError, match="phase 'loading' is not one of imports, devices"):
        ledger.enter("loading")


@pytest.mark.parametrize("seed", range(20))
def test_drains_at_any_cut_points_add_up_to_the_totals_and_count_the_attempt_once(seed):
    rng = random.Random(seed)
    clock = Clock()
    ledger = PhaseLedger(started_at=clock.now, clock=clock)
    drained: dict[str, int] = {}
    for _ in range(rng.randint(1, 40)):
        clock.now += rng.choice((0.0, 0.0004, 0.0017, 0.3, rng.uniform(0, 5)))
        if rng.random() < 0.5:
            ledger.enter(rng.choice(PHASES))
        else:
            for name, value in ledger.drain().items():
                assert value > 0
                drained[name] = drained.get(name, 0) + value
    for name, value in ledger.drain().items():
        drained[name] = drained.get(name, 0) + value
    totals = ledger.seconds()
    assert drained.pop(ATTEMPTS) == 1
    for phase in PHASES:  # whole milliseconds, never more than the truth, less by under one
        assert 0 <= totals[phase] * 1000 - drained.get(counter_name(phase), 0) < 1


def test_drains_from_another_thread_lose_nothing():
    ledger = PhaseLedger()
    drained: list[dict] = []
    done = threading.Event()

    def writer() -> None:
        while not done.is_set():
            drained.append(ledger.drain())

    thread = threading.Thread(target=writer)
    thread.start()
    for k in range(2000):
        ledger.enter(PHASES[k % len(PHASES)])
    done.set()
    thread.join()
    drained.append(ledger.drain())
    total_ms = sum(v for d in drained for k, v in d.items() if k != ATTEMPTS)
    assert 0 <= sum(ledger.seconds().values()) * 1000 - total_ms < len(PHASES)


def test_the_ledger_starts_at_the_process_start_not_at_its_creation():
    age = process_age_s()
    assert age is not None and 0 < age < 3600
    before = time.monotonic()
    ledger = PhaseLedger()
    assert ledger.seconds()["imports"] >= age - 0.05 and time.monotonic() - before < age

"""The swept rule, `taskqueue.layout.swept`: one pure function that the worker's view (`QueueView.is_swept`) and
status (`reporting.status._listed`) both feed (docs/PROTOCOL.md, "Swept regions", step 4)."""

from __future__ import annotations

from taskqueue.layout import swept

CONFIRMED = {"end": "t200", "confirmed": "1"}


def test_only_a_confirmed_marker_that_reaches_the_regions_end_sweeps_it():
    assert swept("t100", "t200", CONFIRMED, [])
    assert not swept("t100", "t200", None, [])  # no marker
    assert not swept("t100", "t200", {"end": "t200"}, [])  # its sweeper may still withdraw it
    assert not swept("t100", "t300", CONFIRMED, [])  # it covers less than the region
    assert swept("t100", None, {"end": "", "confirmed": "1"}, [])  # to the end of the keyspace
    assert not swept("t100", None, CONFIRMED, [])


def test_a_running_batch_that_meets_the_region_unsweeps_it_for_every_reader():
    for whole_marker in (False, True):
        assert not swept("t100", "t200", CONFIRMED, [("t150", "t160")], whole_marker=whole_marker)
        assert not swept("t100", "t200", CONFIRMED, [("t000", "t100")], whole_marker=whole_marker)
        assert swept("t100", "t200", CONFIRMED, [("t000", "t099")], whole_marker=whole_marker)
        assert swept("t100", "t200", CONFIRMED, [("t300", "t400")], whole_marker=whole_marker)


def test_status_which_counts_from_the_marker_needs_all_it_covers_free_of_running_batches():
    """A marker written before `submit` cut its region covers the part cut off too (its `end` is the old
    one). A batch running there leaves the region itself swept for a worker, but not for status, which
    counts the whole of what the marker covers from its counts (sim seed 11605)."""
    old = {"end": "t300", "confirmed": "1"}  # the region was [t100, t300) when swept; now cut at t200
    running = [("t250", "t260")]
    assert swept("t100", "t200", old, running)
    assert not swept("t100", "t200", old, running, whole_marker=True)
    assert swept("t100", "t200", old, [], whole_marker=True)

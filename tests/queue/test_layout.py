"""taskqueue.layout on its own: where every queue object lives, which names are task ids, what a manifest
must be, and the two rules a reader judges listings by (`swept`, `batch_unseen_between`).

Pure functions, so that mutation testing (`make mutants`) reaches every clause in milliseconds
(docs/PROTOCOL.md, "Layout", "Swept regions" and "Batches")."""

from __future__ import annotations

import datetime as dt
import json
import types

import pytest

from taskqueue import layout
from taskqueue.layout import BadManifest, batch_unseen_between, check_task_id, parse_manifest, swept

T0 = dt.datetime(2026, 11, 28, 12, 0, tzinfo=dt.timezone.utc)


def test_every_queue_object_has_its_one_name():
    assert (layout.JOB, layout.TASKS, layout.LEASES, layout.DONE, layout.FAILED, layout.OUT, layout.SPLITS, layout.SWEPT,
            layout.BATCHES) == ("job.json", "tasks/", "leases/", "done/", "failed/", "out/", "splits/", "swept/", "batches/")  # fmt: skip
    assert layout.task_object("t1") == "tasks/t1.json"
    assert layout.lease_object("t1") == "leases/t1.json"
    assert layout.done_object("t1") == "done/t1.json"
    assert layout.failed_object("t1") == "failed/t1.json"
    assert layout.split_object("t1") == "splits/t1.json"
    assert layout.batch_object("b1") == "batches/b1.json"
    assert layout.output_prefix("t1", 17) == "out/t1/17"
    assert layout.PRUNED == "batches/-pruned.json" and layout.id_from_object(layout.PRUNED, layout.BATCHES) is None
    assert (layout.BATCH_RUNNING, layout.BATCH_DONE, layout.BATCH_KEEP_S) == ("running", "done", 180.0)


def test_the_head_regions_swept_marker_has_a_name_no_task_id_can_have():
    assert layout.HEAD == "" and layout.swept_object(layout.HEAD) == "swept/-.json"
    assert layout.swept_object("t1") == "swept/t1.json"
    assert layout.region_from_swept("swept/-.json") == layout.HEAD
    assert layout.region_from_swept("swept/t1.json") == "t1"
    assert layout.region_from_swept("swept/t1.json.tmp") is None and layout.region_from_swept("done/t1.json") is None
    with pytest.raises(BadManifest):
        check_task_id("-", "here")


def test_a_listing_entry_is_a_queue_object_only_when_its_whole_name_is_prefix_id_json(monkeypatch):
    monkeypatch.setattr(layout, "_OBJECT_NAMES", {})  # from a cold cache: what the first listing of a prefix sees
    assert layout.id_from_object("tasks/t1.json", layout.TASKS) == "t1"
    assert layout.id_from_object("tasks/a.b-c_d.json", layout.TASKS) == "a.b-c_d"
    for name in ("tasks/t1.jsonx", "xtasks/t1.json", "tasks/t1", "tasks/.t1.json", "tasks/sub/t1.json", "leases/t1.json",
                 "tasks/" + "a" * 129 + ".json", "tasksXt1.json", "tasks/t1Xjson"):  # fmt: skip
        assert layout.id_from_object(name, layout.TASKS) is None, name
    assert layout.id_from_object("tasks/" + "a" * 128 + ".json", layout.TASKS) == "a" * 128
    assert layout.object_pattern("a.b/") is layout.object_pattern("a.b/")  # compiled once per prefix
    assert layout.id_from_object("aXb/t1.json", "a.b/") is None  # the prefix is literal text


def test_listings_sort_ids_by_their_object_names():
    assert layout.key("t1") == "t1.json"
    assert layout.key("t1.5") < layout.key("t1")  # `t1.5.json` sorts before `t1.json`, as the store lists them


@pytest.mark.parametrize(
    ("task_id", "ok"),
    [("t1", True), ("T", True), ("0", True), ("a" * 128, True), ("a" * 129, False), ("", False), ("_t", False),
     (".t", False), ("t/1", False), ("t 1", False), ("t1\n", False), (7, False), (None, False)],  # fmt: skip
)
def test_a_task_id_is_letters_digits_dot_dash_underscore_at_most_128_not_starting_with_a_symbol(task_id, ok):
    if ok:
        assert check_task_id(task_id, "tasks.jsonl:3") == task_id
    else:
        with pytest.raises(BadManifest) as caught:
            check_task_id(task_id, "tasks.jsonl:3")
        assert str(caught.value) == (
            "tasks.jsonl:3: field 'id' must be a string of letters, digits, '.', '_' or '-' "
            f"(at most 128, not starting with a symbol), got {task_id!r}"
        )


def test_a_manifest_is_a_json_object_of_at_most_64_kib_whose_id_is_its_objects_name():
    assert parse_manifest(b'{"id": "t1", "x": 1}', "t1", "w") == {"id": "t1", "x": 1}
    assert layout.MAX_MANIFEST_BYTES == 65536 and layout.MANIFEST_METADATA_BYTES == 4096
    padded = json.dumps({"id": "t1", "pad": ""}).encode()
    exact = json.dumps({"id": "t1", "pad": "x" * (65536 - len(padded))}).encode()
    assert len(exact) == 65536 and parse_manifest(exact, "t1", "w")["id"] == "t1"
    cases = [
        (exact + b" ", "w: manifest is 65537 bytes, over the 65536-byte limit"),
        (b"{nope", "w: manifest is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        (b"\xff\xfe", "w: manifest is not valid JSON ("),
        (b"[1]", "w: manifest must be a JSON object, got list"),
        (b'{"x": 1}', "w: manifest is missing field 'id'"),
        (b'{"id": "t2"}', "w: field 'id' is 't2' but the object is named for 't1'"),
        (b'{"id": 3}', "w: field 'id' must be a string"),
    ]
    for data, message in cases:
        with pytest.raises(BadManifest) as caught:
            parse_manifest(data, "t1", "w")
        assert str(caught.value).startswith(message), (data, str(caught.value))
        assert caught.value.__cause__ is None  # said in one line: no chained parse error


CONFIRMED = {"end": "t200", "confirmed": "1"}


def test_the_swept_rule_at_the_edges_of_a_region_and_of_what_its_marker_covers():
    assert swept("t100", "t200", {"end": "t300", "confirmed": "1"}, [])  # covers more than the region (cut since)
    assert not swept("t100", "t200", {"end": "t150", "confirmed": "1"}, [])
    assert not swept("t100", "t200", {"end": "t200", "confirmed": ""}, [])
    assert swept("t100", "t200", {"confirmed": "1"}, [])  # no `end`: it covers to the keyspace's end
    assert swept("t100", "t200", {"end": "", "confirmed": "1"}, [])
    # A batch ending exactly at the region's start meets it; one starting at its end does not.
    assert not swept("t100", "t200", CONFIRMED, [("t050", "t100")])
    assert swept("t100", "t200", CONFIRMED, [("t200", "t250")])
    assert not swept("t100", "t200", CONFIRMED, [("t199", "t250")])
    assert swept("t100", "t200", CONFIRMED, [("t000", "t050"), ("t300", "t400")])
    assert not swept("t100", "t200", CONFIRMED, [("t000", "t050"), ("t150", "t150")])


def test_the_head_region_and_the_last_region_under_running_batches():
    head = {"end": "t100", "confirmed": "1"}
    assert swept(layout.HEAD, "t100", head, [])
    assert not swept(layout.HEAD, "t100", head, [("a", "b")])  # the head starts before every id
    assert not swept(layout.HEAD, "t100", head, [("0", "A")])  # digits and capitals too
    assert swept(layout.HEAD, "t100", head, [("t100", "t200")])
    last = {"end": "", "confirmed": "1"}
    assert not swept("t100", None, last, [("z1", "z2")])  # the last region reaches the keyspace's end
    assert swept("t100", None, last, [("a", "t099")])
    assert not swept("t100", None, last, [("z1", "z2")], whole_marker=True)


def test_a_whole_marker_reaches_as_far_as_the_marker_and_no_further():
    old = {"end": "t300", "confirmed": "1"}
    assert swept("t100", "t200", old, [("t300", "t400")], whole_marker=True)  # starts where the marker ends
    assert not swept("t100", "t200", old, [("t299", "t400")], whole_marker=True)
    assert swept("t100", "t200", old, [("t250", "t260")])  # a worker judges the region alone


def mark(generation, before_s):
    return (generation, None if before_s is None else (T0 + dt.timedelta(seconds=before_s)).isoformat())


def test_a_batch_may_have_come_and_gone_unseen_only_when_pruning_since_removed_markers_newer_than_the_first_listing():
    newest = T0 + dt.timedelta(seconds=100)
    assert not batch_unseen_between(None, None, newest)  # never pruned
    assert not batch_unseen_between(mark(3, 50), mark(3, 50), newest)  # not pruned since
    assert not batch_unseen_between(mark(3, 50), None, newest)  # nothing to say: the prune mark is gone
    assert batch_unseen_between(mark(3, 50), mark(4, 101), newest)
    assert not batch_unseen_between(mark(3, 50), mark(4, 100), newest)  # deleted no newer than the first listing's newest
    assert not batch_unseen_between(mark(3, 50), mark(4, 99), newest)
    assert batch_unseen_between(None, mark(1, 99), None)  # a first listing with nothing in it knows no time
    assert batch_unseen_between(mark(3, 50), mark(4, None), newest)  # a prune mark without its time: assume the worst
    assert batch_unseen_between(None, mark(1, 101), newest)


def test_the_prune_mark_is_read_from_its_listing_entry():
    assert layout.pruned_mark(None) is None
    entry = types.SimpleNamespace(generation=5, metadata={"before": "2026-11-28T12:00:00+00:00"})
    assert layout.pruned_mark(entry) == (5, "2026-11-28T12:00:00+00:00")
    assert layout.pruned_mark(types.SimpleNamespace(generation=5, metadata={})) == (5, None)

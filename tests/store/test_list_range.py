"""Listings bounded on both sides: what lets a worker list one region of the queue in one request."""

from __future__ import annotations

from objectstore.counting import CountingStore


def test_listing_between_start_and_end_offsets_is_one_page(store):
    for k in range(12):
        store.create(f"tasks/t{k:02d}.json", b"{}")
    counted = CountingStore(store)
    names = [e.name for e in counted.list("tasks/", start_offset="tasks/t03.json", end_offset="tasks/t07.json")]
    assert names == [f"tasks/t{k:02d}.json" for k in range(3, 7)]  # start inclusive, end exclusive
    assert counted.requests == 1
    page = store.list_page("tasks/", end_offset="tasks/t02.json", page_size=5)
    assert [e.name for e in page.entries] == ["tasks/t00.json", "tasks/t01.json"] and page.next_token is None


def test_a_full_page_that_stops_at_the_end_offset_has_no_next_page(store):
    for k in range(6):
        store.create(f"done/d{k}.json", b"{}")
    page = store.list_page("done/", start_offset="done/d1.json", end_offset="done/d4.json", page_size=3)
    assert [e.name for e in page.entries] == ["done/d1.json", "done/d2.json", "done/d3.json"]
    counted = CountingStore(store)
    assert len(list(counted.list("done/", start_offset="done/d1.json", end_offset="done/d4.json"))) == 3
    assert counted.requests == 1

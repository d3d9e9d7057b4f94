"""Loading ahead's bounds (cache/warm_ahead.py), with stand-in loads: what the thread holds
untaken stays within its window past the process's asks, within the memory maps' room, and is
dropped when map_room frees the caches of compiled programs."""

import time

import pytest

from torchtpu.cache import map_room, warm_ahead


@pytest.fixture(autouse=True)
def room(monkeypatch):
    """A room of this test's own: what the thread registers with it, and its clearing; as much
    room as a fresh process has, whatever maps this one's earlier tests left (``Ahead`` lists
    no more keys than fit)."""
    limit = map_room.ROOM._limit
    fresh = map_room.Room(None if limit is None else map_room._count() + limit)
    monkeypatch.setattr(map_room, "ROOM", fresh)
    return fresh


def _ahead(n: int):
    loaded = []

    def load(key):
        loaded.append(key)
        return f"program {key}"

    ahead = warm_ahead.Ahead([f"k{i}" for i in range(n)], load)
    return ahead, loaded


def _settle(ahead, loaded, expected: int) -> None:
    """Until expected keys are loaded (or the thread ended), then a moment for one too many."""
    deadline = time.monotonic() + 30
    while len(loaded) < expected and ahead.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)


def test_the_thread_waits_for_the_process_past_its_window():
    ahead, loaded = _ahead(warm_ahead.WINDOW * 3)
    try:
        _settle(ahead, loaded, warm_ahead.WINDOW)
        assert len(loaded) == warm_ahead.WINDOW and ahead.thread.is_alive()
        assert ahead.take("k10") == "program k10"
        assert ahead.take("k10") is None  # (taken once: a second ask loads it itself)
        _settle(ahead, loaded, 11 + warm_ahead.WINDOW)
        assert len(loaded) == 11 + warm_ahead.WINDOW
        assert ahead.take("other") is None  # a key off the list moves nothing
        _settle(ahead, loaded, 11 + warm_ahead.WINDOW)
        assert len(loaded) == 11 + warm_ahead.WINDOW
        # a key the thread has not reached is the caller's, and the thread skips it
        late = f"k{20 + warm_ahead.WINDOW}"
        assert ahead.take(late) is None
        _settle(ahead, loaded, 20 + 2 * warm_ahead.WINDOW)
        assert late not in loaded and len(loaded) == 20 + 2 * warm_ahead.WINDOW
    finally:
        ahead.close()
    assert not ahead.thread.is_alive()


@pytest.mark.skipif(map_room.ROOM._limit is None, reason="no /proc/self/maps")
def test_freeing_memory_maps_drops_what_was_loaded_ahead(room):
    ahead, loaded = _ahead(warm_ahead.WINDOW * 2)
    try:
        _settle(ahead, loaded, warm_ahead.WINDOW)
        with pytest.warns(UserWarning, match="caches of compiled programs were cleared"):
            room._free(map_room._count())  # what make_room does under the reserve
        assert ahead.take("k3") is None
        ahead.thread.join(10)
        assert not ahead.thread.is_alive() and len(loaded) == warm_ahead.WINDOW
    finally:
        ahead.close()


@pytest.mark.skipif(map_room.ROOM._limit is None, reason="no /proc/self/maps")
def test_only_what_the_memory_maps_have_room_for_is_loaded(room):
    room.reserve = (room._limit - map_room._count() - 5 * room._per) // 2
    ahead, loaded = _ahead(50)
    try:
        ahead.thread.join(10)
        assert 0 < len(loaded) <= 5
    finally:
        ahead.close()

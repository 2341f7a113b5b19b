"""The on-disk cache of the schedules' peak matrices (planner/schedule_cache.py): what it gives back is what the walk
computes, and a broken, missing or disabled cache only costs the walk again."""

from __future__ import annotations

import numpy as np
import pytest

from paraplan.planner import schedule_cache, schedules

# interleaved with whole-chunk gathers (ZeRO-3, 3v + 1 columns), zb-v (3 x stages), interleaved and 1F1B
CASES = [("interleaved-1f1b", 4, 6, 24, True), ("zb-v", 4, 2, 16, False), ("interleaved-1f1b", 4, 2, 8, False),
         ("1f1b", 4, 1, 8, False)]


def _fresh(case):
    """peak_matrices of ``case`` as the walk computes it (the in-process caches and the disk left out)."""
    schedules.peak_matrices.cache_clear()
    folder = schedule_cache._folder
    schedule_cache._folder = lambda: None
    try:
        return schedules.peak_matrices(*case)
    finally:
        schedule_cache._folder = folder
        schedules.peak_matrices.cache_clear()


def _same(a, b) -> bool:
    return len(a) == len(b) and all(sa == sb and ma.shape == mb.shape and np.array_equal(ma, mb)
                                    for (sa, ma), (sb, mb) in zip(a, b, strict=True))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PARAPLAN_CACHE", str(tmp_path))
    schedule_cache._folder.cache_clear()
    schedules.peak_matrices.cache_clear()
    yield tmp_path
    schedule_cache._folder.cache_clear()
    schedules.peak_matrices.cache_clear()


@pytest.mark.parametrize("case", CASES)
def test_stored_matrices_are_the_walks(cache_dir, case):
    walked = _fresh(case)
    first = schedules.peak_matrices(*case)  # computed and stored
    assert len(list(cache_dir.glob("schedules-*/*.json"))) == 1
    schedules.peak_matrices.cache_clear()
    schedule, pp, v, m, gathers = case
    key = (schedule, pp, v, schedules.moments_micro_batches(schedule, pp, v, m, gathers), gathers)
    loaded = schedule_cache.load(key, pp)
    assert loaded is not None  # read back from disk, not recomputed
    again = schedules.peak_matrices(*case)
    assert _same(walked, first) and _same(walked, again)


def test_counts_with_the_same_moments_share_an_entry(cache_dir):
    """Micro-batch counts past the point where the moments stop changing (interleaved: multiples of p from 3p on)
    are one entry on disk, and each gets its own walk's matrices."""
    for m in (12, 16, 40):
        case = ("interleaved-1f1b", 4, 6, m, True)
        assert _same(schedules.peak_matrices(*case), _fresh(case))
    assert len(list(cache_dir.glob("schedules-*/*.json"))) == 1


def test_a_broken_entry_is_recomputed(cache_dir):
    case = CASES[0]
    walked = _fresh(case)
    schedules.peak_matrices(*case)
    (entry,) = cache_dir.glob("schedules-*/*.json")
    for text in ("{not json", "[[[2, 3], [1, 2]]]", "[]", '[[["a", 3], []]]'):
        entry.write_text(text)
        schedules.peak_matrices.cache_clear()
        assert schedule_cache.load(case, case[1]) is None
        assert _same(schedules.peak_matrices(*case), walked)


def test_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PARAPLAN_CACHE", "off")
    schedule_cache._folder.cache_clear()
    schedules.peak_matrices.cache_clear()
    try:
        assert _same(schedules.peak_matrices(*CASES[1]), _fresh(CASES[1]))
        assert schedule_cache._folder() is None
    finally:
        schedule_cache._folder.cache_clear()
        schedules.peak_matrices.cache_clear()

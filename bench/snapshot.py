"""Residency snapshots of one worker rank (issue 18): how large, how long to
take, fetch and apply, and what the bridge's own residency costs in memory.

    .venv/bin/python -m bench.snapshot            # 100,000 resident blocks, int and bytes hashes; 1 M for memory
    .venv/bin/python -m bench.snapshot --smoke    # seconds; tests/test_bench_snapshot.py runs it

Traffic: one worker rank's history from `bench.index.Traffic` (the index
benchmark's, one worker): requests of a shared system prompt (100-1,000
blocks, 64 prompts, Zipf popularity, so a worker holds some prompts twice:
copy counts) and a private tail (600-1,800 blocks); three kv_cache_groups:
0 full attention (every block on GPU, the first half offloaded to CPU),
1 sliding window of 1,024 tokens (stores every block, then removes all but
the last quarter), 2 mamba (a GPU checkpoint every 8th block, a CPU one
every 32nd). One group message per event, as the bridge publishes them.
The history is cut where the rank holds the target count of resident
entries, (group, medium, hash) with copies counted once: "blocks" below.
Hashes are 64-bit ints (vLLM's default) or 32-byte bytes (`--form`).

Measured, medians of `--runs` runs:

- size: the encoded RankSnapshot (msgpack), bytes and bytes per block, and
  its parts under the default max_payload (1 MiB less PART_OVERHEAD);
  size and take again at `--big` (1 M) blocks, one run.
- take: what the bridge's service does for a new snapshot, in a child
  process: the keeper applying its log (`catch_up`: decode and apply every
  message of the history, the worst case: a bridge that was never idle),
  `index.snapshot`, `encode_snapshot`, `split`; and the same with nothing
  left to apply (a bridge that kept up while idle, the usual case). Also
  the longest single piece, in thread CPU time, of the read and of the
  encoding as the bridge takes them on its event loop
  (`ResidencyIndex.snapshot_steps`, `encode_snapshot_steps`): what a batch
  arriving meanwhile can wait at most.
- decode and apply: `decode_snapshot` of the bytes, `ResidencyIndex.restore`
  into an empty index (what a late consumer does with it).
- fetch: a real nats-server and a real bridge (`python -m bridge run`, core
  mode) fed the same history as vLLM batches over ZMQ; a client times
  `fetch_parts` over `nc.request` (part 0 makes the bridge take a new
  snapshot; the rest are asked for by id), decode included. The bridge's
  own time per snapshot comes from its `kvbridge_snapshot_seconds_total`.
- memory: the parent writes the encoded history to a file; a child reads
  it (and keeps all of it to the end, so the index cannot grow into memory
  the process had freed), `gc.collect()`, `gc.freeze()`, reads VmRSS, has a
  ResidencyKeeper apply every message, `gc.collect()`, reads VmRSS again:
  growth / blocks (allocator slack included). A second child counts the
  same with tracemalloc (live Python allocations: what the index holds,
  without the allocator's slack). At `--blocks` and at `--big` (1 M). The
  real bridge's RSS growth over the fetch run is printed too (whole
  process: NATS and ZMQ buffers, the history's batches passing through).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import urllib.request
from collections.abc import Generator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec

from bench.index import Traffic
from bench.stats import memory_mb
from bridge.contract import Event, GroupMessage, KVEventBatch
from bridge.contract.snapshot import (
    PART_OVERHEAD,
    decode_snapshot,
    encode_snapshot,
    encode_snapshot_steps,
    fetch_parts,
    join,
    snapshot_subject,
    split,
)
from bridge.residency import ResidencyIndex

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WORKER = Traffic().worker(0)  # the one rank the history is of
DEFAULT_MAX_PAYLOAD = 1024 * 1024  # nats-server's default


@dataclass(frozen=True)
class Plan:
    blocks: int = 100_000
    big: int = 1_000_000
    runs: int = 5
    fetches: int = 7
    forms: tuple[str, ...] = ("int", "bytes")
    seed: int = 18


def smoke_plan() -> Plan:
    return Plan(blocks=3_000, big=12_000, runs=2, fetches=3)


# -- the history ----------------------------------------------------------------


def history(form: str, blocks: int, seed: int) -> list[GroupMessage]:
    """One rank's messages, cut where it first holds `blocks` entries."""
    requests = max(2, blocks // 3000 + 2)
    while True:
        messages = Traffic(seed=seed, form=form, requests=requests).messages(0, {})
        index = ResidencyIndex()
        for n, msg in enumerate(messages):
            index.apply_group(msg, 0.0)
            if index.fleet.entries >= blocks:
                return messages[: n + 1]
        requests *= 2


def encoded(messages: list[GroupMessage]) -> list[Any]:
    """The messages as the bridge hands them to its keeper (its encoder, subjects, ids)."""
    from bridge.producer.sink.encode import MessageEncoder
    from bridge.producer.sink.subjects import SubjectBook

    encoder = MessageEncoder("msgpack")
    book = SubjectBook("kv", WORKER, 0)
    return [encoder.group(msg, book, f"{WORKER}:1") for msg in messages]


def wire_batches(messages: list[GroupMessage], per_batch: int = 64) -> list[bytes]:
    """The same events as vLLM batches (the bridge makes the group messages again)."""
    enc = msgspec.msgpack.Encoder()
    events: list[Event] = [e for m in messages for e in m.events]
    return [enc.encode(KVEventBatch(ts=time.time(), events=events[i : i + per_batch], data_parallel_rank=None))
            for i in range(0, len(events), per_batch)]


# -- children ---------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 3)


def _longest_piece(steps: Generator[None, None, Any]) -> tuple[float, Any]:
    """The longest step of `steps` in thread CPU time (seconds), and what it returns."""
    clock = time.thread_time
    longest = 0.0
    while True:
        t0 = clock()
        try:
            next(steps)
        except StopIteration as done:
            return max(longest, clock() - t0), done.value
        longest = max(longest, clock() - t0)


def measure_take(form: str, blocks: int, seed: int, runs: int) -> dict[str, Any]:
    from bridge.producer.snapshot.keeper import ResidencyKeeper

    outs = encoded(history(form, blocks, seed))
    max_part = DEFAULT_MAX_PAYLOAD - PART_OVERHEAD
    phases: dict[str, list[float]] = {k: [] for k in (
        "apply_log", "snapshot", "encode", "split", "take_cold", "take_warm", "decode", "join", "restore",
        "read_piece_max", "encode_piece_max")}
    size = parts = hashes = 0
    snap_entries = 0
    for run in range(runs):
        keeper = ResidencyKeeper(WORKER, max_log_bytes=1 << 40)
        keeper.published(outs)
        t0 = time.perf_counter()
        keeper.catch_up()
        t1 = time.perf_counter()
        snap = keeper.snapshot(0)
        assert snap is not None
        t2 = time.perf_counter()
        data = encode_snapshot(snap)
        t3 = time.perf_counter()
        chunks = split(snap, data, f"run-{run}", max_part)
        t4 = time.perf_counter()
        phases["apply_log"].append(t1 - t0)
        phases["snapshot"].append(t2 - t1)
        phases["encode"].append(t3 - t2)
        phases["split"].append(t4 - t3)
        phases["take_cold"].append(t4 - t0)
        # nothing left to apply: the usual case for a bridge that keeps up while idle
        w0 = time.perf_counter()
        keeper.catch_up()
        warm = keeper.snapshot(0)
        assert warm is not None
        split(warm, encode_snapshot(warm), f"warm-{run}", max_part)
        phases["take_warm"].append(time.perf_counter() - w0)
        pieces, stepped = _longest_piece(keeper.index.snapshot_steps(WORKER, 0, now=warm.taken_at))
        assert stepped is not None and stepped.groups == warm.groups
        phases["read_piece_max"].append(pieces)
        pieces, stepped = _longest_piece(encode_snapshot_steps(warm))
        assert stepped == encode_snapshot(warm)
        phases["encode_piece_max"].append(pieces)
        d0 = time.perf_counter()
        decode_snapshot(data)
        d1 = time.perf_counter()
        got = join(chunks)
        d2 = time.perf_counter()
        fresh = ResidencyIndex()
        d3 = time.perf_counter()
        fresh.restore(got)
        d4 = time.perf_counter()
        phases["decode"].append(d1 - d0)
        phases["join"].append(d2 - d1)
        phases["restore"].append(d4 - d3)
        size, parts = len(data), len(chunks)
        snap_entries = keeper.index.store.entries
        hashes = sum(len(t.trusted) + len(t.suspect) + len(t.placeholders) for g in snap.groups for t in g.tiers)
        assert fresh.store.entries == snap_entries, "restore holds what the snapshot held"
        del keeper, fresh, got, snap, warm
        gc.collect()
    return {
        "form": form, "blocks": snap_entries, "target": blocks, "history_messages": len(outs),
        "history_bytes": sum(o.nbytes for o in outs), "hashes_listed": hashes, "runs": runs,
        "size_bytes": size, "bytes_per_block": round(size / snap_entries, 2), "parts": parts,
        "max_part_bytes": max_part, "ms": {k: _ms(v) for k, v in phases.items()},
    }


def measure_memory(path: Path, traced: bool) -> dict[str, Any]:
    """The keeper's memory (see the module's docstring) over the encoded
    history in `path` (msgpack: [headers, payload] per message)."""
    from bridge.producer.snapshot.keeper import ResidencyKeeper

    log = msgspec.msgpack.decode(path.read_bytes(), type=list[tuple[dict[str, str], bytes]])
    gc.collect()
    gc.freeze()
    if traced:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0] if traced else _rss()
    keeper = ResidencyKeeper(WORKER)
    for headers, payload in log:
        keeper.apply_payload(headers, payload)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0] if traced else _rss()
    entries = keeper.index.store.entries
    return {"blocks": entries, "distinct_hashes": keeper.index.store.hashes, "history_messages": len(log),
            "method": "tracemalloc" if traced else "rss", "growth_bytes": after - before,
            "bytes_per_block": round((after - before) / entries, 1)}


def memory(form: str, blocks: int, seed: int) -> dict[str, Any]:
    """Both memory figures, each from a child of its own."""
    outs = encoded(history(form, blocks, seed))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "history.msgpack"
        path.write_bytes(msgspec.msgpack.encode([[o.headers, o.payload] for o in outs]))
        del outs
        rss = _child("memory", form, blocks, seed, path=path)
        rss["traced"] = _child("traced", form, blocks, seed, path=path)
    rss["form"] = form
    return rss


def _child(kind: str, form: str, blocks: int, seed: int, runs: int = 1, path: Path | None = None) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.snapshot", "--child", kind, "--form", form, "--blocks", str(blocks),
            "--seed", str(seed), "--runs", str(runs)]
    if path is not None:
        argv += ["--history", str(path)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{kind} {form} {blocks} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- fetch from a real bridge --------------------------------------------------------


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def measure_fetch(form: str, blocks: int, seed: int, fetches: int) -> dict[str, Any]:
    import nats

    from bridge.apps.demo.publisher import WirePublisher
    from bridge.runtime.nats_server import NatsServerProcess
    from bridge.runtime.ports import free_port

    batches = wire_batches(history(form, blocks, seed))
    pub_port, http = free_port(), free_port()
    with NatsServerProcess() as server, tempfile.TemporaryFile() as log:
        publisher = WirePublisher(f"tcp://*:{pub_port}", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "bridge", "run", "--zmq-endpoint", f"tcp://127.0.0.1:{pub_port}", "--nats-url",
             server.url, "--worker-id", WORKER, "--http-host", "127.0.0.1", "--http-port", str(http)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
        nc = None
        try:
            with anyio.fail_after(60):
                while True:
                    try:
                        await anyio.to_thread.run_sync(_metric, http, "kvbridge_residency_entries")
                        break
                    except OSError:
                        await anyio.sleep(0.1)
            await anyio.sleep(0.5)  # subscribed to ZMQ
            rss_before = memory_mb(proc.pid)["rss_mb"]
            for batch in batches:
                publisher.publish(batch)
            await anyio.to_thread.run_sync(publisher.wait_idle)
            entries, settled = -1.0, 0
            with anyio.fail_after(120):
                while settled < 3:  # the same count three times over, nothing left to apply
                    await anyio.sleep(0.2)
                    now = await anyio.to_thread.run_sync(_metric, http, "kvbridge_residency_entries")
                    pending = await anyio.to_thread.run_sync(_metric, http, "kvbridge_residency_log_bytes")
                    settled = settled + 1 if now == entries and not pending else 0
                    entries = now
            rss_after = memory_mb(proc.pid)["rss_mb"]
            nc = await nats.connect(server.url)
            subject = snapshot_subject("kv", WORKER, 0)

            async def request(data: bytes) -> bytes:
                msg = await nc.request(subject, data, timeout=30)
                if (msg.headers or {}).get("Nats-Service-Error-Code"):
                    raise RuntimeError(f"snapshot service error: {msg.headers}")
                return msg.data

            times: list[float] = []
            sizes: list[int] = []
            parts: list[int] = []
            part_size = 0

            async def counted(data: bytes) -> bytes:
                nonlocal part_size
                got = await request(data)
                part_size = max(part_size, len(got))
                parts[-1] += 1
                sizes[-1] += len(got)
                return got

            for _ in range(fetches):
                parts.append(0)
                sizes.append(0)
                t0 = time.perf_counter()
                snap = await fetch_parts(counted)
                times.append(time.perf_counter() - t0)
            held = ResidencyIndex()
            held.restore(snap)
            taken = await anyio.to_thread.run_sync(_metric, http, "kvbridge_snapshot_seconds_total")
            return {
                "form": form, "blocks": held.fleet.entries, "bridge_entries": int(entries), "fetches": fetches,
                "max_payload": nc.max_payload, "parts": parts[-1], "largest_answer_bytes": part_size,
                "answer_bytes": sizes[-1], "fetch_ms": _ms(times), "fetch_ms_all": [round(t * 1e3, 2) for t in times],
                "bridge_take_ms": round(taken / fetches * 1e3, 3), "vllm_batches": len(batches),
                "bridge_rss_mb": {"before": rss_before, "after": rss_after},
                "bridge_rss_bytes_per_block": round((rss_after - rss_before) * 1024 * 1024 / max(1.0, entries), 1),
            }
        finally:
            if nc is not None:
                await nc.close()
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
            publisher.close()


# -- the run ------------------------------------------------------------------------


def run(plan: Plan, say: Any = print) -> dict[str, Any]:
    load0 = os.getloadavg()
    say(f"load average before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} ({os.cpu_count()} CPUs)")
    out: dict[str, Any] = {"take": {}, "take_big": {}, "fetch": {}, "memory": {}}
    for form in plan.forms:
        say(f"{form}: size, take, decode, restore at {plan.blocks:,} blocks, {plan.runs} runs ...")
        out["take"][form] = _child("take", form, plan.blocks, plan.seed, plan.runs)
        say(f"{form}: size, take, decode, restore at {plan.big:,} blocks, 1 run ...")
        out["take_big"][form] = _child("take", form, plan.big, plan.seed, 1)
        say(f"{form}: fetch from a real bridge, {plan.fetches} fetches ...")
        out["fetch"][form] = anyio.run(measure_fetch, form, plan.blocks, plan.seed, plan.fetches)
        for blocks in (plan.blocks, plan.big):
            say(f"{form}: keeper memory at {blocks:,} blocks (RSS, then tracemalloc) ...")
            out["memory"][f"{form}-{blocks}"] = memory(form, blocks, plan.seed)
    load1 = os.getloadavg()
    say(f"load average after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    result = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "plan": asdict(plan), "load_before": load0,
              "load_after": load1, **out}
    result["table"] = table(result)
    return result


def table(result: dict[str, Any]) -> str:
    lines = []
    for form, take in result["take"].items():
        ms = take["ms"]
        fetch = result["fetch"][form]
        lines += [
            f"{form} hashes: {take['blocks']:,} resident blocks ({take['hashes_listed']:,} hashes listed; "
            f"history {take['history_messages']:,} messages, {take['history_bytes']:,} bytes)",
            f"  size           {take['size_bytes']:>12,} bytes  {take['bytes_per_block']:>7} bytes/block  "
            f"{take['parts']} part(s) of <= {take['max_part_bytes']:,}",
            f"  take, cold     {ms['take_cold']:>10} ms  (apply log {ms['apply_log']} + snapshot {ms['snapshot']} + "
            f"encode {ms['encode']} + split {ms['split']})",
            f"  take, warm     {ms['take_warm']:>10} ms  (nothing left to apply)",
            f"  longest piece  {ms['read_piece_max']:>10} ms  reading, {ms['encode_piece_max']} ms encoding "
            f"(on the event loop, thread CPU time)",
            f"  decode         {ms['decode']:>10} ms  (join {ms['join']})",
            f"  restore        {ms['restore']:>10} ms  (ResidencyIndex.restore into an empty index)",
            f"  fetch          {fetch['fetch_ms']:>10} ms  (real bridge and nats-server, {fetch['parts']} part(s), "
            f"max_payload {fetch['max_payload']:,}, decode included; bridge's take {fetch['bridge_take_ms']} ms; "
            f"{fetch['blocks']:,} blocks)",
        ]
    for form, big in result["take_big"].items():
        ms = big["ms"]
        lines.append(f"{form} hashes at {big['blocks']:,} blocks (1 run): {big['size_bytes']:,} bytes "
                     f"({big['bytes_per_block']}/block, {big['parts']} parts); take cold {ms['take_cold']} ms "
                     f"(apply log {ms['apply_log']}, snapshot {ms['snapshot']}, encode {ms['encode']}), warm "
                     f"{ms['take_warm']} ms; decode {ms['decode']} ms; restore {ms['restore']} ms")
    for key, mem in result["memory"].items():
        traced = mem["traced"]
        lines.append(f"memory {key:>14}: {mem['bytes_per_block']:>7} bytes/block RSS growth, "
                     f"{traced['bytes_per_block']} traced  ({mem['growth_bytes']:,} / {traced['growth_bytes']:,} bytes "
                     f"for {mem['blocks']:,} blocks, {mem['distinct_hashes']:,} distinct hashes)")
    for form, fetch in result["fetch"].items():
        rss = fetch["bridge_rss_mb"]
        lines.append(f"bridge process {form}: RSS {rss['before']} -> {rss['after']} MiB over the history "
                     f"({fetch['bridge_rss_bytes_per_block']} bytes/block, whole process)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.snapshot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a few thousand blocks: seconds")
    ap.add_argument("--form", choices=("int", "bytes"), default=None, help="one hash form only (default both)")
    ap.add_argument("--blocks", type=int, default=None, help="resident blocks (default 100,000; smoke 3,000)")
    ap.add_argument("--big", type=int, default=None, help="resident blocks for the memory figure (default 1,000,000)")
    ap.add_argument("--runs", type=int, default=None, help="runs per figure (median)")
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--out", type=Path, default=None, help="JSON result (default bench/results/snapshot.json)")
    ap.add_argument("--child", choices=("take", "memory", "traced"), help=argparse.SUPPRESS)
    ap.add_argument("--history", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        form = args.form or "int"
        if args.child == "take":
            print(json.dumps(measure_take(form, args.blocks, args.seed, args.runs)))
        else:
            print(json.dumps(measure_memory(Path(args.history), traced=args.child == "traced")))
        return 0
    plan = smoke_plan() if args.smoke else Plan()
    overrides = {k: v for k, v in (("blocks", args.blocks), ("big", args.big), ("runs", args.runs)) if v}
    if args.form:
        overrides["forms"] = (args.form,)
    plan = Plan(**{**asdict(plan), "seed": args.seed, **overrides})
    result = run(plan, say=lambda s: print(s, file=sys.stderr, flush=True))
    print(result["table"])
    out = args.out or RESULTS / f"snapshot{'-smoke' if args.smoke else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

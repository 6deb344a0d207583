"""The residency index for a fleet, side by side with today's (issue 17).

    .venv/bin/python -m bench.index            # 1,000 workers, ~10 M entries; a few minutes
    .venv/bin/python -m bench.index --smoke    # seconds; tests/test_bench_index.py runs it

Traffic (`Traffic`): every worker rank has three kv_cache_groups (0 full
attention, 1 sliding window of 1,024 tokens = 64 blocks of 16, 2 mamba) and a
few cached requests, each a system prompt shared across the fleet (64
prompts, 100-1,000 blocks, Zipf popularity: the top ones held by hundreds of
workers) followed by a long private tail. Per request: attention holds every
block on GPU and the first half offloaded to CPU; the window group stores
every block and evicts (removes) all but the last quarter; mamba checkpoints
every 8th block on GPU and every 32nd on CPU. Hashes are 64-bit ints (vLLM's
default form) or 32-byte bytes (`--form bytes`), decoded from msgpack
per message as a subscriber gets them, so no two messages share hash objects.

Each measurement runs in a child process of its own (`--child`), so RSS is
the index's: VmRSS after ingest minus VmRSS before (the generator's transient
garbage the allocator keeps counts against the index, so the figure is an
upper bound). Ingest: wall time of `index.apply` over every message, hashes
in stores and removals per second. Queries: `longest_prefix` on 2,000-block
chains, a mix of returning requests (a worker's own request, then unseen
blocks), new requests on a shared prompt, and misses; p50/p99 over all, and
per kind.

Today's implementation (`tests.reference_index`) walks every
worker's tables for every block: it is measured at 100 workers (and 50, to
show the scaling), on the same traffic as the first 100 workers of the fleet,
and the fleet structure is measured at 100 too; both must give the same
answers on the shared queries. Its figures at 1,000 workers are its 100-worker
latency times 10 (latency is linear in workers, see the 50/100 pair); ingest
rate and bytes per entry do not depend on the fleet size.

Each child calls `gc.freeze()` after its imports, as a long-running service
should, and holds its query chains as tuples: the collector then walks what
the index and the query results add, not the interpreter's start-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bridge.contract import SCHEMA_VERSION, BlockRemoved, BlockStored, GroupMessage

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GROUPS = ((0, "full_attention", "attention"), (1, "sliding_window", "window"), (2, "mamba", "state"))
TARGETS = {"p99_ms": 1.0, "ingest_per_s": 1_000_000, "bytes_per_entry": 120}


@dataclass(frozen=True)
class Traffic:
    seed: int = 17
    form: str = "int"  # or "bytes"
    prompts: int = 64
    prompt_blocks: tuple[int, int] = (100, 1000)
    requests: int = 3  # cached requests per worker
    tail_blocks: tuple[int, int] = (600, 1800)
    chunk: int = 64  # hashes per store event, as a prefill's batch lists them
    query_blocks: int = 2000
    window_tokens: int = 1024
    block_size: int = 16

    def _rng(self, *parts: object) -> random.Random:
        return random.Random(":".join(map(str, (self.seed, *parts))))

    def _hashes(self, rnd: random.Random, n: int) -> list[Any]:
        if self.form == "bytes":
            return [rnd.randbytes(32) for _ in range(n)]
        return [rnd.getrandbits(64) for _ in range(n)]

    def prompt(self, p: int) -> list[Any]:
        rnd = self._rng("prompt", p)
        return self._hashes(rnd, rnd.randint(*self.prompt_blocks))

    def requests_of(self, w: int) -> list[tuple[int, int]]:
        """(prompt, tail length) of each cached request of worker w."""
        rnd = self._rng("worker", w)
        weights = [1 / (r + 1) for r in range(self.prompts)]
        return [(rnd.choices(range(self.prompts), weights)[0], rnd.randint(*self.tail_blocks))
                for _ in range(self.requests)]

    def request(self, w: int, r: int, prompts: dict[int, list[Any]]) -> list[Any]:
        p, tail = self.requests_of(w)[r]
        if p not in prompts:
            prompts[p] = self.prompt(p)
        return prompts[p] + self._hashes(self._rng("tail", w, r), tail)

    def worker(self, w: int) -> str:
        return f"pod-{w:04d}"

    def messages(self, w: int, prompts: dict[int, list[Any]]) -> list[GroupMessage]:
        """Worker w's whole history, one group message per event."""
        out: list[GroupMessage] = []
        seq = 0
        c = self.chunk

        def send(group: int, event: BlockStored | BlockRemoved) -> None:
            nonlocal seq
            seq += 1
            _, kind, family = GROUPS[group]
            out.append(GroupMessage(v=SCHEMA_VERSION, worker=self.worker(w), dp_rank=0, epoch=1, seq=seq,
                                    ts=float(seq), group=group, kind=kind, family=family, kind_source="event",
                                    events=[event]))

        def store(group: int, medium: str, hashes: list[Any]) -> None:
            _, kind, _ = GROUPS[group]
            for a in range(0, len(hashes), c):
                # vLLM names the block before a store's first (None: the request's first block)
                parent = hashes[a - 1] if a else None
                send(group, BlockStored(block_hashes=hashes[a:a + c], parent_block_hash=parent, token_ids=[],
                                        block_size=self.block_size, lora_id=None, medium=medium, lora_name=None,
                                        group_idx=group, kv_cache_spec_kind=kind,
                                        kv_cache_spec_sliding_window=self.window_tokens if group == 1 else None))

        for r in range(self.requests):
            chain = self.request(w, r, prompts)
            n = len(chain)
            store(0, "GPU", chain)
            store(1, "GPU", chain)
            store(2, "GPU", chain[7::8])
            store(0, "CPU", chain[:n // 2])
            for h in chain[31::32]:  # one state per offloaded chunk
                send(2, BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=self.block_size,
                                    lora_id=None, medium="CPU", lora_name=None, group_idx=2, kv_cache_spec_kind="mamba"))
            gone = chain[:n - n // 4]  # the window group frees what fell out of its window
            for a in range(0, len(gone), c):
                send(1, BlockRemoved(block_hashes=gone[a:a + c], medium="GPU", group_idx=1))
        return out

    def queries(self, n: int, workers: int) -> list[tuple[str, list[Any]]]:
        rnd = self._rng("queries", workers)
        prompts: dict[int, list[Any]] = {}
        out = []
        weights = [1 / (r + 1) for r in range(self.prompts)]
        for q in range(n):
            x = rnd.random()
            if x < 0.5:
                kind = "returning"
                head = self.request(rnd.randrange(workers), rnd.randrange(self.requests), prompts)
            elif x < 0.9:
                kind = "shared"
                p = rnd.choices(range(self.prompts), weights)[0]
                if p not in prompts:
                    prompts[p] = self.prompt(p)
                head = prompts[p]
            else:
                kind = "miss"
                head = []
            head = head[:self.query_blocks]
            chain = head + self._hashes(self._rng("unseen", q), self.query_blocks - len(head))
            out.append((kind, chain))
        return out


def smoke_traffic() -> Traffic:
    return Traffic(prompts=8, prompt_blocks=(10, 60), requests=2, tail_blocks=(20, 120), chunk=16, query_blocks=200)


def _rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * len(s) + 0.5)) - 1))]


def _latency(values_s: list[float]) -> dict[str, Any]:
    return {"n": len(values_s), "p50_ms": round(_pct(values_s, 0.5) * 1e3, 4),
            "p99_ms": round(_pct(values_s, 0.99) * 1e3, 4), "max_ms": round(max(values_s) * 1e3, 4)}


def _digest(matches: list[Any]) -> list[Any]:
    return [[m.worker, m.dp_rank, m.blocks, m.stale, sorted(m.limits.items())] for m in matches]


def measure(impl: str, workers: int, traffic: Traffic, n_queries: int, n_answers: int) -> dict[str, Any]:
    """One implementation at one fleet size (run in a child process)."""
    if impl == "fleet":
        from bridge.residency.index import ResidencyIndex as Index
    else:
        from tests.reference_index import ReferenceIndex as Index  # type: ignore[assignment]
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(list[GroupMessage])
    index = Index()
    prompts: dict[int, list[Any]] = {}
    for p in range(traffic.prompts):
        prompts[p] = traffic.prompt(p)
    # What a long-running service does after start-up: the interpreter's own
    # objects (tens of thousands, from imports) leave the collector's sight,
    # so a full collection costs what the index and the queries add.
    gc.collect()
    gc.freeze()
    rss0 = _rss_bytes()
    hashes = 0
    apply_s = 0.0
    for w in range(workers):
        # decoded per worker: fresh hash objects, as a subscriber gets them
        batch = decoder.decode(encoder.encode(traffic.messages(w, prompts)))
        hashes += sum(len(e.block_hashes) for m in batch for e in m.events)
        apply = index.apply
        t0 = time.perf_counter()
        for m in batch:
            apply(m)
        apply_s += time.perf_counter() - t0
        del batch
    prompts.clear()
    gc.collect()
    rss1 = _rss_bytes()
    entries = sum(len(t) for v in index.views.values() for g in v.groups.values()
                  for layer in (g.trusted, g.suspect) for t in layer.values()) if impl == "reference" else \
        index.fleet.entries
    queries = [(kind, tuple(chain)) for kind, chain in traffic.queries(n_queries, workers)]
    gc.collect()  # tuples of ints and bytes leave the collector's sight
    lat: dict[str, list[float]] = {}
    answers = []
    clock = time.perf_counter
    for q, (kind, chain) in enumerate(queries):
        t0 = clock()
        got = index.longest_prefix(chain)
        dt = clock() - t0
        lat.setdefault(kind, []).append(dt)
        if q < n_answers:
            answers.append(_digest(got))
    out: dict[str, Any] = {
        "impl": impl, "workers": workers, "entries": entries, "hashes_ingested": hashes,
        "ingest_s": round(apply_s, 3), "ingest_per_s": round(hashes / apply_s),
        "rss_before_mb": round(rss0 / 2**20, 1), "rss_after_mb": round(rss1 / 2**20, 1),
        "bytes_per_entry": round((rss1 - rss0) / max(entries, 1), 1),
        "longest_prefix": _latency([x for v in lat.values() for x in v]),
        "by_kind": {k: _latency(v) for k, v in sorted(lat.items())},
        "answers": answers,
    }
    # The same queries with the built index out of the collector's sight too
    # (a service that calls gc.freeze() after catching up): the difference is
    # the full collections the queries' own objects trigger over the index.
    gc.collect()
    gc.freeze()
    frozen = []
    for _, chain in queries:
        t0 = clock()
        index.longest_prefix(chain)
        frozen.append(clock() - t0)
    gc.unfreeze()
    out["longest_prefix_frozen"] = _latency(frozen)
    if impl == "fleet":
        fleet = index.fleet
        hits = []
        for _, chain in queries:
            t0 = clock()
            fleet.prefix_hits(chain)
            hits.append(clock() - t0)
        t0 = clock()
        counts = fleet.resident_counts()
        shared = fleet.hash_counts()
        out["counts_ms"] = round((clock() - t0) * 1e3, 2)
        out["prefix_hits"] = _latency(hits)
        out["distinct_hashes"] = fleet.hashes
        out["tiers"] = [c._asdict() for c in shared]
        out["resident_rows"] = len(counts)
    return out


def _child(impl: str, workers: int, traffic: Traffic, n_queries: int, n_answers: int) -> dict[str, Any]:
    argv = [sys.executable, "-m", "bench.index", "--child", impl, "--workers", str(workers),
            "--queries", str(n_queries), "--answers", str(n_answers), "--traffic", json.dumps(asdict(traffic))]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{impl} at {workers} workers failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@dataclass
class Plan:
    traffic: Traffic
    fleet_workers: int
    ref_workers: list[int]  # the largest is also run with the fleet structure, for agreement
    fleet_queries: int
    ref_queries: int
    answers: int
    runs: dict[str, Any] = field(default_factory=dict)


def run(plan: Plan, say: Any = print) -> dict[str, Any]:
    small = max(plan.ref_workers)
    load0 = os.getloadavg()
    say(f"load average before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    runs: dict[str, Any] = {}
    say(f"fleet structure, {plan.fleet_workers} workers ...")
    runs["fleet"] = _child("fleet", plan.fleet_workers, plan.traffic, plan.fleet_queries, 0)
    say(f"fleet structure, {small} workers ...")
    runs["fleet_small"] = _child("fleet", small, plan.traffic, plan.ref_queries, plan.answers)
    for w in sorted(plan.ref_workers):
        say(f"today's index, {w} workers ...")
        runs[f"reference_{w}"] = _child("reference", w, plan.traffic, plan.ref_queries, plan.answers if w == small else 0)
    load1 = os.getloadavg()
    say(f"load average after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    ref = runs[f"reference_{small}"]
    agree = runs["fleet_small"]["answers"] == ref["answers"]
    scale = plan.fleet_workers / small
    fleet = runs["fleet"]
    summary = {
        "longest_prefix_p50_ms": fleet["longest_prefix"]["p50_ms"],
        "longest_prefix_p99_ms": fleet["longest_prefix"]["p99_ms"],
        "ingest_per_s": fleet["ingest_per_s"],
        "bytes_per_entry": fleet["bytes_per_entry"],
        "reference_p50_ms_scaled": round(ref["longest_prefix"]["p50_ms"] * scale, 3),
        "reference_p99_ms_scaled": round(ref["longest_prefix"]["p99_ms"] * scale, 3),
        "answers_agree": agree,
        "answers_compared": len(ref["answers"]),
        "targets": {
            "p99_ms": fleet["longest_prefix"]["p99_ms"] <= TARGETS["p99_ms"],
            "ingest_per_s": fleet["ingest_per_s"] >= TARGETS["ingest_per_s"],
            "bytes_per_entry": fleet["bytes_per_entry"] <= TARGETS["bytes_per_entry"],
        },
    }
    for r in runs.values():
        r.pop("answers", None)
    result = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "plan": {
        "traffic": asdict(plan.traffic), "fleet_workers": plan.fleet_workers, "ref_workers": plan.ref_workers,
        "fleet_queries": plan.fleet_queries, "ref_queries": plan.ref_queries},
        "load_before": load0, "load_after": load1, "runs": runs, "summary": summary}
    result["table"] = table(result)
    return result


def table(result: dict[str, Any]) -> str:
    runs = result["runs"]
    plan = result["plan"]
    big = runs["fleet"]
    small_w = max(plan["ref_workers"])
    fs = runs["fleet_small"]
    ref = runs[f"reference_{small_w}"]
    scale = plan["fleet_workers"] / small_w
    lines = []

    def row(name: str, a: Any, b: Any, c: Any, d: Any, ratio: str, target: str) -> None:
        lines.append(f"{name:<24}{a:>13}{b:>13}{c:>13}{d:>17}{ratio:>9}  {target}")

    def ms(x: float) -> str:
        return f"{x:,.3f}" if x < 100 else f"{x:,.0f}"

    fw = plan["fleet_workers"]
    row("", f"fleet {fw}", f"fleet {small_w}", f"today {small_w}", f"today {fw} (x{scale:g})", "ratio", "target")
    row("entries", f"{big['entries']:,}", f"{fs['entries']:,}", f"{ref['entries']:,}", "", "", "")
    for q in ("p50_ms", "p99_ms"):
        r = ref["longest_prefix"][q] * scale
        row(f"longest_prefix {q[:3]} ms", ms(big["longest_prefix"][q]), ms(fs["longest_prefix"][q]),
            ms(ref["longest_prefix"][q]), ms(r), f"{r / big['longest_prefix'][q]:,.0f}x",
            "<= 1 ms" if q == "p99_ms" else "")
    for kind, lat in big["by_kind"].items():
        r = ref["by_kind"].get(kind, {}).get("p99_ms")
        small = fs["by_kind"].get(kind)
        row(f"  {kind} p99 ms", ms(lat["p99_ms"]), ms(small["p99_ms"]) if small else "-",
            ms(r) if r is not None else "-", ms(r * scale) if r is not None else "-", "", "")
    for q in ("p50_ms", "p99_ms"):
        r = ref["longest_prefix_frozen"][q] * scale
        row(f"  index frozen {q[:3]} ms", ms(big["longest_prefix_frozen"][q]), ms(fs["longest_prefix_frozen"][q]),
            ms(ref["longest_prefix_frozen"][q]), ms(r), f"{r / big['longest_prefix_frozen'][q]:,.0f}x", "")
    for q in ("p50_ms", "p99_ms"):
        row(f"prefix_hits {q[:3]} ms", ms(big["prefix_hits"][q]), ms(fs["prefix_hits"][q]), "-", "-", "", "")
    row("ingest hashes/s", f"{big['ingest_per_s']:,}", f"{fs['ingest_per_s']:,}", f"{ref['ingest_per_s']:,}",
        f"{ref['ingest_per_s']:,}", f"{big['ingest_per_s'] / ref['ingest_per_s']:.2f}x", ">= 1,000,000")
    row("RSS bytes / entry", f"{big['bytes_per_entry']:,}", f"{fs['bytes_per_entry']:,}", f"{ref['bytes_per_entry']:,}",
        f"{ref['bytes_per_entry']:,}", f"{big['bytes_per_entry'] / ref['bytes_per_entry']:.2f}x", "<= 120")
    row("RSS after ingest MiB", f"{big['rss_after_mb']:,}", f"{fs['rss_after_mb']:,}", f"{ref['rss_after_mb']:,}", "",
        "", "")
    extra = [k for k in runs if k.startswith("reference_") and k != f"reference_{small_w}"]
    for k in extra:
        r = runs[k]
        lines.append(f"today's index at {r['workers']} workers: longest_prefix p50 {ms(r['longest_prefix']['p50_ms'])} ms, "
                     f"p99 {ms(r['longest_prefix']['p99_ms'])} ms ({r['entries']:,} entries)")
    s = result["summary"]
    lines.append(f"answers: fleet structure and today's index {'agree' if s['answers_agree'] else 'DIFFER'} "
                 f"on {s['answers_compared']} queries at {small_w} workers")
    lines.append(f"fleet {fw}: {big['distinct_hashes']:,} distinct hashes, aggregate counts read in {big['counts_ms']} ms")
    lb, la = result["load_before"], result["load_after"]
    lines.append(f"load average (1/5/15 min): before {lb[0]:.2f} {lb[1]:.2f} {lb[2]:.2f}, "
                 f"after {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.index", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a few workers and short chains: seconds")
    ap.add_argument("--form", choices=("int", "bytes"), default="int", help="hash form of the traffic")
    ap.add_argument("--workers", type=int, default=None, help="fleet size (default 1000; smoke 12)")
    ap.add_argument("--queries", type=int, default=None)
    ap.add_argument("--answers", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON result (default bench/results/index-<form>.json)")
    ap.add_argument("--child", choices=("fleet", "reference"), help=argparse.SUPPRESS)
    ap.add_argument("--traffic", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        t = json.loads(args.traffic)
        traffic = Traffic(**{k: tuple(v) if isinstance(v, list) else v for k, v in t.items()})  # type: ignore[arg-type]
        print(json.dumps(measure(args.child, args.workers, traffic, args.queries, args.answers)))
        return 0
    if args.smoke:
        plan = Plan(Traffic(**{**asdict(smoke_traffic()), "form": args.form}), args.workers or 12, [6, 12],
                    args.queries or 40, 20, 20)
    else:
        plan = Plan(Traffic(form=args.form), args.workers or 1000, [50, 100], args.queries or 2000, 24, 24)
    result = run(plan, say=lambda s: print(s, file=sys.stderr, flush=True))
    print(result["table"])
    out = args.out or RESULTS / f"index-{args.form}{'-smoke' if args.smoke else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if result["summary"]["answers_agree"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m bench.hotpath`: the bridge's per-batch work alone, A/B against another tree.

What kv-bridge does to every batch between ZMQ and the NATS socket, without
either: decode (`BatchDecoder`, msgpack relay), normalize (`Normalizer`) and
encode each group message (`MessageEncoder`), and with `--keep` what the
snapshot keeper then does with them (`ResidencyKeeper`: log each message and
apply it to the rank's residency: from its payload, as in a burst, or with
`--bodies` from the struct the encoder made, each batch's write applied at
once, as while the relay keeps up),
over the benchmark's traffic
(bench/traffic.py) in map form and in array form. Each (tree, encoding) runs
in its own process, so a tree's own `bridge` package is the one imported.

Two figures per cell:
  ns/event  wall time, median of interleaved repeats (noisy on a busy machine)
  Ir/event  instructions counted by valgrind's callgrind: the same for the same
            code and input whatever else the machine does; a run with no
            rounds is subtracted, so imports and set-up do not count

`--ref-src TREE` adds the same cells for another source tree (its root), e.g.
a git worktree of the commit before a change. `--stages` also counts the
instructions of each stage: runs that stop after decode, after normalize
(and with `--keep` after encode), each stage's figure the difference from
the run before. Figures go to
bench/results/hotpath.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.traffic import cached

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

# Runs with the tree under test as the working directory, so `import bridge`
# takes that tree's package; it reads the traffic without bench/ (which differs
# between trees) and uses only names every tree has had.
CHILD = r"""
import inspect, itertools, json, sys, time
import msgspec
from bridge.producer.decode.decoder import BatchDecoder
from bridge.producer.normalize.normalizer import KindBook, Normalizer, NormalizeStats, StreamIdentity
from bridge.producer.sink.encode import MessageEncoder
from bridge.producer.sink.subjects import SubjectBook
from bridge.producer.snapshot.keeper import ResidencyKeeper

path, size, rounds, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
upto = int(sys.argv[5])  # stages run: 1 decode, 2 and normalize, 3 and encode, 4 and keep
pools = msgspec.msgpack.decode(open(path, "rb").read())
pool = next(p for p in pools if p[0] == size)
payloads, events = pool[1], sum(pool[2])
decoder = BatchDecoder(relay=True)
normalizer = Normalizer(KindBook({}), False)
encoder = MessageEncoder("msgpack")
subjects = SubjectBook("kv", "bench", 0)
ident = StreamIdentity(worker="bench", dp_rank=0, topic="", epoch=1)
stats = NormalizeStats()
keeper = ResidencyKeeper("bench")
# The keeper takes the structs the encoder made (a tree whose encoder cannot
# hand them over: their payloads, and the output says so).
bodies = sys.argv[6] == "1" and "keep_body" in inspect.signature(encoder.group).parameters
kept = {"keep_body": True} if bodies else {}
# With structs, each batch is a write of one batch to an idle relay, which
# the keeper applies at once (a tree whose keeper is not told how many
# batches a write held: logged, then applied by the catch-up).
at_once = bodies and "write_batches" in inspect.signature(keeper.published).parameters
writes = applied_at_once = 0

# Each round's batches come after the last round's, as a publisher cycling
# its traffic sends them: a keeper takes a seq it applied already for a
# copy, and would skip it.
seqs = itertools.count()

def one_round():
    global writes, applied_at_once
    for payload, seq in zip(payloads, seqs):
        batch = decoder.decode(payload)
        if upto == 1:
            continue
        out = []
        for item in normalizer.normalize(ident, seq, batch.ts, batch.events, 0.0, stats):
            if upto >= 3 and hasattr(item, "events"):
                out.append(encoder.group(item, subjects, "bench:0:1", **kept))
        if upto == 4:
            if at_once:
                keeper.published(out, 1)
                applied_at_once += not keeper.pending
            else:
                keeper.published(out)
            writes += 1
            keeper.catch_up()
        stats.dropped.clear()
        stats.transformed.clear()

times = []
for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(rounds):
        one_round()
    times.append(time.perf_counter() - start)
print(json.dumps({"events": events * rounds, "times": times, "bodies": bodies, "writes": writes,
                  "applied_at_once": applied_at_once}))
"""


STAGES = ("decode", "normalize", "encode")
KEEP_STAGES = (*STAGES, "keep")


def run_child(tree: Path, traffic: Path, size: int, rounds: int, repeats: int,
              callgrind: bool = False, upto: int = len(STAGES), bodies: bool = False) -> tuple[dict[str, Any], int | None]:
    argv = [sys.executable, "-c", CHILD, str(traffic), str(size), str(rounds), str(repeats), str(upto),
            "1" if bodies else "0"]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    if callgrind:
        argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *argv]
    proc = subprocess.run(argv, cwd=tree, capture_output=True, text=True, env=env, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    ir = None
    if callgrind:
        match = re.search(r"Collected\s*:\s*(\d+)", proc.stderr)
        ir = int(match.group(1)) if match else None
    return out, ir


def instructions_per_event(tree: Path, traffic: Path, size: int, rounds: int,
                           upto: int = len(STAGES), bodies: bool = False) -> float | None:
    """(Ir with `rounds` rounds of the first `upto` stages - Ir with none) / events."""
    _, base = run_child(tree, traffic, size, 0, 1, callgrind=True, bodies=bodies)
    out, total = run_child(tree, traffic, size, rounds, 1, callgrind=True, upto=upto, bodies=bodies)
    if base is None or total is None or not out["events"]:
        return None
    return (total - base) / out["events"]


def instructions_by_stage(tree: Path, traffic: Path, size: int, rounds: int,
                          stages: tuple[str, ...] = STAGES, bodies: bool = False) -> dict[str, float] | None:
    """Ir/event of each stage: the runs up to it and up to the one before, subtracted."""
    upto = [instructions_per_event(tree, traffic, size, rounds, n, bodies) for n in range(1, len(stages) + 1)]
    if any(ir is None for ir in upto):
        return None
    cumulative = [0.0, *(ir for ir in upto if ir is not None)]
    return {stage: cumulative[i + 1] - cumulative[i] for i, stage in enumerate(stages)}


def print_stages(cells: dict[str, Any], base: dict[str, int], stages: tuple[str, ...] = STAGES) -> None:
    """Ir/event per stage and cell, and the base cell's over each (as above: above 1 is fewer)."""
    print(f"{'Ir/event':<12}" + "".join(f" {stage:>9}   x map" for stage in stages))
    for name, cell in cells.items():
        by_stage = cell.get("ir_by_stage")
        if by_stage:
            print(f"{name:<12}" + "".join(f" {by_stage[s]:>9} {base[s] / by_stage[s]:>7.3f}" for s in stages))
    print("(per stage, x map as above: the base cell's Ir/event over this cell's; above 1 is fewer instructions)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hotpath", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref-src", help="Also measure this source tree (its root).")
    ap.add_argument("--size", type=int, default=64, help="Events per vLLM batch (a bench size: 8, 64 or 512).")
    ap.add_argument("--repeats", type=int, default=7, help="Interleaved wall-time repeats.")
    ap.add_argument("--rounds", type=int, default=3, help="Passes over the traffic pool per repeat.")
    ap.add_argument("--skip-callgrind", action="store_true")
    ap.add_argument("--stages", action="store_true", help="Also Ir/event per stage (a callgrind run a stage and cell).")
    ap.add_argument("--keep", action="store_true", help="Also the snapshot keeper's stage (log and apply).")
    ap.add_argument("--bodies", action="store_true",
                    help="With --keep: the keeper takes the structs the encoder made, as while the relay keeps up "
                         "(default: their payloads, as in a burst).")
    ap.add_argument("--smoke", action="store_true", help="Tiny counts, no callgrind: only that it runs.")
    ap.add_argument("--pool-events", type=int, default=60_000, help="Distinct events in the traffic pool.")
    ap.add_argument("--map-only", action="store_true", help="Leave out the array-form cell.")
    ap.add_argument("--out", help="JSON output (default bench/results/hotpath.json).")
    args = ap.parse_args(argv)
    if args.bodies and not args.keep:
        ap.error("--bodies needs --keep")
    stages = KEEP_STAGES if args.keep else STAGES
    pool_events = 3_000 if args.smoke else args.pool_events
    repeats, rounds = (1, 1) if args.smoke else (args.repeats, args.rounds)
    callgrind = not (args.smoke or args.skip_callgrind) and shutil.which("valgrind") is not None
    with tempfile.TemporaryDirectory(prefix="kvb-hotpath-") as tmp:
        cache = Path(tmp) if args.smoke else RESULTS
        trees = {"this": ROOT}
        if args.ref_src:
            trees["ref"] = Path(args.ref_src).resolve()
        encodings = ("map",) if args.map_only else ("map", "array")
        traffic = {enc: cached((args.size,), pool_events, cache, encoding=enc)[0] for enc in encodings}
        cells = [(t, e) for t in trees for e in traffic if not (t == "ref" and e == "array")]
        times: dict[str, list[float]] = {f"{t}-{e}": [] for t, e in cells}
        events: dict[str, int] = {}
        bodies: dict[str, bool] = {}
        at_once: dict[str, tuple[int, int]] = {}  # (writes applied at once, writes), the last repeat's
        for _ in range(repeats):  # interleaved: a noisy neighbour hurts every cell alike
            for t, e in cells:
                out, _ = run_child(trees[t], traffic[e], args.size, rounds, 1, upto=len(stages), bodies=args.bodies)
                times[f"{t}-{e}"].extend(out["times"])
                events[f"{t}-{e}"] = out["events"]
                bodies[f"{t}-{e}"] = bool(out.get("bodies"))
                at_once[f"{t}-{e}"] = (int(out.get("applied_at_once", 0)), int(out.get("writes", 0)))
        result: dict[str, Any] = {"size": args.size, "rounds": rounds, "repeats": repeats, "stages": list(stages),
                              "cells": {}}
        for name in times:
            ns = statistics.median(times[name]) / events[name] * 1e9
            result["cells"][name] = {"ns_per_event": round(ns, 1), "bodies": bodies[name],
                                     "applied_at_once": at_once[name][0], "writes": at_once[name][1], "ns_each": [
                round(x / events[name] * 1e9, 1) for x in times[name]]}
            if callgrind:
                t, e = name.split("-")
                if args.stages:
                    by_stage = instructions_by_stage(trees[t], traffic[e], args.size, 1, stages, args.bodies)
                    ir = None if by_stage is None else sum(by_stage.values())
                    result["cells"][name]["ir_by_stage"] = by_stage and {k: round(v) for k, v in by_stage.items()}
                else:
                    ir = instructions_per_event(trees[t], traffic[e], args.size, 1, len(stages), args.bodies)
                result["cells"][name]["ir_per_event"] = None if ir is None else round(ir)
    base = result["cells"].get("ref-map") or result["cells"]["this-map"]
    print(f"hot path ({', '.join(stages)}), {args.size}-event batches; ns/event: median of {repeats}")
    print(f"{'cell':<12} {'ns/event':>9} {'x map':>7} {'Ir/event':>9} {'x map':>7}")
    for name, cell in result["cells"].items():
        ns_ratio = base["ns_per_event"] / cell["ns_per_event"]
        ir = cell.get("ir_per_event")
        ir_ratio = base["ir_per_event"] / ir if ir and base.get("ir_per_event") else None
        cell["speed_vs_map"] = round(ns_ratio, 3)
        cell["instructions_vs_map"] = None if ir_ratio is None else round(ir_ratio, 3)
        print(f"{name:<12} {cell['ns_per_event']:>9.0f} {ns_ratio:>7.3f} "
              f"{'-' if ir is None else ir:>9} {'-' if ir_ratio is None else format(ir_ratio, '.3f'):>7}")
    print("(x map: the map-form cell of the reference tree, else of this one, over this cell; above 1 is faster)")
    if args.bodies:
        print("keeper fed structs: " + ", ".join(
            f"{name} {'yes' if cell['bodies'] else 'no (payloads)'}, "
            f"{cell['applied_at_once']} of {cell['writes']} writes applied whole at once"
            for name, cell in result["cells"].items()))
    if base.get("ir_by_stage"):
        print_stages(result["cells"], base["ir_by_stage"], stages)
    out_path = Path(args.out) if args.out else RESULTS / "hotpath.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

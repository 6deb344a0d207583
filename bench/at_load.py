"""`python -m bench.at_load`: bridges side by side at a fixed load, for A/B work on one batch size.

Each variant is a core-mode `kv-bridge run` with its own flags and, if
given, its own source tree. They run at once but take the load in turn,
round after round (as `bench.run` interleaves its modes), so a noisy
machine moves them all; each round is one latency run of `bench.run`'s
`Runner` at `--rate` events per second. Per round and variant it prints
the CPU per million events, p50 and p99, peak RSS and the messages the
keeper let go; then the medians. Figures go to stdout only.

    python -m bench.at_load --size 512 --seconds 8 --rounds 4 \\
        --variant this= --variant before=@/path/to/worktree --variant nosnap=--no-snapshots

A variant is `label=flags[@tree]`: `flags` split on spaces.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import run
from bench.traffic import cached


@dataclass(frozen=True)
class Variant:
    label: str
    flags: list[str]
    tree: Path | None


def parse_variant(text: str) -> Variant:
    """`label=flags[@tree]`."""
    label, sep, rest = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"a variant is label=flags[@tree], not {text!r}")
    flags, _, tree = rest.partition("@")
    return Variant(label, flags.split(), Path(tree).resolve() if tree else None)


def _row(sample: dict[str, Any]) -> tuple[float, float, float, float]:
    lat = sample["latency"] or {}
    return (sample["cpu_s_per_m_events"], lat.get("p50_ms") or 0.0, lat.get("p99_ms") or 0.0,
            sample.get("peak_rss_mb") or 0.0)


async def measure(args: argparse.Namespace) -> dict[str, list[tuple[float, float, float, float]]]:
    plan = run.make_plan(run.build_parser().parse_args(
        ["--modes", "core", "--sizes", str(args.size), "--skip-vllm-check", "--skip-overload", "--skip-array-form",
         *(["--smoke"] if args.smoke else [])]))
    traffic, pools = cached(plan.sizes, plan.pool_events, plan.cache_dir)
    rows: dict[str, list[tuple[float, float, float, float]]] = {v.label: [] for v in args.variant}
    with tempfile.TemporaryDirectory(prefix="kvb-at-load-") as tmp:
        runners = [run.Runner("core", plan, traffic, pools, Path(tmp), extra_flags=v.flags, label=v.label, src=v.tree)
                   for v in args.variant]
        try:
            await asyncio.gather(*(r.start() for r in runners))
            for r in runners:  # unmeasured: a fresh process's first second is not its steady state
                await r.latency(args.size, args.rate, plan.latency_warmup_s)
            for n in range(args.rounds):
                for r in runners:
                    sample = await r.latency(args.size, args.rate, args.seconds)
                    rows[r.name].append(_row(sample))
                    cpu, p50, p99, rss = rows[r.name][-1]
                    run.say(f"round {n + 1} {r.name:<12} cpu {cpu:6.2f} s/M  p50 {p50:6.2f} ms  p99 {p99:7.2f} ms  "
                            f"rss {rss:6.1f} MiB  shed {sample.get('residency_shed_messages')}"
                            + ("" if sample["ok"] else "  NOT OK"))
        finally:
            await asyncio.gather(*(r.stop() for r in runners))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.at_load", description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512, help="Events per vLLM batch.")
    parser.add_argument("--seconds", type=float, default=8.0, help="Seconds of load per round and variant.")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--rate", type=float, default=50_000.0, help="Offered events/s.")
    parser.add_argument("--smoke", action="store_true", help="bench.run's smoke traffic (small pools) and warm-up.")
    parser.add_argument("--variant", type=parse_variant, action="append", required=True,
                        help="label=flags[@tree]; repeat for each bridge.")
    args = parser.parse_args(argv)
    rows = asyncio.run(measure(args))
    print("variant       cpu s/M   p50 ms   p99 ms   rss MiB   (medians)")
    for label, samples in rows.items():
        cpu, p50, p99, rss = (statistics.median(col) for col in zip(*samples))
        print(f"{label:<12} {cpu:8.2f} {p50:8.2f} {p99:8.2f} {rss:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

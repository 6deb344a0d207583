"""`kv-bridge watch`: a live table of the cluster, one row per worker and rank.

It keeps its own residency index from the bus (core NATS from now on, or a
JetStream replay with --since to start from history) and follows the worker
registry for liveness. Counts shown are trusted blocks; blocks held only since
before a gap show as `+N?`.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

import anyio
import nats.js.errors
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from bridge.client.bootstrap import BootstrapOptions, add_bootstrap_arguments, bootstrap_options
from bridge.client.connection import BusConnection, access_settings, add_access_arguments
from bridge.client.registry import DEFAULT_BUCKET, RegistryFollower, declare_entry
from bridge.client.subscribe import DEFAULT_STREAM, BusSubscriber, StartAt, parse_since
from bridge.contract import DEFAULT_DEAD_AFTER
from bridge.contract.snapshot import RankSnapshot
from bridge.residency.index import ResidencyIndex
from bridge.residency.views import WorkerKey, WorkerView
from bridge.runtime.access import ConfigError, NatsAccess
from bridge.runtime.logging import configure_logging
from bridge.runtime.stopping import close_quietly, until_signal

MEDIA = ("GPU", "CPU", "STORAGE")
_LIVENESS_STYLE = {"alive": "green", "dead": "bold red", "stopped": "yellow", "watching": "green", "?": "dim"}


class WatchOptions:
    def __init__(self, args: argparse.Namespace, prefix: str = "kv") -> None:
        self.once: bool = args.once
        self.duration: float | None = args.duration
        self.refresh: float = args.refresh
        self.bucket: str = args.registry_bucket
        self.dead_after: float = args.dead_after
        self.since: StartAt | None = parse_since(args.since) if args.since else None
        self.stream: str = args.stream_name
        self.width: int | None = args.width
        self.bootstrap: BootstrapOptions | None = bootstrap_options(args, prefix)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "watch", help="Live terminal view of every worker: residency per group and medium, rates, gaps, liveness.",
        description="A live table, one row per worker and rank: resident blocks per group and medium, store and "
                    "remove rates, last batch seq, lag, gaps, restarts and liveness from the worker registry. "
                    "Ctrl-C exits.",
    )
    parser.add_argument("--once", action="store_true",
                        help="Listen for --duration seconds (default 2), print the table once and exit.")
    parser.add_argument("--duration", type=float, default=None, help="Exit after this many seconds.")
    parser.add_argument("--refresh", type=float, default=0.5, help="Seconds between screen updates.")
    parser.add_argument("--registry-bucket", default=DEFAULT_BUCKET,
                        help="Worker registry KV bucket for liveness ('' to ignore the registry).")
    parser.add_argument("--dead-after", type=float, default=DEFAULT_DEAD_AFTER,
                        help="A worker is dead after this many heartbeat intervals without one.")
    parser.add_argument("--since", default=None,
                        help="Rebuild the view from the JetStream stream first: 'snapshot' (each rank's snapshot, "
                             "then the stream after it), 'all', a sequence, or an age like 10m.")
    parser.add_argument("--stream-name", default=DEFAULT_STREAM, help="JetStream stream for --since.")
    parser.add_argument("--width", type=int, default=None, help="Table width (default: the terminal's).")
    add_bootstrap_arguments(parser, by_default=True)
    add_access_arguments(parser)
    parser.set_defaults(func=_cmd_watch)


def _cmd_watch(args: argparse.Namespace) -> int:
    # stdout is the tool's output: the library's warnings go to stderr.
    configure_logging("console", "warning")
    try:
        settings = access_settings(args)
        opts = WatchOptions(args, settings.subject_prefix)
    except (ConfigError, ValueError) as exc:
        print(f"kv-bridge watch: {exc}", file=sys.stderr)
        return 2
    try:
        return anyio.run(until_signal, lambda: watch(settings, opts, sys.stdout))
    except KeyboardInterrupt:  # Ctrl-C before the loop runs
        return 0


class RateMeter:
    """Store and remove rates per (worker, rank, group), smoothed between frames."""

    def __init__(self, smoothing: float = 0.5) -> None:
        self._last: dict[tuple[WorkerKey, int], tuple[float, int, int]] = {}
        self.rates: dict[tuple[WorkerKey, int], tuple[float, float]] = {}
        self._alpha = smoothing
        self._first: float | None = None
        # Ranks whose counters came whole from a snapshot: the next sample is their baseline.
        self._restored: set[WorkerKey] = set()

    def restored(self, key: WorkerKey) -> None:
        """The rank's view was replaced by a snapshot: its counters carry the
        rank's whole past, which is no rate."""
        self._restored.add(key)

    def sample(self, index: ResidencyIndex, now: float) -> None:
        if self._first is None:
            self._first = now
        restored, self._restored = self._restored, set()
        for view in index:
            for group, g in view.groups.items():
                key = (view.key, group)
                # The index counts from zero when it starts, so a group first
                # seen now has counted since the first sample.
                prev = self._last.get(key, (self._first, 0, 0))
                self._last[key] = (now, g.stored, g.removed + g.unknown_removals)
                if now <= prev[0] or view.key in restored:
                    continue
                dt = now - prev[0]
                # counters restart when a view resets; a negative delta is no rate
                stored = max(0, g.stored - prev[1]) / dt
                removed = max(0, g.removed + g.unknown_removals - prev[2]) / dt
                old = self.rates.get(key)
                if old is not None:
                    stored = self._alpha * stored + (1 - self._alpha) * old[0]
                    removed = self._alpha * removed + (1 - self._alpha) * old[1]
                self.rates[key] = (stored, removed)


def _seconds(value: float | None) -> str:
    if value is None:
        return "—"
    if value < 1.0:
        return f"{value * 1000:.0f}ms"
    if value < 120:
        return f"{value:.1f}s"
    return f"{value / 60:.0f}m"


def _rate(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _group_cell(view: WorkerView, group: int, rates: RateMeter, show_family: bool) -> Text:
    g = view.groups.get(group)
    if g is None:
        return Text("")
    parts: list[str] = []
    for medium in (*MEDIA, *sorted(g.media() - set(MEDIA))):
        held, doubtful = g.resident(medium), g.suspect_count(medium)
        if held or doubtful:
            parts.append(f"{medium} {held}" + (f" +{doubtful}?" if doubtful else ""))
    text = Text()
    if show_family:
        text.append(f"{g.family} ", style="bold")
    text.append("  ".join(parts) or "empty", style=None if parts else "dim")
    stored, removed = rates.rates.get((view.key, group), (0.0, 0.0))
    text.append(f"\n+{_rate(stored)}/s -{_rate(removed)}/s", style="dim")
    return text


def _liveness(view: WorkerView | None, follower: RegistryFollower | None, worker: str, now: float) -> str:
    status = follower.status(worker, now) if follower is not None else None
    if status is not None:
        return status
    if view is None:
        return "?"
    return "watching" if view.watching else "stopped"


def build_table(index: ResidencyIndex, follower: RegistryFollower | None, rates: RateMeter,
                now: float | None = None) -> Table:
    now = time.time() if now is None else now
    keys: set[WorkerKey] = {v.key for v in index}
    if follower is not None:
        for entry in follower.entries.values():
            keys.update(WorkerKey(entry.worker, r.dp_rank) for r in entry.ranks)
    families: dict[int, set[str]] = {}
    for seen in index:
        for group, g in seen.groups.items():
            families.setdefault(group, set()).add(g.family)
    registry = "off" if follower is None else ("on" if follower.available else "absent")
    table = Table(
        title=f"kv-bridge watch — {len(keys)} worker ranks, registry {registry}, "
              f"{time.strftime('%H:%M:%S', time.localtime(now))}",
        title_justify="left", expand=False,
    )
    numeric = ("rank", "seq", "gaps", "restarts")
    for name in ("worker", "rank", "live", "seq", "lag", "gaps", "restarts"):
        table.add_column(name, no_wrap=name != "worker", justify="right" if name in numeric else "left")
    groups = sorted(families)
    for group in groups:
        fams = families[group]
        table.add_column(f"g{group} {next(iter(fams))}" if len(fams) == 1 else f"g{group}", no_wrap=True)
    for key in sorted(keys):
        view = index.views.get(key)
        live = _liveness(view, follower, key.worker, now)
        gaps = "—" if view is None else str(view.gaps) + (" stale" if view.stale else "")
        row: list[Text | str] = [
            key.worker, str(key.dp_rank), Text(live, style=_LIVENESS_STYLE.get(live, "")),
            "—" if view is None or view.last_seq is None else str(view.last_seq),
            _seconds(None if view is None else view.lag),
            Text(gaps, style="red" if view is not None and view.stale else ""),
            "—" if view is None else str(view.restarts),
        ]
        for group in groups:
            row.append(_group_cell(view, group, rates, len(families[group]) > 1) if view else "")
        table.add_row(*row)
    if index.interruptions:
        table.caption = f"{index.interruptions} bus interruption(s): counts since then marked '?'"
    return table


async def _feed(sub: BusSubscriber, index: ResidencyIndex, rates: RateMeter) -> None:
    async for item in sub:
        index.apply(item)
        if type(item) is RankSnapshot:
            rates.restored(WorkerKey(item.worker, item.dp_rank))


async def watch(settings: NatsAccess, opts: WatchOptions, out: TextIO) -> int:
    conn = BusConnection()
    try:
        nc = await conn.open(settings, "kv-bridge watch")
    except (ConnectionError, OSError) as exc:
        print(f"kv-bridge watch: {exc}", file=sys.stderr)
        return 1
    console = Console(file=out, width=opts.width)
    index = ResidencyIndex()
    rates = RateMeter()
    follower = (
        RegistryFollower(nc, opts.bucket, opts.dead_after, on_entry=lambda e: declare_entry(index, e))
        if opts.bucket else None
    )
    duration = opts.duration if opts.duration is not None else (2.0 if opts.once else None)
    subject = f"{settings.subject_prefix}.>"
    try:
        async with BusSubscriber(conn, subject, since=opts.since, stream=opts.stream, bootstrap=opts.bootstrap) as sub:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_feed, sub, index, rates)
                if follower is not None:
                    tg.start_soon(follower.run)
                start = time.monotonic()
                rates.sample(index, time.time())
                if opts.once:
                    await anyio.sleep(duration or 0)
                    rates.sample(index, time.time())
                    console.print(build_table(index, follower, rates))
                else:
                    with Live(build_table(index, follower, rates), console=console, auto_refresh=False) as live:
                        while duration is None or time.monotonic() - start < duration:
                            await anyio.sleep(opts.refresh)
                            rates.sample(index, time.time())
                            live.update(build_table(index, follower, rates), refresh=True)
                tg.cancel_scope.cancel()
    except nats.js.errors.NotFoundError:
        print(f"kv-bridge watch: no JetStream stream {opts.stream!r} holds {subject!r}", file=sys.stderr)
        return 1
    finally:
        await close_quietly(conn.close)
    return 0

"""`kv-bridge tail`: every contract message as one line, live or replayed from JetStream."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

import anyio
import msgspec
import nats.js.errors

from bridge.apps.render import render_group, render_record, render_snapshot, snapshot_summary
from bridge.client.bootstrap import BootstrapOptions, add_bootstrap_arguments, bootstrap_options
from bridge.client.connection import BusConnection, access_settings, add_access_arguments
from bridge.client.subscribe import DEFAULT_STREAM, BusMessage, BusSubscriber, Interruption, StartAt, parse_since
from bridge.contract import GroupMessage
from bridge.contract.snapshot import RankSnapshot, SnapshotMissing
from bridge.runtime.access import ConfigError, NatsAccess
from bridge.runtime.logging import configure_logging
from bridge.runtime.stopping import close_quietly, until_signal


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "tail", help="Print bus messages, one line each (or JSON), live or replayed from JetStream.",
        description="Print every message on the kv-bridge subjects as one readable line: worker, rank, "
                    "batch seq, group, family/kind, then each event with medium and short hashes.",
    )
    parser.add_argument("subject", nargs="?", default=None,
                        help="Subject filter (default: <prefix>.>, e.g. 'kv.pod-a.*' for one worker).")
    parser.add_argument("--since", default=None,
                        help="Replay from the JetStream stream first: 'snapshot' (each rank's snapshot as one line, "
                             "then the stream after it), 'all', a stream sequence, an age (90s, 10m, 2h) or an ISO "
                             "time; then keep following.")
    parser.add_argument("--stream-name", default=DEFAULT_STREAM, help="JetStream stream for --since.")
    parser.add_argument("--json", action="store_true",
                        help="One JSON object per line (hashes as hex strings, or ints as published).")
    parser.add_argument("--count", type=int, default=0, help="Exit after N messages (0: never).")
    add_bootstrap_arguments(parser, by_default=False)
    add_access_arguments(parser)
    parser.set_defaults(func=_cmd_tail)


def _cmd_tail(args: argparse.Namespace) -> int:
    # stdout is the tool's output: the library's warnings go to stderr.
    configure_logging("console", "warning")
    try:
        settings = access_settings(args)
        since = parse_since(args.since) if args.since else None
    except (ConfigError, ValueError) as exc:
        print(f"kv-bridge tail: {exc}", file=sys.stderr)
        return 2
    subject = args.subject or f"{settings.subject_prefix}.>"
    try:
        boot = bootstrap_options(args, settings.subject_prefix)
        return anyio.run(until_signal, lambda: tail(settings, subject, since, args.stream_name, args.json,
                                                    args.count, sys.stdout, boot))
    except KeyboardInterrupt:  # Ctrl-C before the loop runs
        return 0


def _hexed(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [_hexed(v) for v in value]
    if isinstance(value, dict):
        return {k: _hexed(v) for k, v in value.items()}
    return value


def json_line(item: BusMessage) -> str:
    """One message as one JSON object; block hashes as hex (JSON has no bytes)."""
    doc: dict[str, Any] = {
        "subject": item.subject,
        "type": "group" if type(item.body) is GroupMessage else "record",
        "headers": item.headers,
        "message": _hexed(msgspec.to_builtins(item.body, builtin_types=(bytes,))),
    }
    if item.stream_seq is not None:
        doc["stream_seq"] = item.stream_seq
    return json.dumps(doc, separators=(",", ":"))


def text_line(item: BusMessage) -> str:
    body = item.body
    line = render_group(body) if type(body) is GroupMessage else render_record(body)  # type: ignore[arg-type]
    return line if item.stream_seq is None else f"#{item.stream_seq} {line}"


async def tail(settings: NatsAccess, subject: str, since: StartAt | None, stream: str, as_json: bool, count: int,
               out: TextIO, bootstrap: BootstrapOptions | None = None) -> int:
    conn = BusConnection()
    try:
        await conn.open(settings, "kv-bridge tail")
    except (ConnectionError, OSError) as exc:
        print(f"kv-bridge tail: {exc}", file=sys.stderr)
        return 1
    seen = 0
    try:
        async with BusSubscriber(conn, subject, since=since, stream=stream, bootstrap=bootstrap) as sub:
            async for item in sub:
                if type(item) is Interruption:
                    print(f"-- {item.reason}: messages may be missing here --", file=sys.stderr, flush=True)
                    continue
                if type(item) is RankSnapshot or type(item) is SnapshotMissing:
                    out.write((json.dumps(snapshot_summary(item)) if as_json else render_snapshot(item)) + "\n")
                    out.flush()
                    continue
                out.write((json_line(item) if as_json else text_line(item)) + "\n")  # type: ignore[arg-type]
                out.flush()
                seen += 1
                if count and seen >= count:
                    break
    except nats.js.errors.NotFoundError:
        print(f"kv-bridge tail: no JetStream stream {stream!r} holds {subject!r}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `tail | head`: the reader left, which is fine
        return 0
    finally:
        await close_quietly(conn.close)
    return 0

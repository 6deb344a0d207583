"""One validated settings object from `kv-bridge run` flags and `KVB_*` variables.

Every option is declared once in OPTIONS; the parser, the environment lookup and
the table in docs/configuration.md all come from that list. A flag wins over its variable.
The NATS access options (servers, subject prefix, credentials, TLS) are declared
in bridge.runtime.access, which the consumers' tools share.
"""

from __future__ import annotations

import argparse
import enum
import socket
from collections.abc import Mapping
from typing import Any, ClassVar

import msgspec

from bridge.contract import DEFAULT_BUCKET, DEFAULT_STREAM, DEFAULT_TENANT, parse_group_kind, validate_worker_id, worker_token
from bridge.contract.snapshot import DEFAULT_SNAPSHOT_BUCKET
from bridge.producer.source.discovery import Source
from bridge.runtime.access import (
    DEFAULT_INBOX_PREFIX,
    NATS_AUTH_OPTIONS,
    NATS_URL,
    SUBJECT_PREFIX,
    ConfigError,
    NatsAccess,
    Option,
    check_access,
    check_prefix,
)

# Per output format: what one frame may cost in memory once decoded stays
# under the chart's 512 Mi limit (tests/test_hostile.py measures it).
DEFAULT_MAX_FRAME_BYTES: dict[str, int] = {"msgpack": 8 * 1024 * 1024, "json": 4 * 1024 * 1024}


class PromptData(enum.Enum):
    """`--prompt-data`: what relayed stores say of the prompt (docs/security.md)."""

    REDACT = "redact"  # token ids become as many zeros; extra_keys and lookahead token ids go
    RELAY = "relay"  # as vLLM sent them


OPTIONS: tuple[Option, ...] = (
    Option("--vllm-url", "str", "",
           "vLLM's HTTP server (e.g. http://127.0.0.1:8000): read its /kv_event_sources (vLLM 0.31.0 and later), subscribe to every rank it lists and follow its restarts. Replaces --zmq-endpoint, --replay-endpoint, --dp-ranks and --topic."),
    Option("--vllm-poll-interval", "float", 5.0, "With --vllm-url: seconds between reads of /kv_event_sources, while waiting for vLLM and to notice new endpoints after a restart."),
    Option("--zmq-endpoint", "list", ["tcp://127.0.0.1:5557"],
           "vLLM PUB endpoint (repeatable; env: comma-separated). With --dp-ranks N, one endpoint stands for ranks 0..N-1 on consecutive ports."),
    Option("--replay-endpoint", "list", [],
           "vLLM replay ROUTER endpoint, one per --zmq-endpoint, same order (ports offset by rank like the PUB)."),
    Option("--dp-ranks", "int", 1, "Data-parallel ranks behind each endpoint; rank r listens on port + r, as vLLM offsets them."),
    Option("--topic", "str", "", "vLLM's kv-events topic (ZMQ subscription prefix)."),
    Option("--worker-id", "str", "", "Worker id in subjects and payloads. Default: $POD_NAME, else the host name."),
    Option("--model", "str", "",
           "The model vLLM serves, as routers name it, put in the worker's registry entry: consumers answer a query for a model only with its workers. Default with --vllm-url: the id vLLM's /v1/models lists; else none."),
    Option("--tenant", "str", DEFAULT_TENANT, "The tenant the worker serves, put in its registry entry (the indexer API's tenant_id)."),
    NATS_URL,
    SUBJECT_PREFIX,
    Option("--format", "choice", "msgpack", "Payload encoding.", ("msgpack", "json")),
    Option("--group-kind", "list", [], "Pin a group's kind: IDX=KIND (repeatable), e.g. 1=mamba."),
    Option("--prompt-data", "choice", PromptData.REDACT.value,
           "What relayed stores say of the prompt. redact: token ids become as many zeros, extra_keys (which "
           "carry cache_salt) and lookahead token ids go; relay: as vLLM sent them, for consumers that hash "
           "tokens themselves (docs/security.md).", tuple(p.value for p in PromptData)),
    Option("--keep-placeholders", "bool", False, "Forward window placeholders (block_size=0), flagged, instead of dropping them."),
    Option("--max-frame-bytes", "int", 0, "Largest payload frame accepted from ZMQ; larger ones are counted and skipped. 0: 8 MiB with msgpack output, 4 MiB with JSON output (which decodes every field, so a frame costs more memory)."),
    Option("--max-buffered-batches", "int", 10000, "Batches held in memory while NATS is slow or away; past it the oldest go and a gap record says so."),
    Option("--max-buffered-bytes", "int", 256 * 1024 * 1024, "Encoded bytes held in memory the same way (the bound for large batches); 0 for none."),
    Option("--zmq-rcvhwm", "int", 100000, "ZMQ SUB receive high-water mark (messages)."),
    Option("--coalesce-ms", "float", 0.5,
           "When vLLM batches come less than this apart, wait this long after taking some, so the next few go to NATS in one write (0: never wait). Slower streams and backlogs never wait."),
    Option("--replay-timeout", "float", 2.0, "Seconds to wait for a replay answer."),
    Option("--replay-retries", "int", 2,
           "A replay attempt that returns nothing (no answer in time, a frame past the socket limit, a malformed answer) is made again this many times; then its first seq is skipped, and named by a gap once replay answers from past it. One gap's recovery holds the live stream back at most (retries + 2) x --replay-timeout (8 s by default)."),
    Option("--idle-probe-interval", "float", 2.0, "While a publisher is quiet, ask its replay socket this often for batches lost at the tail (0: never)."),
    Option("--http-host", "str", "0.0.0.0", "Address for /metrics, /healthz, /readyz."),
    Option("--http-port", "int", 9400, "Port for /metrics, /healthz, /readyz (0: any free port)."),
    Option("--log-format", "choice", "json", "Log line format.", ("json", "console")),
    Option("--log-level", "choice", "info", "Log level.", ("debug", "info", "warning", "error")),
    Option("--drain-timeout", "float", 10.0, "Seconds SIGTERM/SIGINT/SIGHUP may take to flush and drain NATS."),
    Option("--nats-unhealthy-after", "float", 120.0,
           "Seconds NATS may stay unusable (no connection, the bridge reconnecting) before /healthz answers 503, so the orchestrator restarts the bridge (0: never)."),
    Option("--jetstream", "bool", False, "Publish to a JetStream stream with acks and de-duplication, and resume from it on start."),
    Option("--stream-name", "str", DEFAULT_STREAM, "JetStream stream name (created or verified at start)."),
    Option("--stream-max-age", "float", 3600.0, "Stream limit: seconds a message is kept."),
    Option("--stream-max-bytes", "int", 1024 * 1024 * 1024, "Stream limit: bytes kept, oldest messages dropped first (-1: no bound)."),
    Option("--stream-max-msgs-per-subject", "int", -1, "Stream limit: messages kept per subject (-1: no bound). Costly at high rates: nats-server then deletes one old message of that subject, scattered through its files, for every new one."),
    Option("--stream-duplicate-window", "float", 120.0, "Stream de-duplication window in seconds (Nats-Msg-Id)."),
    Option("--stream-replicas", "int", 1,
           "Replicas of the stream the bridge creates (1-5; 3 on a three-server cluster). An existing stream keeps its own (a differing one is logged)."),
    Option("--js-max-pending", "int", 16384, "JetStream publishes in flight without an ack: enough to ride out a stream's pauses of a few hundred ms without holding up live delivery (a reconnect sends them again; --js-max-pending-bytes bounds their memory)."),
    Option("--js-max-pending-bytes", "int", 64 * 1024 * 1024, "Encoded bytes of JetStream publishes in flight without an ack (the window's memory bound for large batches)."),
    Option("--js-ack-timeout", "float", 5.0, "Seconds to wait for one JetStream ack before retrying."),
    Option("--registry-bucket", "str", DEFAULT_BUCKET, "JetStream key-value bucket for the worker registry (JetStream mode); empty disables it."),
    Option("--heartbeat-interval", "float", 5.0, "Seconds between worker registry heartbeats."),
    Option("--snapshots", "bool", True,
           "Keep each rank's residency as consumers will hold it and answer snapshot requests (the "
           "kv-bridge-snapshot NATS service), so consumers that start late reach the same view."),
    Option("--snapshot-bucket", "str", DEFAULT_SNAPSHOT_BUCKET,
           "JetStream mode: key-value bucket keeping each rank's latest snapshot, for consumers that start while "
           "the bridge is away and for the bridge's own restart; empty disables it."),
    Option("--snapshot-interval", "float", 30.0, "JetStream mode: seconds between bucket snapshots of a rank that changed."),
    Option("--snapshot-events", "int", 100000,
           "JetStream mode: a rank's bucket snapshot is written sooner, once this many events came since the last "
           "(or as many as the last one listed hashes, if more: a snapshot costs its rank's size)."),
    Option("--snapshot-log-bytes", "int", 32 * 1024 * 1024,
           "Memory held by published messages not yet applied to the bridge's residency (payloads and their "
           "entries), applied when idle or for a snapshot; past this the bridge is too busy to apply them and lets "
           "them go, its snapshots then stale and partial."),
    *NATS_AUTH_OPTIONS,
)


# A model or tenant name: a Hugging Face repo id or a path is far shorter.
MAX_NAME = 1024

_DEFAULTS: dict[str, Any] = {opt.dest: opt.default for opt in OPTIONS}


class Settings(NatsAccess, frozen=True):
    """Every option of `kv-bridge run`; the NATS access fields come from NatsAccess."""

    vllm_url: str
    vllm_poll_interval: float
    zmq_endpoint: list[str]
    replay_endpoint: list[str]
    dp_ranks: int
    topic: str
    worker_id: str
    model: str
    tenant: str
    format: str
    group_kind: dict[int, str]
    prompt_data: PromptData
    keep_placeholders: bool
    max_frame_bytes: int
    max_buffered_batches: int
    max_buffered_bytes: int
    zmq_rcvhwm: int
    coalesce_ms: float
    replay_timeout: float
    replay_retries: int
    idle_probe_interval: float
    http_host: str
    http_port: int
    log_format: str
    log_level: str
    drain_timeout: float
    nats_unhealthy_after: float
    jetstream: bool
    stream_name: str
    stream_max_age: float
    stream_max_bytes: int
    stream_max_msgs_per_subject: int
    stream_duplicate_window: float
    stream_replicas: int
    js_max_pending: int
    js_max_pending_bytes: int
    js_ack_timeout: float
    registry_bucket: str
    heartbeat_interval: float
    snapshots: bool
    snapshot_bucket: str
    snapshot_interval: float
    snapshot_events: int
    snapshot_log_bytes: int
    # The publishers vLLM listed at --vllm-url; set by the bridge, not an option.
    sources: list[Source] = []

    LOGGED_OPTIONS: ClassVar[tuple[Option, ...]] = OPTIONS
    REPR_FIELDS: ClassVar[tuple[str, ...]] = ("worker_id",)

    def stream_endpoints(self) -> list[tuple[int, str, str | None]]:
        """(dp_rank, PUB endpoint, replay endpoint or None) for every publisher."""
        if self.sources:
            return [(s.dp_rank, s.endpoint, s.replay_endpoint) for s in self.sources]
        out: list[tuple[int, str, str | None]] = []
        for i, endpoint in enumerate(self.zmq_endpoint):
            replay = self.replay_endpoint[i] if i < len(self.replay_endpoint) else None
            for rank in range(self.dp_ranks):
                out.append((rank, offset_port(endpoint, rank), offset_port(replay, rank) if replay else None))
        return out


def offset_port(endpoint: str, rank: int) -> str:
    """vLLM's rule: tcp ports grow by the rank (0 stays 0), other transports get `_dp<rank>`."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    for opt in OPTIONS:
        if opt.kind == "secret":
            continue
        env_note = f" [env {opt.env}]"
        if opt.kind == "bool":
            parser.add_argument(opt.flag, dest=opt.dest, action=argparse.BooleanOptionalAction, default=None,
                                help=opt.help + env_note)
        elif opt.kind == "list":
            parser.add_argument(opt.flag, dest=opt.dest, action="append", default=None, help=opt.help + env_note)
        elif opt.kind == "choice":
            parser.add_argument(opt.flag, dest=opt.dest, choices=opt.choices, default=None, help=opt.help + env_note)
        else:
            parser.add_argument(opt.flag, dest=opt.dest, default=None, help=opt.help + env_note)


def load_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    values: dict[str, Any] = {opt.dest: opt.read(args, environ) for opt in OPTIONS}
    return _validated(values, environ)


def _validated(values: dict[str, Any], environ: Mapping[str, str]) -> Settings:
    def check(cond: bool, flag: str, problem: str) -> None:
        if not cond:
            raise ConfigError(flag, problem)

    if values["vllm_url"]:
        check(values["vllm_url"].startswith(("http://", "https://")), "--vllm-url", "must be an http:// or https:// URL")
        for dest in ("zmq_endpoint", "replay_endpoint", "dp_ranks", "topic"):
            check(values[dest] == _DEFAULTS[dest], "--" + dest.replace("_", "-"),
                  "comes from vLLM's /kv_event_sources with --vllm-url: give one or the other")
        check(values["vllm_poll_interval"] > 0, "--vllm-poll-interval", "must be positive")
    check(bool(values["zmq_endpoint"]), "--zmq-endpoint", "at least one endpoint is needed")
    for endpoint in values["zmq_endpoint"] + values["replay_endpoint"]:
        check(endpoint.startswith(("tcp://", "ipc://", "inproc://")), "--zmq-endpoint",
              f"{endpoint!r} is not a tcp://, ipc:// or inproc:// endpoint")
        if endpoint.startswith("tcp://"):
            port = endpoint.rpartition(":")[2]
            check(port.isdigit(), "--zmq-endpoint", f"{endpoint!r} has no numeric port")
    check(len(values["replay_endpoint"]) <= len(values["zmq_endpoint"]), "--replay-endpoint",
          "more replay endpoints than --zmq-endpoint")
    check(1 <= values["dp_ranks"] <= 1024, "--dp-ranks", "must be 1..1024")
    worker = values["worker_id"] or environ.get("POD_NAME", "") or socket.gethostname()
    try:
        values["worker_id"] = validate_worker_id(worker)
    except ValueError as exc:
        raise ConfigError("--worker-id", str(exc)) from None
    values["prompt_data"] = PromptData(values["prompt_data"])
    check(bool(values["tenant"]), "--tenant", "must not be empty")
    check(len(values["model"]) <= MAX_NAME, "--model", f"takes at most {MAX_NAME} characters")
    check(len(values["tenant"]) <= MAX_NAME, "--tenant", f"takes at most {MAX_NAME} characters")
    check_prefix(values["subject_prefix"])
    if not values["nats_inbox_prefix"]:
        # The name `kv-bridge nats-permissions` gives this bridge's user.
        values["nats_inbox_prefix"] = f"{DEFAULT_INBOX_PREFIX}.bridge-{worker_token(values['worker_id'], 0)}"
    kinds: dict[int, str] = {}
    for spec in values["group_kind"]:
        try:
            idx, kind = parse_group_kind(spec)
        except ValueError as exc:
            raise ConfigError("--group-kind", str(exc)) from None
        kinds[idx] = kind
    values["group_kind"] = kinds
    if values["max_frame_bytes"] == 0:
        values["max_frame_bytes"] = DEFAULT_MAX_FRAME_BYTES[values["format"]]
    check(values["max_frame_bytes"] >= 1024, "--max-frame-bytes", "must be 0 (the default) or at least 1024")
    check(values["max_buffered_batches"] >= 1, "--max-buffered-batches", "must be at least 1")
    check(values["max_buffered_bytes"] == 0 or values["max_buffered_bytes"] >= 1024 * 1024,
          "--max-buffered-bytes", "must be 0 (no bound) or at least 1 MiB")
    check(0 <= values["coalesce_ms"] <= 100, "--coalesce-ms", "must be 0..100")
    check(values["replay_timeout"] > 0, "--replay-timeout", "must be positive")
    check(0 <= values["replay_retries"] <= 10, "--replay-retries", "must be 0..10")
    check(values["idle_probe_interval"] >= 0, "--idle-probe-interval", "must be 0 or positive")
    check(0 <= values["http_port"] <= 65535, "--http-port", "must be 0..65535")
    check(values["drain_timeout"] > 0, "--drain-timeout", "must be positive")
    check(values["nats_unhealthy_after"] >= 0, "--nats-unhealthy-after", "must be 0 (never) or positive")
    check(values["stream_max_age"] >= 0, "--stream-max-age", "must be 0 (no bound) or positive")
    check(values["stream_max_bytes"] == -1 or values["stream_max_bytes"] >= 1024 * 1024, "--stream-max-bytes",
          "must be -1 (no bound) or at least 1 MiB")
    check(values["stream_max_msgs_per_subject"] == -1 or values["stream_max_msgs_per_subject"] >= 1,
          "--stream-max-msgs-per-subject", "must be -1 (no bound) or at least 1")
    check(values["js_max_pending"] >= 1, "--js-max-pending", "must be at least 1")
    check(values["js_max_pending_bytes"] >= 1024 * 1024, "--js-max-pending-bytes", "must be at least 1 MiB")
    check(values["js_ack_timeout"] > 0, "--js-ack-timeout", "must be positive")
    check(1 <= values["stream_replicas"] <= 5, "--stream-replicas", "must be 1..5 (NATS keeps at most 5 replicas)")
    check(values["heartbeat_interval"] > 0, "--heartbeat-interval", "must be positive")
    check(values["snapshot_interval"] >= 1, "--snapshot-interval", "must be at least 1 second")
    check(values["snapshot_events"] >= 1, "--snapshot-events", "must be at least 1")
    check(values["snapshot_log_bytes"] >= 1024 * 1024, "--snapshot-log-bytes", "must be at least 1 MiB")
    settings = msgspec.convert(values, Settings)
    check_access(settings)
    return settings


def options_table() -> str:
    """The configuration table of docs/configuration.md, generated so it cannot drift."""
    rows = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for opt in OPTIONS:
        flag = "—" if opt.kind == "secret" else f"`{opt.flag}`"
        default = opt.default
        if isinstance(default, list):
            default = ", ".join(default)
        if opt.kind == "bool":
            default = "false" if not default else "true"
        shown = f"`{default}`" if default not in ("", None) else ""
        rows.append(f"| {flag} | `{opt.env}` | {shown} | {opt.help} |")
    return "\n".join(rows)


"""One validated settings object from `kv-bridge run` flags and `KVB_*` variables.

Every option is declared once in OPTIONS; the parser, the environment lookup and
the table in docs/configuration.md all come from that list. A flag wins over its variable.
Secrets (passwords, tokens) are read from files or the environment only, never
from a flag, so they stay out of process listings.
"""

from __future__ import annotations

import argparse
import os
import socket
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec

from bridge.normalize.kinds import parse_group_kind
from bridge.sink.subjects import validate_prefix, validate_worker_id


class ConfigError(ValueError):
    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"{option}: {problem}")
        self.option = option


@dataclass(frozen=True)
class Option:
    flag: str
    kind: str  # str | int | float | bool | list | choice | secret
    default: Any
    help: str
    choices: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return "KVB_" + self.dest.upper()


OPTIONS: tuple[Option, ...] = (
    Option("--zmq-endpoint", "list", ["tcp://127.0.0.1:5557"],
           "vLLM PUB endpoint (repeatable; env: comma-separated). With --dp-ranks N, one endpoint stands for ranks 0..N-1 on consecutive ports."),
    Option("--replay-endpoint", "list", [],
           "vLLM replay ROUTER endpoint, one per --zmq-endpoint, same order (ports offset by rank like the PUB)."),
    Option("--dp-ranks", "int", 1, "Data-parallel ranks behind each endpoint; rank r listens on port + r, as vLLM offsets them."),
    Option("--topic", "str", "", "vLLM's kv-events topic (ZMQ subscription prefix)."),
    Option("--worker-id", "str", "", "Worker id in subjects and payloads. Default: $POD_NAME, else the host name."),
    Option("--nats-url", "list", [],
           "NATS server URL (repeatable for a cluster). Empty: start a local nats-server (needs the `embedded` extra)."),
    Option("--subject-prefix", "str", "kv", "First subject token(s): <prefix>.<worker>.<group>."),
    Option("--format", "choice", "msgpack", "Payload encoding.", ("msgpack", "json")),
    Option("--group-kind", "list", [], "Pin a group's kind: IDX=KIND (repeatable), e.g. 1=mamba."),
    Option("--keep-placeholders", "bool", False, "Forward window placeholders (block_size=0), flagged, instead of dropping them."),
    Option("--max-frame-bytes", "int", 16 * 1024 * 1024, "Largest payload frame accepted from ZMQ; larger ones are counted and skipped."),
    Option("--max-buffered-batches", "int", 10000, "Batches held in memory while NATS is slow or away; past it the oldest go and a gap record says so."),
    Option("--max-buffered-bytes", "int", 256 * 1024 * 1024, "Encoded bytes held in memory the same way (the bound for large batches); 0 for none."),
    Option("--zmq-rcvhwm", "int", 100000, "ZMQ SUB receive high-water mark (messages)."),
    Option("--coalesce-ms", "float", 0.5,
           "When vLLM batches come less than this apart, wait this long after taking some, so the next few go to NATS in one write (0: never wait). Slower streams and backlogs never wait."),
    Option("--replay-timeout", "float", 2.0, "Seconds to wait for a replay answer."),
    Option("--idle-probe-interval", "float", 2.0, "While a publisher is quiet, ask its replay socket this often for batches lost at the tail (0: never)."),
    Option("--http-host", "str", "0.0.0.0", "Address for /metrics, /healthz, /readyz."),
    Option("--http-port", "int", 9400, "Port for /metrics, /healthz, /readyz (0: any free port)."),
    Option("--log-format", "choice", "json", "Log line format.", ("json", "console")),
    Option("--log-level", "choice", "info", "Log level.", ("debug", "info", "warning", "error")),
    Option("--drain-timeout", "float", 10.0, "Seconds SIGTERM/SIGINT may take to flush and drain NATS."),
    Option("--jetstream", "bool", False, "Publish to a JetStream stream with acks and de-duplication, and resume from it on start."),
    Option("--stream-name", "str", "KV_EVENTS", "JetStream stream name (created or verified at start)."),
    Option("--stream-max-age", "float", 3600.0, "Stream limit: seconds a message is kept."),
    Option("--stream-max-bytes", "int", 1024 * 1024 * 1024, "Stream limit: bytes kept, oldest messages dropped first (-1: no bound)."),
    Option("--stream-max-msgs-per-subject", "int", -1, "Stream limit: messages kept per subject (-1: no bound). Costly at high rates: nats-server then deletes one old message of that subject, scattered through its files, for every new one."),
    Option("--stream-duplicate-window", "float", 120.0, "Stream de-duplication window in seconds (Nats-Msg-Id)."),
    Option("--stream-replicas", "int", 1, "Stream replicas."),
    Option("--js-max-pending", "int", 16384, "JetStream publishes in flight without an ack: enough to ride out a stream's pauses of a few hundred ms without holding up live delivery (a reconnect sends them again; --js-max-pending-bytes bounds their memory)."),
    Option("--js-max-pending-bytes", "int", 64 * 1024 * 1024, "Encoded bytes of JetStream publishes in flight without an ack (the window's memory bound for large batches)."),
    Option("--js-ack-timeout", "float", 5.0, "Seconds to wait for one JetStream ack before retrying."),
    Option("--registry-bucket", "str", "kv_workers", "JetStream key-value bucket for the worker registry (JetStream mode); empty disables it."),
    Option("--heartbeat-interval", "float", 5.0, "Seconds between worker registry heartbeats."),
    Option("--nats-user", "str", "", "NATS user name (password from KVB_NATS_PASSWORD or --nats-password-file)."),
    Option("--nats-password-file", "str", "", "File holding the NATS password."),
    Option("--nats-password", "secret", "", "NATS password: environment only (KVB_NATS_PASSWORD)."),
    Option("--nats-token-file", "str", "", "File holding a NATS token."),
    Option("--nats-token", "secret", "", "NATS token: environment only (KVB_NATS_TOKEN)."),
    Option("--nats-nkey-seed-file", "str", "", "File holding an NKey seed."),
    Option("--nats-creds-file", "str", "", "NATS .creds file (JWT and seed)."),
    Option("--nats-tls-ca", "str", "", "CA bundle to verify the NATS server."),
    Option("--nats-tls-cert", "str", "", "Client certificate for mutual TLS."),
    Option("--nats-tls-key", "str", "", "Client key for mutual TLS."),
)


class Settings(msgspec.Struct, frozen=True):
    zmq_endpoint: list[str]
    replay_endpoint: list[str]
    dp_ranks: int
    topic: str
    worker_id: str
    nats_url: list[str]
    subject_prefix: str
    format: str
    group_kind: dict[int, str]
    keep_placeholders: bool
    max_frame_bytes: int
    max_buffered_batches: int
    max_buffered_bytes: int
    zmq_rcvhwm: int
    coalesce_ms: float
    replay_timeout: float
    idle_probe_interval: float
    http_host: str
    http_port: int
    log_format: str
    log_level: str
    drain_timeout: float
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
    nats_user: str
    nats_password_file: str
    nats_password: str
    nats_token_file: str
    nats_token: str
    nats_nkey_seed_file: str
    nats_creds_file: str
    nats_tls_ca: str
    nats_tls_cert: str
    nats_tls_key: str

    def __repr__(self) -> str:  # secrets must never reach a log line through repr
        return f"Settings(worker_id={self.worker_id!r}, nats_url={[redact_url(u) for u in self.nats_url]!r}, ...)"

    def redacted(self) -> dict[str, Any]:
        """What is safe to log: secrets shown only as set or not, and no
        user:password@ or token@ inside a NATS URL."""
        out = msgspec.structs.asdict(self)
        for key in ("nats_password", "nats_token"):
            out[key] = "<set>" if out[key] else ""
        out["nats_url"] = [redact_url(u) for u in self.nats_url]
        return out

    def stream_endpoints(self) -> list[tuple[int, str, str | None]]:
        """(dp_rank, PUB endpoint, replay endpoint or None) for every publisher."""
        out: list[tuple[int, str, str | None]] = []
        for i, endpoint in enumerate(self.zmq_endpoint):
            replay = self.replay_endpoint[i] if i < len(self.replay_endpoint) else None
            for rank in range(self.dp_ranks):
                out.append((rank, offset_port(endpoint, rank), offset_port(replay, rank) if replay else None))
        return out


def redact_url(url: str) -> str:
    """`nats://user:secret@host:4222` → `nats://user:<redacted>@host:4222`;
    `nats://token@host` → `nats://<redacted>@host`."""
    if "@" not in url:
        return url
    try:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
    except ValueError:
        return "<redacted url>"
    host = parts.netloc.rpartition("@")[2]
    user = "<redacted>" if parts.password is None else f"{parts.username}:<redacted>"
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


_NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def _check_nats_security(values: dict[str, Any], check: Callable[[bool, str, str], None]) -> None:
    """Secrets, keys and certificates are read once here so that a bad one is a
    configuration error naming its option, not a retry loop or a crash later.
    Problems are described without quoting the files' contents."""
    for url in values["nats_url"]:
        if "://" in url:
            check(url.split("://", 1)[0] in _NATS_SCHEMES, "--nats-url",
                  f"{redact_url(url)!r}: scheme must be one of {', '.join(_NATS_SCHEMES)}")
    for flag in ("--nats-password-file", "--nats-token-file"):
        path = values[flag.lstrip("-").replace("-", "_")]
        if path:
            check(_read(path).strip() != "", flag, f"{path} is empty")
    if values["nats_nkey_seed_file"]:
        check(_valid_seed(_read(values["nats_nkey_seed_file"]).strip()), "--nats-nkey-seed-file",
              f"{values['nats_nkey_seed_file']} holds no valid NKey seed")
    creds = values["nats_creds_file"]
    if creds:
        text = _read(creds)
        seed = _between(text, "BEGIN USER NKEY SEED", "END USER NKEY SEED")
        check("BEGIN NATS USER JWT" in text and _valid_seed(seed), "--nats-creds-file",
              f"{creds} is not a NATS .creds file (a user JWT and a user NKey seed)")
    if values["nats_tls_ca"]:
        try:
            ssl.create_default_context(cafile=values["nats_tls_ca"])
        except (ssl.SSLError, ValueError, OSError) as exc:
            check(False, "--nats-tls-ca", f"{values['nats_tls_ca']}: not a usable CA bundle ({type(exc).__name__})")
    if values["nats_tls_cert"] and values["nats_tls_key"]:
        try:
            ssl.create_default_context().load_cert_chain(values["nats_tls_cert"], values["nats_tls_key"])
        except (ssl.SSLError, ValueError, OSError) as exc:
            check(False, "--nats-tls-cert",
                  f"{values['nats_tls_cert']} and --nats-tls-key do not load as a certificate and its key "
                  f"({type(exc).__name__})")


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def _between(text: str, begin: str, end: str) -> str:
    """The first non-marker line between two .creds markers."""
    inside = False
    for line in text.splitlines():
        if begin in line:
            inside = True
        elif end in line:
            break
        elif inside and line.strip():
            return line.strip()
    return ""


def _valid_seed(seed: str) -> bool:
    import nkeys  # type: ignore[import-untyped]

    try:
        nkeys.from_seed(bytearray(seed.encode())).wipe()
    except (nkeys.NkeysError, ValueError, TypeError):
        return False
    return True


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


_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False, "": False}


def _convert(opt: Option, raw: Any) -> Any:
    if opt.kind == "list":
        items = raw if isinstance(raw, list) else str(raw).split(",")
        return [item.strip() for item in items if item.strip()]
    if opt.kind == "bool":
        if isinstance(raw, bool):
            return raw
        word = str(raw).strip().lower()
        if word not in _BOOL_WORDS:
            raise ConfigError(opt.flag, f"expected true/false, got {raw!r}")
        return _BOOL_WORDS[word]
    if opt.kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(opt.flag, f"expected an integer, got {raw!r}") from None
    if opt.kind == "float":
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(opt.flag, f"expected a number, got {raw!r}") from None
    if opt.kind == "choice" and raw not in opt.choices:
        raise ConfigError(opt.flag, f"expected one of {', '.join(opt.choices)}, got {raw!r}")
    return str(raw)


def load_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        raw = getattr(args, opt.dest, None)
        if raw is None:
            raw = environ.get(opt.env)
        values[opt.dest] = opt.default if raw is None else _convert(opt, raw)
    return _validated(values, environ)


def _validated(values: dict[str, Any], environ: Mapping[str, str]) -> Settings:
    def check(cond: bool, flag: str, problem: str) -> None:
        if not cond:
            raise ConfigError(flag, problem)

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
    try:
        validate_prefix(values["subject_prefix"])
    except ValueError as exc:
        raise ConfigError("--subject-prefix", str(exc)) from None
    kinds: dict[int, str] = {}
    for spec in values["group_kind"]:
        try:
            idx, kind = parse_group_kind(spec)
        except ValueError as exc:
            raise ConfigError("--group-kind", str(exc)) from None
        kinds[idx] = kind
    values["group_kind"] = kinds
    check(values["max_frame_bytes"] >= 1024, "--max-frame-bytes", "must be at least 1024")
    check(values["max_buffered_batches"] >= 1, "--max-buffered-batches", "must be at least 1")
    check(values["max_buffered_bytes"] == 0 or values["max_buffered_bytes"] >= 1024 * 1024,
          "--max-buffered-bytes", "must be 0 (no bound) or at least 1 MiB")
    check(0 <= values["coalesce_ms"] <= 100, "--coalesce-ms", "must be 0..100")
    check(values["replay_timeout"] > 0, "--replay-timeout", "must be positive")
    check(values["idle_probe_interval"] >= 0, "--idle-probe-interval", "must be 0 or positive")
    check(0 <= values["http_port"] <= 65535, "--http-port", "must be 0..65535")
    check(values["drain_timeout"] > 0, "--drain-timeout", "must be positive")
    check(values["stream_max_age"] >= 0, "--stream-max-age", "must be 0 (no bound) or positive")
    check(values["stream_max_bytes"] == -1 or values["stream_max_bytes"] >= 1024 * 1024, "--stream-max-bytes",
          "must be -1 (no bound) or at least 1 MiB")
    check(values["stream_max_msgs_per_subject"] == -1 or values["stream_max_msgs_per_subject"] >= 1,
          "--stream-max-msgs-per-subject", "must be -1 (no bound) or at least 1")
    check(values["js_max_pending"] >= 1, "--js-max-pending", "must be at least 1")
    check(values["js_max_pending_bytes"] >= 1024 * 1024, "--js-max-pending-bytes", "must be at least 1 MiB")
    check(values["js_ack_timeout"] > 0, "--js-ack-timeout", "must be positive")
    check(values["heartbeat_interval"] > 0, "--heartbeat-interval", "must be positive")
    for flag in ("--nats-password-file", "--nats-token-file", "--nats-nkey-seed-file", "--nats-creds-file",
                 "--nats-tls-ca", "--nats-tls-cert", "--nats-tls-key"):
        path = values[flag.lstrip("-").replace("-", "_")]
        check(not path or os.path.isfile(path), flag, f"no such file: {path}")
    check(not ((values["nats_password"] or values["nats_password_file"]) and not values["nats_user"]),
          "--nats-user", "a NATS password needs a user name")
    check(bool(values["nats_tls_cert"]) == bool(values["nats_tls_key"]), "--nats-tls-cert",
          "client certificate and key go together")
    _check_nats_security(values, check)
    return msgspec.convert(values, Settings)


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


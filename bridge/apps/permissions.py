"""`kv-bridge nats-permissions`: the NATS users of a deployment, one role
each, printed as a nats-server `accounts` block or as `nsc` commands.

The roles (docs/security.md, the trust model):

- `bridge` (one per worker): publishes only its own worker's subjects, each
  rank's; reads back and rebuilds only its own (direct gets, one consumer
  of its own name and filter per rank); writes only its own registry key and
  snapshot keys; answers snapshot requests on its own ranks' subjects.
- `reader` (tail, watch, routers): subscribes to the events; reads the
  stream and the buckets (info, direct gets, consumers under its own names
  `kvr-<user>-<n>` only, so it can touch no other consumer); asks bridges
  for snapshots; publishes nothing else.
- `observe`: a reader that also answers its own service's requests.
- `admin`: everything, for setting up and inspecting; no process of the
  deployment runs as it.

Every user's replies come on an inbox prefix of its own, `_INBOX.<user>`,
and it may subscribe to that prefix only, so no user reads another's
replies; the clients take it from `--nats-inbox-prefix`
(`KVB_NATS_INBOX_PREFIX`).
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import msgspec

from bridge.client.consumer import CONSUMERS_PER_USER, consumer_name
from bridge.contract import DEFAULT_BUCKET, DEFAULT_STREAM, registry_key, validate_prefix, worker_token
from bridge.contract.snapshot import (
    DEFAULT_SNAPSHOT_BUCKET,
    SNAPSHOT_ROOT,
    SNAPSHOT_SERVICE,
    snapshot_key,
    snapshot_subject,
)
from bridge.runtime.access import DEFAULT_INBOX_PREFIX

# The observe service's defaults (bridge.apps.fleet.options, bridge.apps.fleet.service).
OBSERVE_SERVICE: Final = "kv-observe"
OBSERVE_SUBJECT: Final = "kvobserve"


class RoleKind(enum.Enum):
    BRIDGE = "bridge"
    READER = "reader"
    OBSERVE = "observe"
    ADMIN = "admin"


class Layout(msgspec.Struct, frozen=True):
    """What the permissions are for: the names a deployment uses."""

    workers: list[str] = []
    ranks: int = 1
    prefix: str = "kv"
    stream: str = DEFAULT_STREAM
    registry_bucket: str = DEFAULT_BUCKET
    snapshot_bucket: str = DEFAULT_SNAPSHOT_BUCKET
    readers: list[str] = msgspec.field(default_factory=lambda: ["reader"])
    observers: list[str] = msgspec.field(default_factory=lambda: ["observe"])
    observe_subject: str = OBSERVE_SUBJECT
    admin: str = "admin"


class Role(msgspec.Struct, frozen=True):
    """One NATS user: what it may publish and subscribe to, whether it may
    answer requests (once each, on their reply subject), and the inbox
    prefix its client must use."""

    user: str
    kind: RoleKind
    publish: list[str]
    subscribe: list[str]
    allow_responses: bool = False

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.user)


def inbox_prefix(user: str) -> str:
    return f"{DEFAULT_INBOX_PREFIX}.{user}"


def bridge_user(worker: str) -> str:
    return f"bridge-{worker_token(worker, 0)}"


def bridge_role(worker: str, layout: Layout) -> Role:
    """What one bridge needs, and nothing more."""
    prefix, stream = layout.prefix, layout.stream
    bucket, snapshots = layout.registry_bucket, layout.snapshot_bucket
    user = bridge_user(worker)
    publish: list[str] = []
    subscribe = [f"{inbox_prefix(user)}.>"]
    for rank in range(layout.ranks):
        token = worker_token(worker, rank)
        key = snapshot_key(worker, rank)
        rebuild = f"kvb-rebuild-{token}"
        publish += [f"{prefix}.{token}.>", f"$JS.API.DIRECT.GET.{stream}.{prefix}.{token}.>",
                    f"$JS.API.CONSUMER.CREATE.{stream}.{rebuild}.{prefix}.{token}.>",
                    f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{rebuild}", f"$JS.API.CONSUMER.DELETE.{stream}.{rebuild}"]
        if snapshots:
            # Read back through its own consumer, not direct gets: a consumer
            # shows the stored headers, so a copy on a key is told apart.
            kv_stream = f"KV_{snapshots}"
            publish += [f"$KV.{snapshots}.{key}", f"$KV.{snapshots}.{key}.>",
                        f"$JS.API.CONSUMER.CREATE.{kv_stream}.{rebuild}.$KV.{snapshots}.{key}",
                        f"$JS.API.CONSUMER.CREATE.{kv_stream}.{rebuild}.$KV.{snapshots}.{key}.>",
                        f"$JS.API.CONSUMER.MSG.NEXT.{kv_stream}.{rebuild}",
                        f"$JS.API.CONSUMER.DELETE.{kv_stream}.{rebuild}"]
        subscribe.append(snapshot_subject(prefix, worker, rank))
    publish += ["$JS.API.INFO", f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.CREATE.{stream}"]
    if bucket:
        publish += [f"$JS.API.STREAM.INFO.KV_{bucket}", f"$JS.API.STREAM.CREATE.KV_{bucket}",
                    f"$KV.{bucket}.{registry_key(worker)}"]
    if snapshots:
        publish += [f"$JS.API.STREAM.INFO.KV_{snapshots}", f"$JS.API.STREAM.CREATE.KV_{snapshots}"]
    subscribe += _service_discovery(SNAPSHOT_SERVICE)
    return Role(user, RoleKind.BRIDGE, publish, subscribe, allow_responses=True)


def reader_role(user: str, layout: Layout) -> Role:
    """Reads: the events, the stream and the buckets, snapshots from the
    bridges, and answers from observe's service. Its only consumers are its
    own, named `kvr-<user>-<n>` in the API subject (bridge.client.consumer):
    it cannot name, change, read the acks of or delete anyone else's."""
    prefix, base = layout.prefix, layout.observe_subject
    publish = ["$JS.API.INFO", f"{SNAPSHOT_ROOT}.{prefix}.*", f"$SRV.INFO.{SNAPSHOT_SERVICE}",
               f"{base}.prefix", f"{base}.workers", f"$SRV.PING.{OBSERVE_SERVICE}", f"$SRV.INFO.{OBSERVE_SERVICE}"]
    for name in _streams(layout):
        publish += [f"$JS.API.STREAM.INFO.{name}", f"$JS.API.STREAM.MSG.GET.{name}",
                    f"$JS.API.DIRECT.GET.{name}", f"$JS.API.DIRECT.GET.{name}.>"]
    # Consumers only under its own names, in the API subject, which JetStream
    # checks against the request: the snapshot bucket is read by direct gets only.
    for name in [layout.stream, *([f"KV_{layout.registry_bucket}"] if layout.registry_bucket else [])]:
        for n in range(CONSUMERS_PER_USER):
            own = consumer_name(user, n)
            publish += [f"$JS.API.CONSUMER.CREATE.{name}.{own}.>", f"$JS.API.CONSUMER.MSG.NEXT.{name}.{own}",
                        f"$JS.API.CONSUMER.DELETE.{name}.{own}"]
    return Role(user, RoleKind.READER, publish, [f"{prefix}.>", f"{inbox_prefix(user)}.>"])


def observe_role(user: str, layout: Layout) -> Role:
    """A reader that answers its own service (`<subject>.prefix`,
    `<subject>.workers`, and the service's discovery)."""
    reader = reader_role(user, layout)
    base = layout.observe_subject
    subscribe = [*reader.subscribe, f"{base}.prefix", f"{base}.workers", *_service_discovery(OBSERVE_SERVICE)]
    return Role(user, RoleKind.OBSERVE, reader.publish, subscribe, allow_responses=True)


def admin_role(user: str) -> Role:
    """Sets up and inspects: the stream, the buckets, their consumers."""
    return Role(user, RoleKind.ADMIN, [">"], [">"])


def roles(layout: Layout) -> list[Role]:
    out = [bridge_role(w, layout) for w in layout.workers]
    out += [reader_role(r, layout) for r in layout.readers]
    out += [observe_role(o, layout) for o in layout.observers]
    if layout.admin:
        out.append(admin_role(layout.admin))
    return out


def _streams(layout: Layout) -> list[str]:
    names = [layout.stream]
    names += [f"KV_{b}" for b in (layout.registry_bucket, layout.snapshot_bucket) if b]
    return names


def _service_discovery(service: str) -> list[str]:
    return ["$SRV.*", f"$SRV.*.{service}", f"$SRV.*.{service}.*"]


# -- output ----------------------------------------------------------------


def permissions_block(role: Role, indent: str = "") -> str:
    """The role as a nats-server `permissions` block, a subject a line."""
    def allow(subjects: list[str]) -> str:
        lines = ",\n".join(f"{indent}    {json.dumps(x)}" for x in subjects)
        return f"{{ allow: [\n{lines}\n{indent}  ] }}"

    out = f"{{\n{indent}  publish: {allow(role.publish)}\n{indent}  subscribe: {allow(role.subscribe)}\n"
    if role.allow_responses:
        out += f"{indent}  allow_responses: true\n"
    return out + f"{indent}}}"


def server_config(all_roles: Sequence[Role], account: str = "KV",
                  passwords: Mapping[str, str] | None = None) -> str:
    """An `accounts` block: one account with JetStream, a user per role.
    `passwords`: user → password (or its bcrypt hash); missing ones are
    printed as a placeholder to replace."""
    users = []
    for role in all_roles:
        password = (passwords or {}).get(role.user, f"<bcrypt of {role.user}'s password: nats server passwd>")
        users.append(f"      # {role.kind.value}; its client runs with --nats-inbox-prefix {role.inbox_prefix}\n"
                     f"      {{ user: {json.dumps(role.user)}, password: {json.dumps(password)},\n"
                     f"        permissions: {permissions_block(role, '        ')} }}")
    return (f"accounts {{\n  {account}: {{\n    jetstream: enabled\n    users: [\n" + ",\n".join(users)
            + "\n    ]\n  }\n}\n")


def _sh(word: str) -> str:
    return "'" + word.replace("'", "'\"'\"'") + "'"


def nsc_commands(all_roles: Sequence[Role], account: str = "KV") -> str:
    """The same users for decentralized auth (operator/account/user JWTs)."""
    out = [f"nsc add account {_sh(account)}",
           f"nsc edit account {_sh(account)} --js-mem-storage -1 --js-disk-storage -1 --js-streams -1 "
           "--js-consumer -1"]
    for role in all_roles:
        cmd = (f"nsc add user -a {_sh(account)} -n {_sh(role.user)} --allow-pub {_sh(','.join(role.publish))} "
               f"--allow-sub {_sh(','.join(role.subscribe))}")
        if role.allow_responses:
            cmd += " --allow-pub-response 1"
        out.append(f"# {role.kind.value}; its client runs with --nats-inbox-prefix {role.inbox_prefix}")
        out.append(cmd)
        out.append(f"nsc generate creds -a {_sh(account)} -n {_sh(role.user)} > {_sh(role.user + '.creds')}")
    return "\n".join(out) + "\n"


def as_json(all_roles: Sequence[Role]) -> str:
    return json.dumps([{"user": r.user, "role": r.kind.value, "inbox_prefix": r.inbox_prefix,
                        "publish": r.publish, "subscribe": r.subscribe, "allow_responses": r.allow_responses}
                       for r in all_roles], indent=2) + "\n"


# -- the command -------------------------------------------------------------


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "nats-permissions", allow_abbrev=False,
        help="Print each role's NATS permissions (bridge per worker, reader, observe, admin).",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--worker", action="append", default=[], help="A worker id (repeatable): one bridge user each.")
    p.add_argument("--ranks", type=int, default=1, help="Data-parallel ranks of every worker.")
    p.add_argument("--subject-prefix", default="kv")
    p.add_argument("--stream-name", default=DEFAULT_STREAM)
    p.add_argument("--registry-bucket", default=DEFAULT_BUCKET, help="'' if the bridges run without it.")
    p.add_argument("--snapshot-bucket", default=DEFAULT_SNAPSHOT_BUCKET, help="'' if the bridges run without it.")
    p.add_argument("--reader", action="append", default=None, help="A reader user (repeatable). Default: reader.")
    p.add_argument("--observe", action="append", default=None, help="An observe user (repeatable). Default: observe.")
    p.add_argument("--observe-subject", default=OBSERVE_SUBJECT, help="observe's --service-subject.")
    p.add_argument("--admin", default="admin", help="The admin user ('' for none).")
    p.add_argument("--account", default="KV")
    p.add_argument("--format", choices=("conf", "nsc", "json"), default="conf")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    try:
        layout = layout_from(args.worker, args.ranks, args.subject_prefix, args.stream_name, args.registry_bucket,
                             args.snapshot_bucket, args.reader, args.observe, args.observe_subject, args.admin)
    except ValueError as exc:
        print(f"kv-bridge nats-permissions: {exc}", file=sys.stderr)
        return 2
    all_roles = roles(layout)
    text = {"conf": lambda: server_config(all_roles, args.account), "nsc": lambda: nsc_commands(all_roles, args.account),
            "json": lambda: as_json(all_roles)}[args.format]()
    sys.stdout.write(text)
    return 0


def layout_from(workers: Iterable[str], ranks: int, prefix: str, stream: str, registry_bucket: str,
                snapshot_bucket: str, readers: list[str] | None, observers: list[str] | None,
                observe_subject: str, admin: str) -> Layout:
    """Raises ValueError naming what is wrong."""
    validate_prefix(prefix)
    if not 1 <= ranks <= 1024:
        raise ValueError("--ranks must be 1..1024")
    names = [*(readers if readers is not None else ["reader"]), *(observers if observers is not None else ["observe"]),
             *([admin] if admin else [])]
    for name in names:
        if not name or any(c in name for c in " .*>\t") or not name.isprintable():
            raise ValueError(f"user name {name!r} must be one subject token")
    return Layout(list(workers), ranks, prefix, stream, registry_bucket, snapshot_bucket,
                  readers if readers is not None else ["reader"],
                  observers if observers is not None else ["observe"], observe_subject, admin)

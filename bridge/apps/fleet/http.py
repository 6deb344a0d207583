"""`kv-bridge observe`'s HTTP endpoints on the shared small server
(`bridge.runtime.http`): /metrics, /healthz, /readyz, GET /v1/workers,
POST /v1/prefix, and the indexer API's POST /query and /query_by_hash (JSON). The routes live in the service; this module holds
what a request may cost."""

from __future__ import annotations

import anyio.abc

from bridge.runtime.http import Handler, Limits, Response
from bridge.runtime.http import serve_http as _serve

__all__ = ["LIMITS", "Handler", "Response", "serve_http"]

# A prefix query carries a prompt's token ids: a 1M-token prompt as JSON ints
# fits the body bound, and a slow router gets the time to send it.
LIMITS = Limits(max_head=16 * 1024, max_body=16 * 1024 * 1024, seconds=30)


async def serve_http(host: str, port: int, handler: Handler, *, task_status: anyio.abc.TaskStatus[int]) -> None:
    await _serve(host, port, handler, LIMITS, task_status=task_status)

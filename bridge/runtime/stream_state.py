"""A JetStream stream's state as `bridge.contract.holdings` needs it: first
and last sequence, and the interior deletions listed (nats-py's `stream_info`
cannot ask for them)."""

from __future__ import annotations

import json
from typing import Any

import nats.errors
import nats.js

from bridge.contract.holdings import StreamHoldings, holdings_from_state

JS_API = "$JS.API"


async def stream_holdings(js: nats.js.JetStreamContext, stream: str, timeout: float = 5.0) -> StreamHoldings:
    """Raises what nats-py's `stream_info` raises (nats.js.errors.NotFoundError
    for no such stream) when the stream cannot be read."""
    info = (await js.stream_info(stream)).state
    state: dict[str, Any] = {"first_seq": info.first_seq, "last_seq": info.last_seq,
                             "num_deleted": info.num_deleted or 0}
    if state["num_deleted"]:
        try:
            # nats-py has no public way to ask for the details, nor to reach the connection.
            state = await _state(js._nc, stream, timeout)
        except (nats.errors.Error, TimeoutError, ValueError):
            pass  # listed as unknown: the count alone says some are gone
    return holdings_from_state(state)


async def _state(nc: Any, stream: str, timeout: float) -> dict[str, Any]:
    body = json.dumps({"deleted_details": True}).encode()
    msg = await nc.request(f"{JS_API}.STREAM.INFO.{stream}", body, timeout=timeout)
    doc = json.loads(msg.data)
    if not isinstance(doc, dict) or "error" in doc:
        err = doc.get("error", {}) if isinstance(doc, dict) else {}
        raise nats.errors.Error(f"stream {stream}: {err.get('description', 'no state')}")
    state = doc.get("state")
    if not isinstance(state, dict):
        raise nats.errors.Error(f"stream {stream}: no state")
    return state

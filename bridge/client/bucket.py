"""The snapshot bucket, read as it stores its keys.

A direct get (nats-py's `KeyValue.get` on a bucket that allows them) answers
with the stored headers and the server's own in one set, so a copy that
someone's read stored on a key (bridge.contract.identity) looks like the
bridge's write. The stream's message get (`$JS.API.STREAM.MSG.GET.KV_<bucket>`,
which the reader role may call) answers with the stored headers alone:
`stored_value` refuses a copy there.
"""

from __future__ import annotations

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from bridge.contract.snapshot import stored_value


class SnapshotBucket:
    """One snapshot bucket; `value` is `read_bucket`'s get."""

    __slots__ = ("_js", "_stream", "_subject", "name")

    def __init__(self, js: JetStreamContext, name: str) -> None:
        self._js = js
        self.name = name
        self._stream = f"KV_{name}"
        self._subject = f"$KV.{name}."

    async def value(self, key: str) -> bytes | None:
        """The key's value; None when it has none or was deleted. Raises
        CopiedValue (a SnapshotUnavailable) for a copy stored there."""
        try:
            raw = await self._js.get_last_msg(self._stream, self._subject + key)
        except nats.js.errors.NotFoundError:
            return None
        return stored_value(key, raw.headers, raw.data)


async def open_snapshot_bucket(nc: NatsClient, bucket: str) -> SnapshotBucket | None:
    """The bucket, if the server has JetStream and the bucket exists."""
    if not bucket:
        return None
    js = nc.jetstream()
    try:
        await js.stream_info(f"KV_{bucket}")
    except (nats.errors.Error, TimeoutError):
        return None
    return SnapshotBucket(js, bucket)

"""The snapshot bucket as the bridge makes it."""

from __future__ import annotations

import nats
import pytest

from bridge.contract.snapshot import DEFAULT_SNAPSHOT_BUCKET
from bridge.producer.snapshot.bucket import open_bucket
from bridge.runtime.nats_server import NatsServerProcess

pytestmark = pytest.mark.anyio


async def test_the_bucket_allows_direct_gets(nats_server: NatsServerProcess) -> None:
    """A least-privilege bridge may read back only its own keys: direct gets
    name the key (`$JS.API.DIRECT.GET.KV_<b>.$KV.<b>.<key>`), the stream's
    message get does not; without direct gets its rebuild is refused the
    bucket (tests/snapshot/test_processes.py, least privilege)."""
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await open_bucket(js, DEFAULT_SNAPSHOT_BUCKET, replicas=1, max_age=3600)
        info = await js.stream_info(f"KV_{DEFAULT_SNAPSHOT_BUCKET}")
        assert info.config.allow_direct is True
    finally:
        await nc.close()

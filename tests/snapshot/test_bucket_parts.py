"""A bucket write shares the relay's NATS connection: its parts are small,
and each is put in an idle moment of the relay. A snapshot of megabytes in
parts of the server's max_payload (1 MiB) held the relay's batches behind
each one; the bucket still holds what a reader joins into the snapshot.
Real nats-server, real JetStream key-value bucket."""

from __future__ import annotations

import anyio
import nats
import pytest

from bridge.contract.snapshot import PART_OVERHEAD, decode_part, part_key, read_bucket, snapshot_key
from bridge.producer.snapshot.bucket import PART_BYTES, SnapshotWriter, open_bucket
from bridge.producer.snapshot.keeper import ResidencyKeeper
from bridge.producer.telemetry.metrics import Metrics
from bridge.runtime.nats_server import NatsServerProcess
from tests.client.builders import hi
from tests.snapshot.test_keeper_yields import Relay
from tests.snapshot.test_shed import WORKER, Bridge

pytestmark = pytest.mark.anyio


async def test_a_bucket_snapshot_goes_in_small_parts_each_while_the_relay_is_idle(
        nats_server: NatsServerProcess) -> None:
    relay = Relay(busy=False)
    keeper = ResidencyKeeper(WORKER, max_log_bytes=1 << 30, ranks=(0,), relay_busy=relay, yield_at_most=60.0)
    bridge = Bridge(keeper)
    for i in range(0, 60_000, 6):
        bridge.store(0, *(hi(i + j) for j in range(6)))
    keeper.catch_up()
    taken = await keeper.export(0)
    assert taken is not None
    snap, data = taken
    assert len(data) > 3 * PART_BYTES  # several parts, well under the server's 1 MiB max_payload

    nc = await nats.connect(nats_server.url)
    try:
        kv = await open_bucket(nc.jetstream(), "snaps", replicas=1, max_age=0.0)
        writer = SnapshotWriter(keeper, kv, Metrics(), interval=60.0, every_messages=1 << 30,
                                max_payload=nc.max_payload, rewrite_after=1e9)
        relay.busy = True
        head = None

        async def write() -> None:
            nonlocal head
            head = await writer.write(snap, data)

        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            await anyio.sleep(0.3)
            assert head is None and (await kv.status()).values == 0  # nothing put while the relay has work
            relay.busy = False
            with anyio.fail_after(20):
                while head is None:
                    await anyio.sleep(0.01)
        assert head is not None and head.parts == -(-len(data) // PART_BYTES)
        sizes = []
        for n in range(head.parts):
            entry = await kv.get(part_key(snapshot_key(WORKER, 0), head.slot, n))
            assert entry.value is not None
            sizes.append(len(decode_part(entry.value).data))
        assert max(sizes) == PART_BYTES and sum(sizes) == len(data)
        assert max(sizes) + PART_OVERHEAD < nc.max_payload

        async def get(key: str) -> bytes | None:
            try:
                return (await kv.get(key)).value
            except nats.js.errors.KeyNotFoundError:
                return None

        found = await read_bucket(get, WORKER, 0)
        assert found is not None and found[1] == snap
    finally:
        await nc.close()

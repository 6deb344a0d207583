"""`--prompt-data` (docs/security.md, "What a reader sees"): by default a
relayed store carries no prompt: as many token ids as vLLM sent, each 0, no
extra_keys (which hold cache_salt), no lookahead token ids; with `relay`
everything as vLLM sent it. Both payload formats, through a real bridge and
nats-server; the count of redacted token ids, which the residency rules
read (re-announcements), survives."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest

from bridge.apps.demo.publisher import WirePublisher
from bridge.contract import BlockStored, GroupMessage
from bridge.runtime.nats_server import NatsServerProcess
from tests.busutil import endpoints, make_settings, running_bridge, wait_until

pytestmark = pytest.mark.anyio

SALT = "tenant-secret-salt"
TOKENS = list(range(1000, 1032))


def _batch(k: int) -> bytes:
    from bridge.contract import KVEventBatch

    store = BlockStored(
        block_hashes=[k * 2 + 1, k * 2 + 2], parent_block_hash=None, token_ids=TOKENS, block_size=16, lora_id=None,
        medium="GPU", lora_name=None, extra_keys=[[SALT], None], group_idx=0, kv_cache_spec_kind="full_attention",
        lookahead_token_ids=[[7, 8, 9]],
    )
    return msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[store]))


async def _relayed(nats_server: NatsServerProcess, fmt: str, **options: Any) -> tuple[BlockStored, bytes]:
    import nats

    pub_ep, replay_ep = endpoints()
    settings = make_settings(zmq_endpoint=[pub_ep], replay_endpoint=[replay_ep], nats_url=[nats_server.url],
                             format=fmt, **options)
    got: list[bytes] = []
    nc = await nats.connect(nats_server.url)

    async def on_msg(msg: Any) -> None:
        got.append(msg.data)

    await nc.subscribe("kv.test-worker.0", cb=on_msg)
    publisher = WirePublisher(pub_ep.replace("127.0.0.1", "*"), replay_ep.replace("127.0.0.1", "*"))
    try:
        async with running_bridge(settings):
            for k in range(3):
                publisher.publish(_batch(k))
            await wait_until(lambda: len(got) >= 1, 20, "a relayed store")
    finally:
        publisher.close()
        await nc.close()
    decode = msgspec.json.decode if fmt == "json" else msgspec.msgpack.decode
    msg = decode(got[0], type=GroupMessage)
    event = msg.events[0]
    assert isinstance(event, BlockStored)
    return event, got[0]


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_by_default_no_prompt_leaves_the_bridge(nats_server: NatsServerProcess, fmt: str) -> None:
    event, raw = await _relayed(nats_server, fmt)
    assert event.token_ids == [0] * len(TOKENS)
    assert event.extra_keys is None and event.lookahead_token_ids is None
    assert SALT.encode() not in raw
    assert event.block_hashes and event.block_size == 16


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_relay_passes_the_prompt_on(nats_server: NatsServerProcess, fmt: str) -> None:
    event, raw = await _relayed(nats_server, fmt, prompt_data="relay")
    assert event.token_ids == TOKENS
    assert event.extra_keys == [[SALT], None] and event.lookahead_token_ids == [[7, 8, 9]]
    assert SALT.encode() in raw


def test_redacted_tokens_keep_their_count_for_the_residency_rules() -> None:
    """The index counts a store's token ids (re-announcement): the redacted
    msgpack array says as many as the original."""
    from bridge.producer.normalize.redact import PromptRedactor
    from bridge.residency.lean import LeanStored, token_count

    redactor = PromptRedactor()
    for _ in range(2):  # the second time from the redactor's cache
        for n in (0, 3, 15, 16, 300, 70_000):
            raw = msgspec.Raw(msgspec.msgpack.encode(list(range(n))))
            zeros = redactor.zeros(raw)
            assert msgspec.msgpack.decode(zeros) == [0] * n
            assert token_count(LeanStored(block_hashes=[], token_ids=zeros, block_size=16)) == n


def test_the_redactors_cache_of_counts_is_bounded() -> None:
    """Hostile frames with ever new token counts: zeros stay right, memory
    stays bounded."""
    from bridge.producer.normalize.redact import MAX_CACHED_COUNTS, PromptRedactor

    redactor = PromptRedactor()
    for n in range(1, MAX_CACHED_COUNTS + 500):
        zeros = redactor.zeros(msgspec.Raw(msgspec.msgpack.encode([5] * n)))
        if n % 997 == 0 or n > MAX_CACHED_COUNTS:
            assert msgspec.msgpack.decode(zeros) == [0] * n
    assert redactor.cached_counts == MAX_CACHED_COUNTS

"""The demo publisher's bytes are vLLM's bytes."""

import pytest

from bridge.apps.demo.wire_writer import cleared, encode_batch, removed, stored
from bridge.contract import BlockHash

kv = pytest.importorskip("vllm.distributed.kv_events")


def test_wire_writer_matches_vllms_encoder_byte_for_byte() -> None:
    import msgspec

    h: list[BlockHash] = [b"\x01" * 32, b"\x02" * 32]
    ours = encode_batch(1.5, [
        stored(h, None, [1, 2, 3], 16, group_idx=0, kind="full_attention"),
        stored([h[1]], h[0], [], 16, medium="CPU", group_idx=1, kind="sliding_window", sliding_window=64),
        stored([9], 8, [4], 1),
        removed([h[0]], group_idx=0),
        removed([9]),
        cleared(),
    ], dp_rank=2)
    theirs = msgspec.msgpack.encode(kv.KVEventBatch(ts=1.5, data_parallel_rank=2, events=[
        kv.BlockStored(block_hashes=h, parent_block_hash=None, token_ids=[1, 2, 3], block_size=16, lora_id=None,
                       medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention"),
        kv.BlockStored(block_hashes=[h[1]], parent_block_hash=h[0], token_ids=[], block_size=16, lora_id=None,
                       medium="CPU", lora_name=None, group_idx=1, kv_cache_spec_kind="sliding_window",
                       kv_cache_spec_sliding_window=64),
        kv.BlockStored(block_hashes=[9], parent_block_hash=8, token_ids=[4], block_size=1, lora_id=None,
                       medium="GPU", lora_name=None),
        kv.BlockRemoved(block_hashes=[h[0]], medium="GPU", group_idx=0),
        kv.BlockRemoved(block_hashes=[9], medium="GPU"),
        kv.AllBlocksCleared(),
    ]))
    assert ours == theirs

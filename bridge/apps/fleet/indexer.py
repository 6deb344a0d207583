"""The Mooncake Conductor indexer API of `kv-bridge observe`: `POST /query`
(by token ids) and `POST /query_by_hash` (by rolling hashes), as the design
doc kvcache-ai/Mooncake `docs/source/design/conductor/indexer-api-design.md`
names their fields and answers, mapped onto the fleet's index
(docs/observe.md, "The indexer API").

The answer is in tokens: `blocks × block_size` with the query's
`block_size`, each worker rank's blocks decided by the hybrid rule exactly
as `/v1/prefix` decides them (`ObserveState.prefix`): per instance,
`longest_matched` is its best rank over every medium, `DP` each rank's,
and each medium's figure the best rank when only that medium counts (every
group of the worker must resume from it). Bounds, hashing and the scope
(model, tenant, instance) are `/v1/prefix`'s, from the same code.

Registration happens on the bus (each engine's bridge writes its registry
entry), so `/register` and `/unregister` change nothing: `unsupported`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from bridge.apps.fleet.query import (
    BlockSize,
    Checkpoint,
    PrefixQuery,
    QueryError,
    check_range,
    decode_chain,
    decode_head,
    decode_tokens,
)
from bridge.apps.fleet.scope import Scope, tenant_of
from bridge.apps.fleet.state import ObserveState
from bridge.contract import DEFAULT_TENANT, BlockHash

# The design doc's media, and vLLM's names for them (`DISK` is its
# `STORAGE` tier); a medium vLLM names otherwise is answered under its own name.
MEDIA: dict[str, tuple[str, ...]] = {"GPU": ("GPU",), "CPU": ("CPU",), "DISK": ("STORAGE", "DISK")}
ANSWER_FIELDS = ("longest_matched", "DP")


class _Scoped(msgspec.Struct, forbid_unknown_fields=True):
    """The fields both queries share (the design doc's, then ours)."""

    model: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None  # the doc's deprecated field
    tenant_id: str = DEFAULT_TENANT
    instance_id: str | None = None
    block_size: BlockSize | None = None
    cache_salt: str | None = None
    # Ours, for hashing token ids as the engine does (`/v1/prefix`'s options).
    lora_path: str | None = None
    algo: str = "sha256"
    seed: str | None = None


class _TokensHead(_Scoped, forbid_unknown_fields=True):
    token_ids: msgspec.Raw = msgspec.Raw()


class _HashesHead(_Scoped, forbid_unknown_fields=True):
    seq_hashes: msgspec.Raw = msgspec.Raw()
    block_hash: msgspec.Raw = msgspec.Raw()  # the name in the doc's earlier drafts


_tokens_head = msgspec.json.Decoder(_TokensHead)
_hashes_head = msgspec.json.Decoder(_HashesHead)


class IndexerQuery(msgspec.Struct, frozen=True):
    """A decoded indexer query: the prefix query it amounts to, and its scope."""

    prefix: PrefixQuery
    scope: Scope
    block_size: int


def _scoped(head: _Scoped, by_tokens: bool) -> tuple[PrefixQuery, Scope, int]:
    """The query's own fields as a PrefixQuery's options and a scope."""
    if head.block_size is None:
        raise QueryError("'block_size' is required")
    check_range(head.block_size)
    lora_name = head.lora_name or None  # empty: the base model
    if lora_name is not None and head.lora_id is not None:
        raise QueryError("give 'lora_name' or the deprecated 'lora_id', not both")
    lora: tuple[str, str] | None = None
    if by_tokens:
        # vLLM hashes a LoRA request's blocks with the adapter's name and path.
        if head.lora_id is not None:
            raise QueryError("token ids cannot be hashed by 'lora_id': give 'lora_name' and 'lora_path'")
        if lora_name is not None:
            if not head.lora_path:
                raise QueryError("token ids of a LoRA request are hashed with the adapter's name and path: "
                                 "give 'lora_path' too, or ask /query_by_hash")
            lora = (lora_name, head.lora_path)
    tenant = head.tenant_id or DEFAULT_TENANT  # empty: the doc's default
    q = PrefixQuery(block_size=head.block_size, algo=head.algo, seed=head.seed, lora=lora,
                    cache_salt=head.cache_salt or None, model=head.model or None, tenant=tenant)
    return q, Scope(q.model, tenant, head.instance_id or None), head.block_size


async def decode_by_tokens(body: bytes, checkpoint: Checkpoint) -> tuple[IndexerQuery, Sequence[int]]:
    """`POST /query`: its fields, and its token ids packed."""
    head: _TokensHead = decode_head(body, _tokens_head)
    q, scope, bs = _scoped(head, by_tokens=True)
    tokens = await decode_tokens(head.token_ids, "token_ids", bs, checkpoint)
    if tokens is None:
        raise QueryError("'token_ids' is required")
    return IndexerQuery(msgspec.structs.replace(q, token_ids=[]), scope, bs), tokens


async def decode_by_hash(body: bytes, checkpoint: Checkpoint) -> IndexerQuery:
    """`POST /query_by_hash`: its fields and hashes (`seq_hashes`, or
    `block_hash` as earlier drafts name them)."""
    head: _HashesHead = decode_head(body, _hashes_head)
    q, scope, bs = _scoped(head, by_tokens=False)
    hashes = await decode_chain(head.seq_hashes, "seq_hashes", checkpoint)
    older = await decode_chain(head.block_hash, "block_hash", checkpoint)
    if hashes is not None and older is not None:
        raise QueryError("give 'seq_hashes' or 'block_hash', not both")
    chain = hashes if hashes is not None else older
    if chain is None:
        raise QueryError("'seq_hashes' is required")
    return IndexerQuery(msgspec.structs.replace(q, chain=chain), scope, bs)


def answer(state: ObserveState, iq: IndexerQuery, chain: list[BlockHash], transport: str,
           now: float | None = None, spent: float = 0.0) -> dict[str, Any]:
    """`{tenant_id: {instance_id: {longest_matched, GPU, CPU, DISK, ..., DP}}}`
    for every instance in the query's scope the index holds, 0s included."""
    t0 = time.perf_counter()
    now = time.time() if now is None else now
    q = iq.prefix
    skip = state.skipped(iq.scope, q.include_dead, now)
    index = state.index
    bs = iq.block_size
    instances: dict[str, dict[str, Any]] = {}
    held: set[str] = set()
    for m in index.longest_prefix(chain, include_suspect=q.include_suspect, include_unwatched=q.include_dead,
                                  skip_workers=skip):
        state.count_reuse(m)
        view = index.view(m.worker, m.dp_rank)
        if view is not None:
            for g in view.groups.values():
                held.update(g.media())
        out = instances.setdefault(m.worker, {"longest_matched": 0, **dict.fromkeys(MEDIA, 0), "DP": {}})
        out["longest_matched"] = max(out["longest_matched"], m.blocks * bs)
        out["DP"][str(m.dp_rank)] = m.blocks * bs
    media = dict(MEDIA)
    known = {name for names in MEDIA.values() for name in names}
    media.update({name: (name,) for name in sorted(held - known) if name not in ANSWER_FIELDS})
    for out in instances.values():
        for key in media:
            out.setdefault(key, 0)
    for key, names in media.items():
        if not instances or not held.intersection(names):
            continue  # no instance holds anything there: 0 for all
        for m in index.longest_prefix(chain, media=names, include_suspect=q.include_suspect,
                                      include_unwatched=q.include_dead, skip_workers=skip):
            out = instances[m.worker]
            out[key] = max(out[key], m.blocks * bs)
    by_tenant: dict[str, dict[str, Any]] = {iq.scope.tenant or DEFAULT_TENANT: {}}
    entries = state.entries()
    for worker in sorted(instances):
        out = instances[worker]
        out["DP"] = dict(sorted(out["DP"].items(), key=lambda kv: int(kv[0])))
        by_tenant.setdefault(tenant_of(entries.get(worker)), {})[worker] = out
    state.count_query(transport, any(o["longest_matched"] for o in instances.values()),
                      time.perf_counter() - t0 + spent)
    return by_tenant

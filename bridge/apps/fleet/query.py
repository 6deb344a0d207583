"""The prefix query of `kv-bridge observe`: its JSON form, its bounds, and
the chain it asks about, decoded and hashed in slices so that one query never
holds the event loop for long (docs/observe.md, "Bounds").

A query body is read in two steps: its small fields at once, its two long
arrays (`chain`, `token_ids`) piece by piece, a checkpoint between pieces;
token ids are hashed block by block with a checkpoint every `SLICE_TOKENS`
tokens. Everything the caller got wrong is a `QueryError` (HTTP 400)."""

from __future__ import annotations

from array import array
from collections.abc import Awaitable, Callable, MutableSequence, Sequence
from typing import Annotated, Any

import msgspec

from bridge.client.chain import ALGOS, ChainHasher, hash_function
from bridge.contract import BlockHash
from bridge.residency.hashes import as_int

MAX_CHAIN = 65_536  # blocks in one query (a 1M-token prompt at block size 16), given or computed
MAX_TOKENS = MAX_CHAIN * 64
U64_MAX = (1 << 64) - 1
DEFAULT_LIMIT = 16
# Bytes of a long array decoded between two checkpoints (about a millisecond of msgspec work).
SLICE_BYTES = 64 * 1024
# Tokens hashed between two checkpoints, and at most this many blocks (a few ms either way).
SLICE_TOKENS = 16_384
SLICE_BLOCKS = 1024

# msgspec takes bounds within int64 only: the 64-bit top is checked after decoding (`check_range`).
U64 = Annotated[int, msgspec.Meta(ge=0)]
BlockSize = Annotated[int, msgspec.Meta(ge=1)]

Checkpoint = Callable[[], Awaitable[None]]


class QueryError(ValueError):
    """A query the service cannot answer: the caller's fault (HTTP 400)."""


class QueryOptions(msgspec.Struct, forbid_unknown_fields=True):
    """Everything a prefix query says besides its chain or token ids."""

    block_size: BlockSize | None = None
    algo: str = "sha256"
    seed: str | None = None
    lora: tuple[str, str] | None = None
    cache_salt: str | None = None
    media: list[str] | None = None
    include_suspect: bool = False
    include_dead: bool = False
    min_blocks: U64 = 1
    limit: U64 = DEFAULT_LIMIT
    # The workers it is about (bridge.apps.fleet.scope): None, any.
    model: str | None = None
    tenant: str | None = None


class PrefixQuery(QueryOptions):
    """`POST /v1/prefix` and the `prefix` NATS endpoint. Either `chain` (block
    hashes in order: ints, or hex strings of vLLM's digests) or `token_ids`
    with `block_size` (and the engine's hashing options) to compute it.
    Every integer fits in 64 bits, unsigned."""

    chain: list[U64 | str] | None = None
    token_ids: list[U64] | None = None


class _Head(QueryOptions):
    """A PrefixQuery with its long arrays left undecoded."""

    chain: msgspec.Raw = msgspec.Raw()
    token_ids: msgspec.Raw = msgspec.Raw()


_head = msgspec.json.Decoder(_Head)
_chain_items = msgspec.json.Decoder(list[U64 | str])
_token_items = msgspec.json.Decoder(list[U64])
CHAIN, TOKENS = "chain", "token_ids"  # the two bounds' names


def usable_algos() -> tuple[str, ...]:
    """The hash algorithms this process can compute (xxhash needs its package)."""
    out = []
    for algo in ALGOS:
        try:
            hash_function(algo)(b"")
        except (RuntimeError, ImportError):
            continue
        out.append(algo)
    return tuple(out)


async def _array(raw: bytes, field: str, decoder: msgspec.json.Decoder[Any], out: MutableSequence[Any],
                 bound: Callable[[int], bool], checkpoint: Checkpoint, kind: str) -> bool:
    """A JSON array of scalars into `out`, decoded in slices cut at commas
    (its items hold none: ints and hex strings). False for an absent or null
    field."""
    text = raw.strip()
    if not text or text == b"null":
        return False
    if text[:1] != b"[" or text[-1:] != b"]":
        raise QueryError(f"'{field}' must be a list")
    inner = text[1:-1]
    pos, n = 0, len(inner)
    if not inner.strip():
        return True
    while pos <= n:
        end = inner.find(b",", pos + SLICE_BYTES) if pos + SLICE_BYTES < n else -1
        end = n if end < 0 else end
        piece = inner[pos:end]
        if not piece.strip():
            raise QueryError(f"'{field}': an empty item")
        try:
            items = decoder.decode(b"[" + piece + b"]")
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            raise QueryError(f"bad query: '{field}': {exc}") from None
        try:
            out.extend(items)
        except OverflowError:  # a packed array refuses what is past 64 bits
            raise QueryError(f"'{field}': an integer past 64 bits") from None
        if bound(len(out)):
            raise QueryError(f"'{field}' is over its bound ({_bound_text(kind)})")
        pos = end + 1
        if pos <= n:
            await checkpoint()
    return True


def _bound_text(kind: str) -> str:
    if kind == CHAIN:
        return f"at most {MAX_CHAIN} blocks"
    return f"at most {MAX_TOKENS} token ids, making at most {MAX_CHAIN} blocks"


def decode_head(body: bytes, decoder: msgspec.json.Decoder[Any]) -> Any:
    """A query's small fields, its long arrays left as msgspec.Raw."""
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:  # deep nesting: RecursionError
        raise QueryError(f"bad query: {exc}") from None


async def decode_chain(raw: msgspec.Raw, field: str, checkpoint: Checkpoint) -> list[int | str] | None:
    """A chain of block hashes (ints, hex strings) named `field`, within its
    bound, decoded between checkpoints; None when absent."""
    chain: list[int | str] = []
    found = await _array(bytes(raw), field, _chain_items, chain, lambda n: n > MAX_CHAIN, checkpoint, CHAIN)
    return chain if found else None


async def decode_tokens(raw: msgspec.Raw, field: str, block_size: int | None,
                        checkpoint: Checkpoint) -> Sequence[int] | None:
    """Token ids named `field`, within their bound at `block_size`, packed
    (8 bytes each) and decoded between checkpoints; None when absent."""
    bs = block_size or 1

    def too_many_tokens(n: int) -> bool:
        return n > MAX_TOKENS or n // bs > MAX_CHAIN

    tokens = array("Q")
    found = await _array(bytes(raw), field, _token_items, tokens, too_many_tokens, checkpoint, TOKENS)
    return tokens if found else None


async def decode_query(body: bytes, checkpoint: Checkpoint) -> tuple[PrefixQuery, Sequence[int] | None]:
    """The query in `body`, its long arrays decoded between checkpoints; its
    token ids apart, packed (8 bytes each), not in the struct."""
    head: _Head = decode_head(body, _head)
    chain = await decode_chain(head.chain, "chain", checkpoint)
    tokens = await decode_tokens(head.token_ids, "token_ids", head.block_size, checkpoint)
    fields = {f: getattr(head, f) for f in QueryOptions.__struct_fields__}
    check_range(head.block_size, head.min_blocks, head.limit)
    return PrefixQuery(chain=chain, token_ids=[] if tokens is not None else None, **fields), tokens


def check_range(*values: int | None) -> None:
    if any(v is not None and v > U64_MAX for v in values):
        raise QueryError("'block_size', 'min_blocks' and 'limit' are unsigned 64-bit integers")


def _hash_of(value: int | str) -> BlockHash:
    if type(value) is int:
        if value < 0 or value > U64_MAX:
            raise QueryError("a block hash as int is an unsigned 64-bit integer")
        return value
    text = str(value)
    if text.startswith(("0x", "0X")):
        text = text[2:]
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise QueryError(f"not a hex block hash: {value!r}") from None


async def _nothing() -> None:
    return None


async def query_chain(q: PrefixQuery, checkpoint: Checkpoint = _nothing, algos: tuple[str, ...] = ALGOS,
                      tokens: Sequence[int] | None = None) -> list[BlockHash]:
    """The block hashes `q` asks about: its chain, or the chain of its token
    ids (`tokens` when given, else `q.token_ids`; hashed a slice at a time, a
    checkpoint between slices). `algos`: the algorithms this process can
    compute."""
    if (q.chain is None) == (q.token_ids is None):
        raise QueryError("give exactly one of 'chain' and 'token_ids'")
    check_range(q.block_size, q.min_blocks, q.limit)
    if q.chain is not None:
        if len(q.chain) > MAX_CHAIN:
            raise QueryError(f"chain longer than {MAX_CHAIN} blocks")
        hashes: list[BlockHash] = []
        for start in range(0, len(q.chain), SLICE_BLOCKS):
            if start:
                await checkpoint()
            hashes.extend(_hash_of(v) for v in q.chain[start:start + SLICE_BLOCKS])
        return hashes
    if tokens is None:
        tokens = q.token_ids
    assert tokens is not None
    bs = q.block_size
    if not bs or bs <= 0 or bs > U64_MAX:
        raise QueryError("'token_ids' needs a positive 'block_size' (at most 2**64 - 1)")
    if len(tokens) > MAX_TOKENS:
        raise QueryError(f"more than {MAX_TOKENS} token ids")
    blocks = len(tokens) // bs
    if blocks > MAX_CHAIN:
        raise QueryError(f"{len(tokens)} token ids make {blocks} blocks of {bs}: at most {MAX_CHAIN}")
    if q.algo not in algos:
        known = "unknown" if q.algo not in ALGOS else "not available in this process"
        raise QueryError(f"algo {q.algo!r} is {known}; one of {', '.join(algos)}")
    try:
        hasher = ChainHasher(bs, algo=q.algo, seed=q.seed)
    except ValueError as exc:
        raise QueryError(str(exc)) from None
    per_slice = max(1, min(SLICE_BLOCKS, SLICE_TOKENS // bs))
    out: list[BlockHash] = []
    parent: bytes | None = None
    for i in range(blocks):
        parent = hasher.block_hash(parent, tokens[i * bs:(i + 1) * bs],
                                   hasher.extra_keys(i, lora=q.lora, cache_salt=q.cache_salt))
        out.append(parent)
        if (i + 1) % per_slice == 0 and i + 1 < blocks:
            await checkpoint()
    return out


async def int_form(chain: Sequence[BlockHash], checkpoint: Checkpoint = _nothing) -> list[BlockHash] | None:
    """`chain` in vLLM's int form (a slice at a time), or None when it holds no
    digest. An index that holds no digest matches a chain of digests by this
    form alone (bridge.residency.fleet), and far faster."""
    if bytes not in set(map(type, chain)):
        return None
    out: list[BlockHash] = []
    for start in range(0, len(chain), SLICE_BLOCKS * 16):
        if start:
            await checkpoint()
        out.extend(map(as_int, chain[start:start + SLICE_BLOCKS * 16]))
    return out

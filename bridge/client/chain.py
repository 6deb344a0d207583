"""A request's block-hash chain from its token ids, computed the way vLLM does.

A router that wants to ask the residency index about a request before sending
it needs the request's block hashes. vLLM (0.10.2 and later, checked against
0.32 and 0.33) computes them like this:

- the prompt is cut into full blocks of `block_size` tokens; a partial last
  block has no hash;
- block i's hash is ``H((parent, tuple(tokens of block i), extra_keys))``,
  where ``parent`` is block i-1's hash and, for block 0, a root hash
  (vLLM's ``NONE_HASH``): ``H(seed)`` with seed the engine's
  ``PYTHONHASHSEED``, or ``"vllm-none-hash"`` when the engine runs without it;
- ``H`` is the engine's ``--prefix-caching-hash-algo``: ``sha256`` (the
  default: SHA-256 of the object pickled with the highest protocol),
  ``sha256_cbor`` (SHA-256 of canonical CBOR), ``xxhash`` / ``xxhash_cbor``
  (XXH3-128 of the same two encodings; their root is random per process
  unless the engine has ``PYTHONHASHSEED``);
- ``extra_keys`` is None for plain text without LoRA or cache salt. With a LoRA
  adapter every block gets ``("lora", name, path)``; a request's
  ``cache_salt`` adds ``("cache_salt", salt)`` to block 0 only (in that order);
- KV events carry the 32-byte digests when the engine has
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``, else (the default) the digest
  read big-endian and cut to its low 64 bits (`bridge.client.as_int`). A chain
  of digests matches either form in `ResidencyIndex`.

Not covered: multimodal inputs and prompt embeddings (their extra keys need
the engine's processed features), speculative-decoding lookahead hashing
(vLLM 0.33's ``num_hash_lookahead_tokens``), and hybrid engines whose groups
differ in block size (hashes are then computed at the groups' common divisor
and a coarser group announces every k-th one: ``chain[k - 1::k]``).

docs/consumers.md ("Chains from token ids") lists the preconditions.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any, Literal

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_SEED = "vllm-none-hash"  # vLLM's root seed when the engine has no PYTHONHASHSEED

ExtraKeys = tuple[Any, ...] | None


# -- encodings ---------------------------------------------------------------


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    if n < 1 << 8:
        return bytes([major << 5 | 24, n])
    if n < 1 << 16:
        return bytes([major << 5 | 25]) + struct.pack(">H", n)
    if n < 1 << 32:
        return bytes([major << 5 | 26]) + struct.pack(">I", n)
    return bytes([major << 5 | 27]) + struct.pack(">Q", n)


def _cbor_int(value: int, out: list[bytes]) -> None:
    if value >= 0:
        major, n = 0, value
    else:
        major, n = 1, -1 - value
    if n < 1 << 64:
        out.append(_cbor_head(major, n))
        return
    # bignum (tags 2 and 3), as canonical encoders write integers past 64 bits
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    out.append(_cbor_head(6, 2 + major))
    out.append(_cbor_head(2, len(raw)) + raw)


def _cbor(value: Any, out: list[bytes]) -> None:
    if value is None:
        out.append(b"\xf6")
    elif value is True:
        out.append(b"\xf5")
    elif value is False:
        out.append(b"\xf4")
    elif isinstance(value, int):
        _cbor_int(value, out)
    elif isinstance(value, bytes | bytearray):
        out.append(_cbor_head(2, len(value)))
        out.append(bytes(value))
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out.append(_cbor_head(3, len(raw)))
        out.append(raw)
    elif isinstance(value, tuple | list):
        out.append(_cbor_head(4, len(value)))
        for item in value:
            _cbor(item, out)
    else:
        raise TypeError(f"block hash input holds a {type(value).__name__}: only None, bool, int, bytes, "
                        "str, tuple and list are encoded")


def canonical_cbor(value: Any) -> bytes:
    """Canonical CBOR (RFC 8949 §4.2.1: shortest heads) of the types a block
    hash input holds: None, bool, int, bytes, str, tuple/list (as arrays)."""
    out: list[bytes] = []
    _cbor(value, out)
    return b"".join(out)


def _pickled(protocol: int) -> Callable[[Any], bytes]:
    def encode(value: Any) -> bytes:
        return pickle.dumps(value, protocol=protocol)

    return encode


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("the xxhash algorithms need the `xxhash` package (pip install xxhash)") from exc
    return bytes(xxhash.xxh3_128_digest(data))


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def hash_function(algo: str = "sha256", pickle_protocol: int = pickle.HIGHEST_PROTOCOL) -> Callable[[Any], bytes]:
    """vLLM's `--prefix-caching-hash-algo` as a function of one Python object."""
    if algo not in ALGOS:
        raise ValueError(f"unknown prefix caching hash algorithm {algo!r}; one of {', '.join(ALGOS)}")
    encode = canonical_cbor if algo.endswith("_cbor") else _pickled(pickle_protocol)
    digest = _xxh3_128 if algo.startswith("xxhash") else _sha256

    def h(value: Any) -> bytes:
        return digest(encode(value))

    return h


# -- the chain ---------------------------------------------------------------


class ChainHasher:
    """Block hashes of token sequences, for one engine's hashing settings.

    `block_size`: the engine's block size in tokens (what its BlockStored
    events report; for a hybrid model, after vLLM raised it to the state page
    size). `algo`: the engine's `--prefix-caching-hash-algo`. `seed`: the
    engine's PYTHONHASHSEED, None when it has none (then the xxhash algorithms
    cannot be reproduced: vLLM picks a random root). `pickle_protocol`: for the
    pickle-based algorithms, the engine's Python's highest protocol (5 on every
    Python vLLM supports).
    """

    def __init__(self, block_size: int, *, algo: str = "sha256", seed: str | None = None,
                 pickle_protocol: int = pickle.HIGHEST_PROTOCOL) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if seed is None and algo.startswith("xxhash"):
            raise ValueError(f"{algo} without PYTHONHASHSEED: the engine's root hash is random, "
                             "so its chains cannot be computed elsewhere; pass the engine's seed")
        self.block_size = block_size
        self.algo = algo
        self.seed = DEFAULT_SEED if seed is None else seed
        self._hash = hash_function(algo, pickle_protocol)
        self.root = self._hash(self.seed)

    def block_hash(self, parent: bytes | None, tokens: Sequence[int], extra_keys: ExtraKeys = None) -> bytes:
        """One block's hash; `parent` None for the first block."""
        return self._hash((self.root if not parent else parent, tuple(tokens), extra_keys))

    def extra_keys(self, index: int, *, lora: tuple[str, str] | None = None,
                   cache_salt: str | None = None) -> ExtraKeys:
        """Block `index`'s extra keys for a text request: LoRA (name, path) on
        every block, the cache salt on block 0."""
        keys: list[tuple[str, ...]] = []
        if lora is not None:
            keys.append(("lora", lora[0], lora[1]))
        if cache_salt and index == 0:
            keys.append(("cache_salt", cache_salt))
        return tuple(keys) if keys else None

    def chain(self, token_ids: Sequence[int], *, lora: tuple[str, str] | None = None,
              cache_salt: str | None = None) -> list[bytes]:
        """The hashes of every full block of `token_ids`, in order (32-byte
        digests for the sha256 algorithms, 16 bytes for xxhash)."""
        out: list[bytes] = []
        parent: bytes | None = None
        b = self.block_size
        for i in range(len(token_ids) // b):
            parent = self.block_hash(parent, token_ids[i * b:(i + 1) * b],
                                     self.extra_keys(i, lora=lora, cache_salt=cache_salt))
            out.append(parent)
        return out

    def reusable(self, token_ids: Sequence[int], **keys: Any) -> list[bytes]:
        """The part of the chain vLLM may take from its cache: it always
        computes the prompt's last token again, so a hit covers at most
        (len - 1) // block_size blocks."""
        n = max(len(token_ids) - 1, 0) // self.block_size
        return self.chain(token_ids[:n * self.block_size], **keys)


def request_chain(token_ids: Sequence[int], block_size: int, *, algo: str = "sha256", seed: str | None = None,
                  lora: tuple[str, str] | None = None, cache_salt: str | None = None) -> list[bytes]:
    """`ChainHasher(block_size, algo=algo, seed=seed).chain(token_ids, ...)`."""
    return ChainHasher(block_size, algo=algo, seed=seed).chain(token_ids, lora=lora, cache_salt=cache_salt)

"""Block hashing for prefix caching.

A block's hash identifies its KV contents: the K/V of a token depend on the token and
on every token before it, so the hash of block ``i`` is chained over the hash of block
``i-1`` (the *parent*). Block 0's parent is a root hash derived from ``hash_seed``.
Extra keys that change the KV without changing the tokens (a per-request
``cache_salt``, a LoRA ``adapter_id``) are mixed into every block's hash, so two
requests with the same tokens but different salts never share blocks.

Only full blocks (exactly ``block_size`` tokens) are hashed; a partial block is never a
prefix-cache hit. The encoding is fixed and uses only ``hashlib.sha256`` and
little-endian integers, so a router in another process (or on another machine) with the
same ``hash_seed`` computes byte-identical keys. The scheme follows the chained block
hash of vLLM's automatic prefix caching (vLLM docs, "Automatic Prefix Caching"); the
byte layout is kvpage's own:

``sha256(b"kvpage.block.v1" | parent (32 bytes) | extra keys | int64-LE token ids)``

with extra keys encoded as, for each of (cache_salt, adapter_id): ``b"\\x00"`` when None,
else ``b"\\x01" | uint32-LE byte length | UTF-8 bytes``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from functools import lru_cache
from hashlib import sha256

from kvpage.errors import SpecError

#: a block hash: 32 raw sha256 bytes
BlockHash = bytes

_DOMAIN = b"kvpage.block.v1"
_ROOT_DOMAIN = b"kvpage.root.v1"


def root_hash(hash_seed: int = 0) -> BlockHash:
    """The parent hash of block 0 for a given seed.

    Args:
        hash_seed: any integer in the signed 64-bit range; processes that must agree on
            block hashes (engine and router) use the same seed.

    Raises:
        SpecError: ``hash_seed`` is not an int in [-2**63, 2**63).
    """
    if not isinstance(hash_seed, int) or not -(2**63) <= hash_seed < 2**63:
        raise SpecError(f"hash_seed: expected an int64, got {hash_seed!r}")
    return sha256(_ROOT_DOMAIN + struct.pack("<q", hash_seed)).digest()


def encode_extra_keys(cache_salt: str | None = None, adapter_id: str | None = None) -> bytes:
    """The byte encoding of the extra keys mixed into every block hash of a request."""
    out = bytearray()
    for key in (cache_salt, adapter_id):
        if key is None:
            out += b"\x00"
        else:
            raw = str(key).encode("utf-8")
            out += b"\x01" + struct.pack("<I", len(raw)) + raw
    return bytes(out)


@lru_cache(maxsize=64)
def _packer(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}q")


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        return _packer(len(token_ids)).pack(*token_ids)
    except struct.error:
        raise SpecError(
            f"token_ids: expected int64 token ids, got {list(token_ids)[:8]!r}..."
        ) from None


def chain_hash(parent: BlockHash, extra: bytes, token_ids: Sequence[int]) -> BlockHash:
    """The hash of one full block from its parent's hash, the encoded extra keys
    (:func:`encode_extra_keys`) and its ``block_size`` token ids (the byte layout of the
    module docstring).

    Raises:
        SpecError: a token id outside int64.
    """
    return sha256(_DOMAIN + parent + extra + _pack_tokens(token_ids)).digest()


_CHUNK_BLOCKS = 32


def iter_block_hashes(
    parent: BlockHash,
    extra: bytes,
    token_ids: Sequence[int],
    block_size: int,
    first: int,
    last: int,
) -> Iterator[BlockHash]:
    """Yield the chained hashes of blocks ``first .. last-1`` (all full) of ``token_ids``.

    ``parent`` is the hash of block ``first - 1`` (the root hash when ``first == 0``).
    Tokens are packed 32 blocks at a time, so stopping early (at the first prefix-cache
    miss) costs little. Same bytes as :func:`hash_block_tokens`.
    """
    step = 8 * block_size
    for c0 in range(first, last, _CHUNK_BLOCKS):
        c1 = min(c0 + _CHUNK_BLOCKS, last)
        packed = _pack_tokens(token_ids[c0 * block_size : c1 * block_size])
        for off in range(0, (c1 - c0) * step, step):
            parent = sha256(_DOMAIN + parent + extra + packed[off : off + step]).digest()
            yield parent


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    *,
    cache_salt: str | None = None,
    adapter_id: str | None = None,
    hash_seed: int = 0,
) -> BlockHash:
    """Hash one full block.

    Args:
        parent_hash: the previous block's hash; None for block 0 (then the root hash of
            ``hash_seed`` is the parent).
        token_ids: the block's ``block_size`` token ids (ints in the int64 range).
        cache_salt: per-request salt (isolates tenants), None = none.
        adapter_id: LoRA adapter identity, None = base model.
        hash_seed: seed of the root hash (used only when ``parent_hash`` is None).

    Returns:
        32 bytes (sha256 digest), identical in every process for identical inputs.

    Raises:
        SpecError: a token id outside int64, or a bad ``hash_seed``.
    """
    parent = root_hash(hash_seed) if parent_hash is None else parent_hash
    return chain_hash(parent, encode_extra_keys(cache_salt, adapter_id), token_ids)


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    adapter_id: str | None = None,
    hash_seed: int = 0,
    max_blocks: int | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of a token sequence.

    Args:
        token_ids: the request's tokens (prompt, optionally followed by outputs).
        block_size: tokens per block (>= 1).
        cache_salt, adapter_id, hash_seed: as in :func:`hash_block_tokens`.
        max_blocks: hash at most this many leading blocks (None = all full blocks).

    Returns:
        ``len(token_ids) // block_size`` hashes (or ``max_blocks`` if fewer); a trailing
        partial block is not hashed.

    Raises:
        SpecError: ``block_size < 1`` or a token id outside int64.
    """
    if block_size < 1:
        raise SpecError(f"block_size: expected >= 1, got {block_size}")
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    extra = encode_extra_keys(cache_salt, adapter_id)
    return list(iter_block_hashes(root_hash(hash_seed), extra, token_ids, block_size, 0, n))


__all__ = [
    "BlockHash",
    "chain_hash",
    "encode_extra_keys",
    "hash_block_tokens",
    "hash_request_blocks",
    "iter_block_hashes",
    "root_hash",
]

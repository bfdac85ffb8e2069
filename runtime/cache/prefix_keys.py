"""Keys of cached tokens that every replica computes alike (cache.dp_fetch): a token's K/V depends on
its position and every token before it, so a key names a token together with its whole prefix. The
prompt is cut into blocks of BLOCK tokens from position 0; block k's hash chains block k-1's (blake2b,
64 bits), and token j of block k gets that hash with j in its low bits. Only whole blocks have keys: a
token of the last, partial block has none (0), since its block's hash is not known yet."""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

BLOCK = 16  # tokens per hashed block
_LOW = np.uint64(BLOCK - 1)
_TOP = np.uint64(1 << 63)  # every key is nonzero: 0 means "no key"


def token_keys(tokens: Sequence[int], upto: int | None = None) -> np.ndarray:
    """uint64 keys of tokens[:upto] (0 for those past the last whole block)."""
    n = len(tokens) if upto is None else min(upto, len(tokens))
    whole = n // BLOCK
    ids = np.asarray(tokens[: whole * BLOCK], dtype=np.int64).reshape(whole, BLOCK)
    blocks = np.empty(whole, dtype=np.uint64)
    h = b""
    for k in range(whole):
        h = hashlib.blake2b(h + ids[k].tobytes(), digest_size=8).digest()
        blocks[k] = np.frombuffer(h, dtype=np.uint64)[0]
    keys = np.zeros(n, dtype=np.uint64)
    within = np.arange(BLOCK, dtype=np.uint64)
    keys[: whole * BLOCK] = ((blocks[:, None] & ~_LOW) | within[None, :] | _TOP).reshape(-1)
    return keys

"""Content hashes of KV blocks, for prefix caching.

A full block's hash covers its own token ids and, through its parent's hash, every token before
it: two sequences whose first `i` blocks have equal hashes have the same first `i * block_size`
tokens, so (on one model) the same keys and values there. A 128-bit BLAKE2b digest makes an
accidental collision, which would serve another prompt's KV, practically impossible.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT = b""  # the parent of a sequence's first block


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: list[int], num_blocks: int, block_size: int
) -> list[bytes]:
    """Grow `hashes`, the chained hashes of the first full blocks of `token_ids`, in place to
    the first `num_blocks`, and return it. The engine's cache and the routers' prefix index
    both hash prompts with this, so their hashes of a prompt are the same."""
    while len(hashes) < num_blocks:
        i = len(hashes)
        parent = hashes[-1] if hashes else ROOT
        hashes.append(block_hash(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return hashes

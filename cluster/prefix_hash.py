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

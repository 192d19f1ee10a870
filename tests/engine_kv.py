"""Prompt KV moved between two engines in one process, on the path the workers take: read out
of a held prefill's blocks as a KV sender reads them, written into reserved blocks as the
decode worker's KV client writes them (no transport in between)."""

from __future__ import annotations

from cluster.engine.kv_cache import KVExport
from cluster.errors import FailedPrecondition
from cluster.request import Request


def export_kv(engine, request_id: str) -> KVExport:
    """A held prefill's prompt KV as a KV sender reads it: its held blocks, out of the pool.
    The blocks stay held until `engine.release`."""
    block_ids, num_tokens = engine.held_blocks(request_id)
    k, v = engine.kv_cache.read(block_ids)
    return KVExport(engine.layout, num_tokens, k, v)


def import_kv(engine, request: Request, kv: KVExport, first_token: int) -> None:
    """Join `request` to `engine` with prompt KV computed elsewhere, on the decode worker's
    path (`DecodeWorker._fetched`): the layout checked as a KV client checks a handle's, blocks
    reserved, the KV written into them (a refused write cancels the import and frees them),
    then `finish_import` on the first token the prefill side sampled."""
    engine.layout.check_matches(kv.layout)
    if kv.num_tokens != request.num_context_tokens:
        raise FailedPrecondition(f"KV covers {kv.num_tokens} tokens, not the request's")
    block_ids = engine.reserve_import(request)
    try:
        engine.kv_cache.write(block_ids, kv.k, kv.v)
    except BaseException:
        engine.cancel_import(request.request_id)
        raise
    engine.finish_import(request.request_id, first_token)

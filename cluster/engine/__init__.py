"""The engine plane: one thread drives `Engine.step()` (schedule -> run the model -> update).
`Scheduler` picks the batch, `BlockManager` is the only owner of KV block allocation, `Sequence`
carries a request's tokens and blocks, `KVCache` is the paged pool, `ModelRunner` builds the
forward batch (or replays a captured decode step: `DecodeGraphs`), `Sampler` picks tokens (after
the logit bias and penalties of `penalties`), `Detokenizer` turns them into text; `AsyncEngine` is
the asyncio face a replica talks to.

May import: the `cluster` root modules and `cluster.model`.
"""

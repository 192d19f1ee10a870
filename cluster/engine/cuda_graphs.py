"""Decode steps replayed from captured graphs instead of launched kernel by kernel.

A decode step of the `small` preset is about 1,400 kernel launches; eagerly, the host's launch
time is the step time on a GPU. `DecodeGraphs` captures the step once per batch-size bucket
(`capture_sizes`, as vLLM's) at engine start, and replays the bucket that holds a batch:

- Inputs live in static buffers, preallocated for the largest bucket: token ids, positions,
  slot mapping, and the Triton path's varlen metadata (query starts and lengths, context
  starts, block tables). A step fills them with one host-to-device upload and device copies
  (no device sync); the graph of bucket `b` reads their first `b` rows.
- A batch of `n` sequences replays the smallest bucket `b >= n`. The `b - n` padding rows are
  token 0 at position 0, with the pool's `scratch_block` as their only block: their keys and
  values go there, never to a live sequence's block, and their logits are dropped.
- The graph holds the model forward, the KV store and the `lm_head`; sampling runs outside
  it, on the rows of the graph's logits output (valid until the next replay).

Only steps where every sequence decodes (one new token that samples) replay; prefill chunks
and anything wider than the largest bucket run eagerly. How a step is captured is the
`Capture` given: `CudaGraphCapture` on a GPU; `replay_by_calling` (run the same callable over
the same static buffers again) is the CPU's stand-in, so the buffers, the padding and the
bucket choice are tested without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from cluster.engine.kv_cache import KVCache
from cluster.engine.step_inputs import StepInputs
from cluster.model.attention import AttentionMetadata
from cluster.model.decoder import CausalLM
from cluster.model.triton_attention import TritonAttention, VarlenBatch, upload

log = logging.getLogger("ray.serve." + __name__)

Step = Callable[[], torch.Tensor]  # a decode step over the static buffers: its logits
Capture = Callable[[Step], Step]  # a step -> its replay


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's buckets: 1, 2, 4, then every multiple of 8 up to 256 and of 16 beyond, up to
    `max_num_seqs` (included, whatever it is)."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_num_seqs + 1, 16)]
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class CudaGraphCapture:
    """Captures steps as CUDA graphs on the current device. All graphs share one memory pool:
    captured largest first, the smaller ones reuse the larger ones' activation memory (only
    one replays at a time)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, step: Step) -> Step:
        step()  # warm-up, eagerly: compiles Triton kernels, sets up cuBLAS, outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay


def replay_by_calling(step: Step) -> Step:
    """The CPU's stand-in for a capture: the step itself, run again over the static buffers
    at each replay (once here, as a capture's warm-up runs it)."""
    step()
    return step


class DecodeGraphs:
    """Decode steps of up to `sizes[-1]` sequences over a paged pool, replayed per bucket.
    Every sequence's context must fit `max_blocks` blocks. Not thread-safe; the logits a
    `run` returns are overwritten by the next one."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        attention: TritonAttention,
        sizes: list[int],
        max_blocks: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.sizes = sizes
        self.max_blocks = max_blocks
        self.device = device
        self.block_size = kv_cache.layout.block_size
        self.scratch = kv_cache.scratch_block
        n, long, i32 = sizes[-1], torch.long, torch.int32
        # Every row starts as a padding row: its KV goes to the scratch block.
        self.input_ids = torch.zeros(n, dtype=long, device=device)
        self.positions = torch.zeros(n, dtype=long, device=device)
        self.slot_mapping = torch.full(
            (n,), self.scratch * self.block_size, dtype=long, device=device
        )
        self.context_starts = torch.zeros(n, dtype=i32, device=device)
        self.block_tables = torch.full((n, max_blocks), self.scratch, dtype=i32, device=device)
        self.query_starts = torch.arange(n, dtype=i32, device=device)  # one query per row
        self.query_lens = torch.ones(n, dtype=i32, device=device)
        self.graphs: dict[int, Step] = {}

    def fits(self, step: StepInputs) -> bool:
        """Whether a replay can run this step: every sequence decodes, and they fit a bucket.
        (A TP follower decides from the same message as its leader, so both replay or neither.)"""
        return len(step.lens) <= self.sizes[-1] and all(
            n == 1 and samples and len(table) <= self.max_blocks
            for n, samples, table in zip(step.lens, step.samples, step.block_tables, strict=True)
        )

    def bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    @torch.inference_mode()
    def capture(self, capture: Capture) -> None:
        """Capture every bucket's step, largest first (see `CudaGraphCapture`)."""
        for size in reversed(self.sizes):
            self.graphs[size] = capture(self._step(size))

    def _step(self, size: int) -> Step:
        """The forward of the first `size` rows of the static buffers, to logits."""
        varlen = VarlenBatch(
            self.query_starts[:size],
            self.query_lens[:size],
            self.context_starts[:size],
            self.block_tables[:size],
            max_query_len=1,
        )
        meta = AttentionMetadata(self.slot_mapping[:size], None, None, None, varlen, self.attention)
        ids, positions, layers = (
            self.input_ids[:size],
            self.positions[:size],
            self.kv_cache.layers(),
        )

        def step() -> torch.Tensor:  # [size, vocab] float32
            return self.model.logits(self.model(ids, positions, layers, meta))

        return step

    @torch.inference_mode()
    def run(self, step: StepInputs) -> torch.Tensor:  # [n, vocab] float32
        """Fill the static buffers with this step's `n` sequences and padding up to their
        bucket, replay the bucket's graph, and return the sequences' logits, in order."""
        n = len(step.lens)
        size, bs = self.bucket(n), self.block_size
        width = max(len(table) for table in step.block_tables)
        pad = size - n
        ids = list(step.token_ids) + [0] * pad
        positions = list(step.starts) + [0] * pad
        rows = zip(step.starts, step.block_tables, strict=True)
        slots = [table[p // bs] * bs + p % bs for p, table in rows]
        slots += [self.scratch * bs] * pad
        # Columns past a row's own table are never read (the kernel stops at the block of the
        # row's position), nor are those past `width`, left from earlier steps.
        tables = []
        for table in step.block_tables:
            tables += table
            tables += [self.scratch] * (width - len(table))
        tables += [self.scratch] * (width * pad)
        host = upload([*ids, *positions, *slots, *tables], torch.long, self.device)
        ids_d, positions_d, slots_d, tables_d = host.split([size, size, size, size * width])
        self.input_ids[:size].copy_(ids_d)
        self.positions[:size].copy_(positions_d)
        self.slot_mapping[:size].copy_(slots_d)
        self.context_starts[:size].copy_(positions_d)  # int64 -> int32, on the device
        self.block_tables[:size, :width].copy_(tables_d.view(size, width))
        return self.graphs[size]()[:n]


def capture_decode_graphs(
    model: CausalLM,
    kv_cache: KVCache,
    attention: TritonAttention,
    max_num_seqs: int,
    max_model_len: int,
    device: torch.device,
    capture: Capture | None = None,
) -> DecodeGraphs:
    """`DecodeGraphs` for up to `max_num_seqs` sequences of up to `max_model_len` tokens, every
    bucket captured (`CudaGraphCapture` unless `capture` is given); logs the time it took and,
    on a GPU, the device memory the graphs hold."""
    began = time.perf_counter()
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    max_blocks = -(-max_model_len // kv_cache.layout.block_size)
    graphs = DecodeGraphs(
        model, kv_cache, attention, capture_sizes(max_num_seqs), max_blocks, device
    )
    graphs.capture(capture or CudaGraphCapture())
    held = free - torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    log.info(
        "captured %d decode graphs (batch sizes %d..%d) in %.2f s, %.1f MiB of device memory",
        len(graphs.sizes),
        graphs.sizes[0],
        graphs.sizes[-1],
        time.perf_counter() - began,
        held / (1 << 20),
    )
    return graphs

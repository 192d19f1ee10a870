"""The engine benchmark's systems, each giving a `Timeline` of when every request got each token:
pdserve's `Engine.step()` loop, transformers `generate()` (one left-padded batch) and
`generate_batch()` (its continuous batching)."""

from __future__ import annotations

import dataclasses
import time

import torch

from benchmarks.engine_workload import EngineBenchConfig, Timeline
from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from cluster.engine.engine import Engine
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from cluster.structured_output import StructuredOutput

SYSTEMS = ("pdserve", "hf generate", "hf generate_batch")


class PdserveRunner:
    def __init__(self, cfg: EngineBenchConfig) -> None:
        biggest = max(cfg.batches)
        per_seq = -(-(cfg.prompt_len + cfg.decode_len) // cfg.block_size)
        model = ModelConfig(
            str(cfg.model_dir), dtype=cfg.dtype, device=cfg.device, cuda_graphs=cfg.cuda_graphs
        )
        cache = CacheConfig(block_size=cfg.block_size, num_blocks=biggest * per_seq + 8)
        batch = SchedulerConfig(max_num_seqs=biggest, max_num_batched_tokens=cfg.batch_tokens)
        self.engine = Engine(EngineConfig(model=model, cache=cache, scheduler=batch))
        self.cfg, self.runs = cfg, 0

    @property
    def vocab_size(self) -> int:
        return self.engine.runner.model.spec.vocab_size

    def weight_bytes(self) -> int:
        """Bytes a batch-1 decode step must read: every weight once, except that the input
        embedding table is only row-gathered (unless it doubles as the tied lm_head)."""
        model = self.engine.runner.model
        params = {p.data_ptr(): p for p in model.parameters()}
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        if embed.data_ptr() != head.data_ptr():
            params.pop(embed.data_ptr())
        return sum(p.numel() * p.element_size() for p in params.values())

    def run(self, prompts: list[list[int]], structured: StructuredOutput | None = None) -> Timeline:
        self.runs += 1
        params = SamplingParams(
            max_tokens=self.cfg.decode_len, temperature=0.0, ignore_eos=True, structured=structured
        )
        ids = [f"r{self.runs}-{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts, strict=True):
            self.engine.add_request(Request(rid, tuple(p), params))
        times: dict[str, list[float]] = {rid: [] for rid in ids}
        start = time.perf_counter()
        while self.engine.has_work():
            outputs = self.engine.step()
            now = time.perf_counter()
            for out in outputs:
                times[out.request_id].extend(now for _ in out.token_ids)
        assert self.engine.scheduler.blocks.num_used == 0, "KV blocks leaked"
        return Timeline(start, [times[rid] for rid in ids])


class HFGenerateRunner:
    """`model.generate()` on one left-padded batch; a logits processor stamps every step."""

    def __init__(self, model, cfg: EngineBenchConfig) -> None:
        self.model = model
        self.cfg = cfg

    def run(self, prompts: list[list[int]]) -> Timeline:
        from transformers import LogitsProcessor, LogitsProcessorList

        stamps: list[float] = []

        sync = self.cfg.sync

        class Stamp(LogitsProcessor):
            def __call__(self, input_ids, scores):
                sync()  # the step's logits exist; on a GPU the host is otherwise ahead
                stamps.append(time.perf_counter())
                return scores

        pad = self.model.generation_config.pad_token_id or 0
        width = max(len(p) for p in prompts)
        device = self.cfg.device
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        n = self.cfg.decode_len
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([Stamp()]),
            )
        assert out.shape[1] == width + n and len(stamps) == n, (out.shape, len(stamps))
        return Timeline(start, [list(stamps) for _ in prompts])


class HFGenerateBatchRunner:
    """`model.generate_batch()` (continuous batching); it stamps tokens itself."""

    def __init__(self, model, cfg: EngineBenchConfig) -> None:
        self.model = model
        self.cfg = cfg

    def run(self, prompts: list[list[int]]) -> Timeline:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        cfg = self.cfg
        page = 256
        per_seq = -(-(cfg.prompt_len + cfg.decode_len) // page)
        # Its FIFO scheduler admits at most one new prompt per step once under 15% of the
        # blocks are free; leave that headroom so the batch is not serialised (pdserve's pool,
        # sized for the largest batch, has more than that for every smaller one).
        num_blocks = -(-len(prompts) * per_seq * 100 // 80) + 1
        gen = GenerationConfig(
            do_sample=False, max_new_tokens=cfg.decode_len, eos_token_id=-1, pad_token_id=0
        )
        # Field names moved between transformers releases (5.17: block_size; 5.24: page_size and
        # auto_switch_to_flash): pass what this version has.
        known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
        options = {
            "page_size" if "page_size" in known else "block_size": page,
            "num_blocks": num_blocks,
            "max_batch_tokens": cfg.batch_tokens,
            "max_requests_per_batch": len(prompts),
        }
        if "auto_switch_to_flash" in known:
            options["auto_switch_to_flash"] = False
        cb = ContinuousBatchingConfig(**options)
        out = self.model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=cb, record_timestamps=True
        )
        results = list(out.values())
        assert len(results) == len(prompts), "generate_batch lost requests"
        for r in results:
            assert r.error is None and len(r.generated_tokens) == cfg.decode_len, r
        return Timeline(min(r.lifespan[0] for r in results), [r.timestamps for r in results])

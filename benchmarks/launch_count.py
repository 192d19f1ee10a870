"""Kernel launches in one decode step (model forward + logits) of the GPU's Triton path, with the
fused kernels (`cluster/model/triton_fused.py`) and without them (Triton attention, eager torch
ops for rope + KV store, residual add + RMSNorm and SiLU * up).

    python -m benchmarks.launch_count [--preset small] [--batch 4] [--out FILE]

Counted two ways: `dispatched`, every Triton kernel call and every torch op but views and
allocations (a TorchDispatchMode; anywhere, a CPU under Triton's interpreter); `cuda kernels`,
what torch.profiler records on the device (CUDA only).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from contextlib import contextmanager

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.report import add_out_option, header, publish  # noqa: E402
from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from cluster.engine.engine import Engine  # noqa: E402
from cluster.model import decoder  # noqa: E402
from cluster.model.make_model import cached_model  # noqa: E402
from cluster.model.triton_attention import TritonAttention  # noqa: E402
from cluster.request import Request  # noqa: E402
from cluster.sampling_params import SamplingParams  # noqa: E402

# Ops that launch nothing: views are metadata, allocations are the caching allocator's.
_FREE = {"empty", "empty_like", "empty_strided", "detach", "alias", "lift_fresh", "split"}
_FREE |= {"split_with_sizes", "chunk", "unbind"}


class LaunchCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.in_triton = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.in_triton and not func.is_view and name not in _FREE:
            if name.startswith("index") and _boolean_index(args):
                name += "[bool]"  # a mask's result size is read back from the device: a sync
            self.ops[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


def _boolean_index(args: tuple) -> bool:
    """Whether an aten.index / index_put call indexes by a boolean mask."""
    indices = args[1] if len(args) > 1 and isinstance(args[1], list | tuple) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


# Ops that read a device value back to the host: on a GPU a sync (and an error while a CUDA
# graph captures). Seen on any device by what a step dispatches (`dispatched`); Python-side
# reads (`tolist`, `numpy`) dispatch nothing and are not seen.
HOST_SYNCS = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal"}
HOST_SYNCS |= {"aten.allclose", "aten.nonzero", "aten.masked_select", "aten.repeat_interleave"}
HOST_SYNCS |= {"aten.unique", "aten._unique2", "aten.unique_consecutive", "aten.unique_dim"}
HOST_SYNCS |= {"aten.index[bool]", "aten.index_put[bool]", "aten.index_put_[bool]"}


@contextmanager
def counting():
    """Count torch ops and Triton launches (not the torch ops the interpreter runs inside one)."""
    from triton.runtime.jit import KernelInterface

    counter, getitem = LaunchCounter(), KernelInterface.__getitem__

    def launch(kernel, grid):
        def call(*args, **kwargs):
            counter.ops[f"triton.{kernel.__name__}"] += 1
            counter.in_triton = True
            try:
                return getitem(kernel, grid)(*args, **kwargs)
            finally:
                counter.in_triton = False

        return call

    KernelInterface.__getitem__ = launch
    try:
        with counter:
            yield counter
    finally:
        KernelInterface.__getitem__ = getitem


def dispatched(run) -> set[str]:
    """The torch ops and Triton kernels `run()` dispatches (not those inside a Triton kernel)."""
    with counting() as counter:
        run()
    return set(counter.ops)


def decode_batch(preset: str, batch: int) -> tuple[Engine, object]:
    """An engine on the Triton path and the ForwardBatch of a decode step of `batch` sequences."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Plain GEMMs, as on a GPU: the CPU's packed GEMM is a C++ call the dispatch mode cannot see.
    path = str(cached_model(preset))
    model = ModelConfig(path, device=device, cuda_graphs=False, packed_weights=False)
    engine = Engine(EngineConfig(model, CacheConfig(num_blocks=8 * batch), SchedulerConfig()))
    engine.runner.varlen_attention = TritonAttention(engine.runner.sliding_window)
    for i in range(batch):
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.add_request(Request(f"r{i}", tuple(range(1, 18 + i)), params))
    batches, prepare = [], engine.runner.prepare
    engine.runner.prepare = lambda scheduled: batches.append(prepare(scheduled)) or batches[-1]
    while len(batches) < 2:  # the prompts' step, then the first decode step
        engine.step()
    return engine, batches[-1]


def count(engine: Engine, batch, fused: bool) -> tuple[Counter[str], int | None]:
    model, layers = engine.runner.model, engine.kv_cache.layers()
    # Unfused: the Triton path as it ran before the fused kernels (eager steps around attention).
    kernels, decoder.TRITON = decoder.TRITON, decoder.TRITON if fused else decoder.EAGER
    try:

        def step():
            return model.logits(model(batch.input_ids, batch.positions, layers, batch.attention))

        with torch.inference_mode():
            step()  # compile and warm up
            with counting() as counter:
                step()
            cuda = None
            if torch.cuda.is_available():
                activities = [torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=activities) as prof:
                    step()
                    torch.cuda.synchronize()
                cuda = sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    finally:
        decoder.TRITON = kernels
    return counter.ops, cuda


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=4)
    add_out_option(p, "launch_count")
    a = p.parse_args(argv)
    engine, batch = decode_batch(a.preset, a.batch)
    layers = engine.runner.model.spec.num_layers
    lines = [
        *header("Kernel launches in one decode step", "launch_count", argv or sys.argv[1:]),
        f"- `{a.preset}`, decode batch {a.batch}, {layers} layers, forward + logits",
        "",
        "| Triton path | dispatched | per layer | cuda kernels |",
        "|---|---|---|---|",
    ]
    for fused in (False, True):
        ops, cuda = count(engine, batch, fused)
        total = sum(ops.values())
        name, cuda = "fused" if fused else "unfused", cuda if cuda is not None else "-"
        lines.append(f"| {name} | {total} | {total / layers:.1f} | {cuda} |")
    return publish("\n".join(lines) + "\n", a.out)


if __name__ == "__main__":
    main()

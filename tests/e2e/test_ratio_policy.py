"""The ratio policy keeps the prefill:decode split right at run time, on a real local Ray: a
load that shifts from prompt-heavy to decode-heavy and back moves 3 engine replicas from
2P:1D to 1P:2D and back, as Serve's own replica counts show, no request fails, and each
decision is in `GetStats` and `pdserve status`."""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.cli.main import main
from cluster.config import SchedulerConfig
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.serving.autoscaling import AppAutoscaling, AutoscalingSettings, RatioPolicySettings
from tests.ray_fixtures import app_metadata, deploy, small_app_config, stub, wait_for_idle

pytestmark = pytest.mark.slow
APP = "ratio"
PROFILE = Path(__file__).parents[2] / "cluster/planner/profiles/cpu-small-v1.json"
PROMPT_HEAVY = [(tuple((i * 31 + j * 7) % 4000 + 60 for j in range(600)), 2) for i in range(6)]
DECODE_HEAVY = [(tuple(range(10 + i, 16 + i)), 120) for i in range(6)]


def running_replicas() -> dict[str, int]:
    from ray import serve
    from ray.serve._private.common import ReplicaState

    deployments = serve.status().applications[APP].deployments
    return {name: d.replica_states.get(ReplicaState.RUNNING, 0) for name, d in deployments.items()}


@pytest.fixture(scope="module")
def ratio_app(ray_serve, tokenizer_model_dir):
    from ray import serve

    base = small_app_config(str(tokenizer_model_dir))
    fast = dict(upscale_delay_s=1.0, downscale_delay_s=2.0, look_back_period_s=2.0)
    pool = AutoscalingSettings(min_replicas=1, max_replicas=2, **fast)
    prefill = replace(
        base.prefill,
        # Repeated prompts would be nearly free with prefix caching: off, so they cost.
        cache=replace(base.prefill.cache, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=256),
        autoscaling=pool,
    )
    ratio = RatioPolicySettings(
        profile=str(PROFILE),
        total_replicas=3,
        slo_ttft_ms=3000,
        slo_itl_ms=200,
        interval_s=1.0,
        window_s=6.0,
        min_requests=4,
        sim_requests=32,
    )
    config = replace(
        base,
        prefill=prefill,
        decode=replace(base.decode, autoscaling=pool),
        autoscaling=AppAutoscaling(ratio_policy=ratio),
    )
    deploy(config, APP, "/ratio")
    yield ray_serve
    serve.delete(APP)


class Load:
    """`concurrency` clients sending `cases` round-robin until `stop`; every answer recorded
    (its token count, or the error)."""

    def __init__(self, ends, concurrency: int) -> None:
        self.ends, self.concurrency = ends, concurrency
        self.cases = PROMPT_HEAVY
        self.done: list[tuple[int, int]] = []  # (asked, got) tokens
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(concurrency)
        self._futures = [self._pool.submit(self._client, k) for k in range(concurrency)]

    def _client(self, k: int) -> None:
        s, i = stub(self.ends), k
        while not self._stop.is_set():
            ids, n = self.cases[i % len(self.cases)]
            i += self.concurrency
            sampling = pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            request = pb.GenerateRequest(prompt_token_ids=list(ids), sampling=sampling)
            try:
                msgs = list(s.Generate(request, metadata=app_metadata(APP), timeout=120))
                self.done.append((n, sum(len(m.token_ids) for m in msgs)))
            except Exception as e:  # counted: the test wants none
                self.failed.append(repr(e))

    def stop(self) -> None:
        self._stop.set()
        for f in self._futures:
            f.result()
        self._pool.shutdown()


def follow(load: Load, cases, split: tuple[int, int], timeout: float = 150.0) -> float:
    """Send `cases` until Serve runs `split` (prefill, decode) replicas, then a few seconds
    more across it. Returns how long the split took to follow."""
    load.cases = cases
    began = time.monotonic()
    want = {"Prefill": split[0], "Decode": split[1]}
    seen = []
    while time.monotonic() - began < timeout:
        counts = running_replicas()
        seen.append(counts)
        if all(counts.get(k) == v for k, v in want.items()):
            took = time.monotonic() - began
            time.sleep(3.0)
            return took
        time.sleep(0.5)
    raise AssertionError(f"the pools never reached {want}: {seen[-5:]}")


def status_json(ends) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["status", "--json", "--target", ends.grpc_target, "--application", APP]) == 0
    return json.loads(out.getvalue())


def test_the_split_follows_the_mix_and_no_request_fails(ratio_app, capsys):
    load = Load(ratio_app, concurrency=6)
    took, states = [], []
    try:
        for cases, split in (
            (PROMPT_HEAVY, (2, 1)),
            (DECODE_HEAVY, (1, 2)),
            (PROMPT_HEAVY, (2, 1)),
        ):
            took.append(follow(load, cases, split))
            states.append(status_json(ratio_app)["ratio_policy"])
    finally:
        load.stop()
    with capsys.disabled():
        print(f"\nsplit followed in {[round(t, 1) for t in took]} s, {len(load.done)} requests")
    assert not load.failed, load.failed[:3]
    assert load.done and all(asked == got for asked, got in load.done)
    currents = [s["current"] for s in states]
    assert [(c["prefill_replicas"], c["decode_replicas"]) for c in currents] == [
        (2, 1),
        (1, 2),
        (2, 1),
    ]
    assert currents[0]["mean_input_tokens"] > 300 > currents[1]["mean_input_tokens"]
    assert currents[1]["mean_output_tokens"] > 30 > currents[0]["mean_output_tokens"]
    splits = [(d["prefill_replicas"], d["decode_replicas"]) for d in states[-1]["history"]]
    assert splits[-3:] == [(2, 1), (1, 2), (2, 1)]
    assert all(d["goodput_rps"] > 0 for d in states[-1]["history"])

    capsys.readouterr()
    assert main(["status", "--target", ratio_app.grpc_target, "--application", APP]) == 0
    table = capsys.readouterr().out
    assert "ratio policy: 2P:1D for prompts ~" in table and "predicted goodput" in table
    wait_for_idle(ratio_app, APP, {"prefill", "decode"}, timeout=60.0)


def test_each_change_of_split_is_logged(ratio_app):
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    lines = [
        line
        for f in logs.glob("worker-*")
        for line in f.read_text(errors="replace").splitlines()
        if "ratio policy: split" in line
    ]
    assert any("split 1P:2D for prompts" in line for line in lines), lines[-5:]
    assert all("predicted goodput" in line and "req/s" in line for line in lines)

"""A tensor-parallel replica's ranks as Ray actors in its placement group's bundles
(`cluster.engine.tp_launch.BundleRanks`), as a served replica starts them: rank 0 is an actor in
bundle 0 of a 2-bundle group, rank 1 a `_TPRank` actor in bundle 1, a Ray worker of its own (not
a child of rank 0's process). Greedy output must equal transformers, with every KV block free
afterwards; a killed rank actor fails rank 0's next step within the collective's timeout; once
closed, the rank's process is gone."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.conftest import build_checkpoint, engine_config, prompt

NEW_TOKENS = 8


class _Leader:
    """Rank 0: builds the `TPReplica` inside its placement-group bundle, as the replica does."""

    def __init__(self, config) -> None:
        from cluster.engine.tp_launch import BundleRanks
        from cluster.engine.tp_replica import TPReplica

        launcher = BundleRanks.of_current_group(2)
        assert launcher is not None, "not placed in a placement group of 2 bundles"
        self.replica = TPReplica(config, 2, timeout_s=10, launcher=launcher)

    def pid(self) -> int:
        return os.getpid()

    def ranks(self) -> list[tuple[int, str, str]]:
        import ray

        here = (os.getpid(), ray.get_runtime_context().get_node_id(), "")
        return [here] + [(r.pid, r.node_id, r.node_ip) for r in self.replica.followers]

    def generate(self, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
        from cluster.request import Request
        from cluster.sampling_params import SamplingParams

        greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        engine = self.replica.engine
        outs = engine.generate([Request(f"r{i}", p, greedy) for i, p in enumerate(prompts)])
        return [list(o.token_ids) for o in outs], engine.stats().kv_blocks_used

    def kill_rank_then_step(self) -> float:
        """Kill rank 1's actor, then step: seconds until the step raised (-1: it did not)."""
        from cluster.request import Request
        from cluster.sampling_params import SamplingParams

        rank = self.replica.followers[0]
        rank.terminate()
        _gone(rank.pid)  # Ray kills the actor's worker asynchronously: step once it is dead
        engine = self.replica.engine
        engine.add_request(Request("after", prompt_ids(5), SamplingParams(max_tokens=2)))
        start = time.monotonic()
        try:
            engine.step()
        except Exception:  # gloo's own error types
            return time.monotonic() - start
        return -1.0

    def close(self) -> bool:
        self.replica.close()
        return any(r.is_alive() for r in self.replica.followers)


def prompt_ids(n: int) -> tuple[int, ...]:
    return tuple(range(3, 3 + n))


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_ranks_as_actors_in_their_bundles_serve_transformers_tokens(ray_serve, tmp_path, hf):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    path = build_checkpoint("llama-gqa", tmp_path)
    config = engine_config(path, block_size=4)
    group = placement_group([{"CPU": 0.25}, {"CPU": 0.25}], strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=60)
    try:
        leader = _start_leader(group, config)
        ranks = ray.get(leader.ranks.remote(), timeout=300)
        (rank0, node, _), (rank1, rank1_node, rank1_ip) = ranks
        assert rank1_node == node and rank1_ip  # STRICT_PACK: the same node, as Ray names it
        assert "_TPRank" in _cmdline(rank1), _cmdline(rank1)  # a Ray worker of its own
        assert _ppid(rank1) != rank0
        prompts = [list(prompt(n, seed=n)) for n in (3, 17, 30)]
        tokens, used = ray.get(leader.generate.remote(prompts), timeout=300)
        for ids, out in zip(prompts, tokens, strict=True):
            hf.assert_greedy(path, ids, out, NEW_TOKENS)
        assert used == 0, "KV blocks leaked"
        assert not ray.get(leader.close.remote(), timeout=60)
        _gone(rank1)  # told to stop: its work ended, then its actor
        ray.kill(leader)

        leader = _start_leader(group, config)  # the bundles are free again
        rank1 = ray.get(leader.ranks.remote(), timeout=300)[1][0]
        waited = ray.get(leader.kill_rank_then_step.remote(), timeout=120)
        assert 0 <= waited < 30, waited  # the step failed, within the collective's timeout
        assert not ray.get(leader.close.remote(), timeout=60)
        _gone(rank1)
        ray.kill(leader)
    finally:
        remove_placement_group(group)


def _start_leader(group, config):
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(group, 0)
    return ray.remote(_Leader).options(num_cpus=0.25, scheduling_strategy=strategy).remote(config)


def _gone(pid: int) -> None:
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists(), "rank 1's process outlived its replica"

"""`pdserve serve`'s model flags: a bad `--model` is one line before Ray starts; a hub id is
resolved and pinned; the flags reach the model, KV pool and scheduler of both engine pools."""

from __future__ import annotations

import argparse

import pytest

from cluster.cli.main import main
from cluster.cli.serve import _config_from_flags, _flag_app, add_serve_arguments, place_apps
from cluster.serving.vllm_metrics import served_model_name
from tests.cluster.model.hub_cache import REPO_ID, make_hub_cache, use_hub_cache


def flags(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(list(argv))


def test_a_missing_model_dir_is_one_line_and_exit_2_before_ray(capsys, monkeypatch):
    import ray

    started = []  # (the session's Ray may be up already: watch for a start, not the state)
    monkeypatch.setattr(ray, "init", lambda *a, **k: started.append(a))
    assert main(["serve", "--model", "/nope"]) == 2
    err = capsys.readouterr().err
    assert err == "error (INVALID_ARGUMENT): model /nope: no such directory\n"
    assert not started


def test_a_hub_id_missing_offline_is_one_line(tmp_path, monkeypatch, capsys):
    use_hub_cache(monkeypatch, tmp_path / "hf", offline=True)
    assert main(["serve", "--model", "pdserve-test/absent"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "HF_HUB_OFFLINE" in err and "pdserve-test/absent" in err


def test_a_directory_that_is_no_checkpoint_is_one_line(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error (INVALID_ARGUMENT): model {tmp_path}: ") and "\n" not in err


def test_a_cached_hub_id_is_checked_and_pinned_before_ray(tmp_path, monkeypatch):
    use_hub_cache(monkeypatch, tmp_path / "hf", offline=True)
    snapshot = make_hub_cache(tmp_path / "hf" / "hub")
    (config,) = _flag_app(flags("--model", REPO_ID)).values()
    assert (config.model.path, config.model.revision) == (REPO_ID, snapshot.name)
    assert served_model_name(config.model) == REPO_ID


def test_the_flags_reach_the_model_and_both_engine_pools(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = _config_from_flags(
        flags(
            "--model", "/models/m", "--served-model-name", "chat", "--revision", "v2",
            "--max-model-len", "4096", "--max-num-seqs", "64", "--num-kv-blocks", "900",
            "--gpu-memory-utilization", "0.8", "--kv-cache-memory", "2GiB",
            "--max-num-batched-tokens", "2048", "--enforce-eager", "--stream-interval", "4",
        )
    )  # fmt: skip
    assert config.stream_interval == 4
    model = config.model
    assert (model.served_name, model.revision, model.max_model_len) == ("chat", "v2", 4096)
    assert not model.cuda_graphs
    assert (model.device, model.dtype) == ("auto", "auto")  # decided by each replica
    for pool in (config.prefill, config.decode):
        assert pool.num_gpus == "auto"  # from the cluster's nodes, not this machine's GPU
        assert (pool.cache.num_blocks, pool.cache.gpu_memory_utilization) == (900, 0.8)
        assert pool.cache.kv_cache_memory == 2 << 30
        assert (pool.scheduler.max_num_seqs, pool.scheduler.max_num_batched_tokens) == (64, 2048)


def test_without_flags_the_pool_and_budget_are_sized_by_the_device(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = _config_from_flags(flags("--model", "/models/m"))
    assert config.model.cuda_graphs  # decode replays CUDA graphs where it runs on a GPU
    assert config.stream_interval == 1  # each token as soon as it exists
    assert config.decode.num_gpus == "auto" and config.decode.cache.num_blocks is None
    assert config.decode.scheduler.max_num_batched_tokens is None


@pytest.mark.parametrize("bad", ["lots", "-1"])
def test_a_bad_kv_cache_memory_flag_is_refused_by_the_parser(bad, capsys):
    with pytest.raises(SystemExit):
        flags("--kv-cache-memory", bad)
    assert "size in bytes" in capsys.readouterr().err


# A CPU-only head joining a cluster whose engine nodes have GPUs (deploy/aws/cluster.yaml's shape,
# as `ray.nodes()` reports it).
HEAD = {"CPU": 8.0, "memory": 3e10, "node:10.0.0.1": 1.0, "node:__internal_head__": 1.0}
GPU_NODE = {"CPU": 192.0, "GPU": 8.0, "memory": 1e12, "accelerator_type:H100": 1.0}


def test_serve_address_auto_from_a_cpu_head_asks_the_engine_nodes_gpus(monkeypatch):
    import torch

    from cluster.serving.app import deployment_options, deployment_pools
    from cluster.serving.gpu_placement import ClusterView

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this head has none
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    args = flags("--address", "auto", "--model", "/models/m")  # a path on the engine nodes
    apps = _flag_app(args)
    (config,) = place_apps(apps, ClusterView((HEAD, GPU_NODE, GPU_NODE))).values()
    assert (config.model.device, config.model.dtype) == ("auto", "auto")  # the replicas decide
    gpus = {
        name: deployment_options(name, config.pool(pool))["ray_actor_options"]["num_gpus"]
        for name, pool in deployment_pools(config).items()
    }
    assert gpus == {"Router": 0.0, "Prefill": 1.0, "Decode": 1.0}
    # The same flags on an all-CPU cluster: the engines ask for none, and run on the CPU.
    (cpu_only,) = place_apps(apps, ClusterView((HEAD, {"CPU": 16.0}))).values()
    assert (cpu_only.prefill.num_gpus, cpu_only.decode.num_gpus) == (0.0, 0.0)


def test_serve_refuses_a_tp_replica_no_node_can_hold_before_deploying():
    from cluster.errors import ResourceExhausted
    from cluster.serving.gpu_placement import ClusterView

    args = flags("--address", "auto", "--model", "/models/m", "--mode", "colocated", "-tp", "4")
    apps = _flag_app(args)
    four = {"CPU": 16.0, "GPU": 4.0}
    (config,) = place_apps(apps, ClusterView((HEAD, four))).values()  # 4 GPUs on one node: fits
    assert config.decode.num_gpus == 1.0
    with pytest.raises(ResourceExhausted) as e:  # 4 GPUs in all, 2 a node
        place_apps(apps, ClusterView((HEAD, {"CPU": 16.0, "GPU": 2.0}, {"CPU": 16.0, "GPU": 2.0})))
    assert e.value.message.startswith(
        "pool decode: a replica of tensor_parallel_size 4 needs {CPU: 4, GPU: 4} on one node"
    )
    assert "has that: 3 nodes: 1 x {CPU: 8}, 2 x {CPU: 16, GPU: 2}" in e.value.message

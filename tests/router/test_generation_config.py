"""Sampling defaults from generation_config.json (vLLM's `--generation-config`): a request that
leaves a setting unset gets the checkpoint's, one that sets it keeps its own; `vllm` takes
none; a directory's file is read instead; GetModelInfo shows them."""

from __future__ import annotations

import json
import shutil

import pytest

from cluster.config import ModelConfig, TransferConfig
from cluster.model.info import describe_model, generation_defaults
from cluster.serving.app_config import AppConfig
from router.grpc_api import model_info_to_proto
from router.orchestrator import Orchestrator

GEN = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "eos_token_id": 1}


@pytest.fixture(scope="module")
def checkpoint(tokenizer_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "m"
    shutil.copytree(tokenizer_model_dir, out)
    (out / "generation_config.json").write_text(json.dumps(GEN))
    return out


def _orch(checkpoint, source: str) -> Orchestrator:
    model = ModelConfig(path=str(checkpoint))
    config = AppConfig(
        model=model, transfer=TransferConfig(secret="5e" * 32), generation_config=source
    )
    return Orchestrator(config, describe_model(model), None, None, None, None)


def test_the_checkpoints_settings_fill_what_a_request_leaves_unset(checkpoint):
    assert generation_defaults(checkpoint) == (("temperature", 0.6), ("top_p", 0.9), ("top_k", 20))
    orch = _orch(checkpoint, "auto")
    unset = orch.sampling_params(8)
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.6, 0.9, 20)
    own = orch.sampling_params(8, temperature=0.0, top_k=3)
    assert (own.temperature, own.top_p, own.top_k) == (0.0, 0.9, 3)
    info = model_info_to_proto(orch.model)
    assert dict(info.sampling_defaults) == pytest.approx(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    )


def test_vllm_takes_none_and_a_directory_is_read_instead(checkpoint, tmp_path):
    plain = _orch(checkpoint, "vllm").sampling_params(8)
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2}))
    other = _orch(checkpoint, str(tmp_path)).sampling_params(8)
    assert (other.temperature, other.top_p) == (0.2, 1.0)

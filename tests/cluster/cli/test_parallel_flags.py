"""`pdserve serve --tensor-parallel-size N` (vLLM's flag, also `-tp`) sets every engine pool's
`tensor_parallel_size`; `--prefill-tensor-parallel-size` / `--decode-tensor-parallel-size`
override one pool's. A size the config refuses is a usage error, and a disaggregated app with
TP > 1 is refused before Ray starts."""

from __future__ import annotations

import pytest

from cluster.cli.main import build_parser
from cluster.cli.serve import _config_from_flags
from cluster.errors import InvalidArgument


def config(*flags: str):
    return _config_from_flags(build_parser().parse_args(["serve", "--model", "/m", *flags]))


def test_default_is_1_in_both_pools():
    c = config()
    assert (c.prefill.tensor_parallel_size, c.decode.tensor_parallel_size) == (1, 1)


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "-tp"])
def test_the_flag_sets_the_colocated_pool(flag):
    c = config("--mode", "colocated", flag, "2")
    assert c.pool("colocated").tensor_parallel_size == 2
    assert c.decode.serve_placement()["placement_group_strategy"] == "STRICT_PACK"


def test_a_pool_flag_overrides_the_common_one():
    c = config("--mode", "colocated", "-tp", "2", "--decode-tensor-parallel-size", "4")
    assert (c.prefill.tensor_parallel_size, c.decode.tensor_parallel_size) == (2, 4)


@pytest.mark.parametrize("size", ["3", "0", "16"])
def test_a_size_the_config_refuses_is_a_usage_error(size, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--tensor-parallel-size", size])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_disaggregated_takes_tp_up_to_4_and_refuses_8_naming_both_pools():
    c = config("--tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1")
    assert (c.prefill.tensor_parallel_size, c.decode.tensor_parallel_size) == (2, 1)
    with pytest.raises(InvalidArgument, match="prefill 8, decode 8: KV moves between TP sizes"):
        config("--tensor-parallel-size", "8")
    with pytest.raises(InvalidArgument, match="prefill 1, decode 8"):
        config("--decode-tensor-parallel-size", "8")

"""The sampling fields' bounds (cluster/sampling_params.py): OpenAI's and vLLM's ranges,
inclusive where they are, each violation refused with InvalidArgument naming the field; a
temperature below the floor is greedy."""

from __future__ import annotations

import math

import pytest

from cluster.errors import InvalidArgument
from cluster.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    SamplingParams,
)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        pytest.param({"presence_penalty": 2.01}, "presence_penalty", id="presence>2"),
        pytest.param({"presence_penalty": -2.01}, "presence_penalty", id="presence<-2"),
        pytest.param({"presence_penalty": math.nan}, "presence_penalty", id="presence-nan"),
        pytest.param({"frequency_penalty": 2.5}, "frequency_penalty", id="frequency>2"),
        pytest.param({"frequency_penalty": -math.inf}, "frequency_penalty", id="frequency-inf"),
        pytest.param({"repetition_penalty": 0.0}, "repetition_penalty", id="repetition=0"),
        pytest.param({"repetition_penalty": -1.0}, "repetition_penalty", id="repetition<0"),
        pytest.param({"repetition_penalty": math.inf}, "repetition_penalty", id="repetition-inf"),
        pytest.param({"repetition_penalty": math.nan}, "repetition_penalty", id="repetition-nan"),
        pytest.param({"repetition_penalty": 1e-40}, "repetition_penalty", id="repetition-tiny"),
        pytest.param({"repetition_penalty": 0.0099}, "repetition_penalty", id="repetition<min"),
        pytest.param({"repetition_penalty": 100.5}, "repetition_penalty", id="repetition>max"),
        pytest.param({"temperature": -1e-45}, "temperature", id="temperature<0"),
        pytest.param({"temperature": 100.01}, "temperature", id="temperature>max"),
        pytest.param({"temperature": math.inf}, "temperature", id="temperature-inf"),
        pytest.param({"temperature": math.nan}, "temperature", id="temperature-nan"),
        pytest.param({"temperature": "1"}, "temperature", id="temperature-string"),
        pytest.param({"stop": ("ok", "a\ud800")}, "stop", id="stop-lone-surrogate"),
        pytest.param({"min_p": -0.1}, "min_p", id="min_p<0"),
        pytest.param({"min_p": 1.01}, "min_p", id="min_p>1"),
        pytest.param({"min_p": math.nan}, "min_p", id="min_p-nan"),
        pytest.param({"logit_bias": {5: 100.5}}, "logit_bias", id="bias>100"),
        pytest.param({"logit_bias": {5: -101.0}}, "logit_bias", id="bias<-100"),
        pytest.param({"logit_bias": {5: math.nan}}, "logit_bias", id="bias-nan"),
        pytest.param({"logit_bias": {-1: 1.0}}, "logit_bias", id="negative-token"),
        pytest.param({"logit_bias": {"5": 1.0}}, "logit_bias", id="string-token"),
        pytest.param({"logit_bias": ((5, 1.0), (5, 2.0))}, "logit_bias", id="token-twice"),
        pytest.param(
            {"logit_bias": {t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}},
            "logit_bias",
            id="too-many-biases",
        ),
    ],
)
def test_bad_adjustments_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(InvalidArgument) as err:
        SamplingParams(**kwargs)
    assert err.value.param == field
    assert field in str(err.value)


def test_bounds_are_inclusive_where_documented():
    p = SamplingParams(
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=MIN_REPETITION_PENALTY,
        min_p=1.0,
        logit_bias={t: 100.0 if t % 2 else -100.0 for t in range(MAX_LOGIT_BIAS)},
    )
    assert len(p.logit_bias) == MAX_LOGIT_BIAS
    assert SamplingParams(min_p=0.0, presence_penalty=2.0, frequency_penalty=-2.0).min_p == 0.0
    hot = SamplingParams(temperature=MAX_TEMPERATURE, repetition_penalty=MAX_REPETITION_PENALTY)
    assert hot.temperature == MAX_TEMPERATURE and not hot.greedy


@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-10, MIN_TEMPERATURE * 0.999, 0])
def test_a_temperature_below_the_floor_is_greedy(temperature):
    """float32 underflow territory (a gRPC float of 1e-45 is a positive denormal) is greedy:
    the engine never divides logits by it."""
    p = SamplingParams(temperature=temperature, top_k=5, top_p=0.5)
    assert p.greedy and p.temperature == 0.0
    assert p == SamplingParams(temperature=0.0, top_k=5, top_p=0.5)


def test_a_temperature_at_the_floor_samples():
    p = SamplingParams(temperature=MIN_TEMPERATURE)
    assert not p.greedy and p.temperature == MIN_TEMPERATURE


def test_logit_bias_is_normalised_to_sorted_pairs():
    p = SamplingParams(logit_bias={9: 1, 3: -2.5})
    assert p.logit_bias == ((3, -2.5), (9, 1.0))
    assert p == SamplingParams(logit_bias=((9, 1.0), (3, -2.5)))
    assert hash(p) == hash(SamplingParams(logit_bias={3: -2.5, 9: 1.0}))


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    p = SamplingParams(logit_bias={511: 1.0, 512: 2.0})
    p.check_vocab(513)
    with pytest.raises(InvalidArgument) as err:
        p.check_vocab(512)
    assert err.value.param == "logit_bias" and "512" in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "adjusts"),
    [
        ({}, False),
        ({"min_p": 0.5, "temperature": 0.0}, False),  # a filter, not an adjustment
        ({"logit_bias": {1: 0.0}}, True),
        ({"repetition_penalty": 1.1}, True),
        ({"frequency_penalty": -0.1}, True),
        ({"presence_penalty": 0.1}, True),
    ],
)
def test_only_requests_that_adjust_logits_leave_the_plain_path(kwargs, adjusts):
    assert SamplingParams(**kwargs).adjusts_logits is adjusts

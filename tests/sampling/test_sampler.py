import math
from types import SimpleNamespace

import pytest
import torch

from tokenmill.sampling.params import SamplingParamError, SamplingParams
from tokenmill.sampling.processors import apply_penalties, filter_top_k_top_p_min_p
from tokenmill.sampling.sampler import Sampler


def fake_request(**params):
    return SimpleNamespace(sampling_params=SamplingParams(**params), prompt_token_ids=[], output_token_ids=[],
                           eos_token_id=None, sampler_state=None, logprobs=[])


def test_exponential_race_samples_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    sampler = Sampler(seed=0)
    req = fake_request(temperature=1.0, seed=3)
    counts = torch.zeros(4)
    n = 20000
    for _ in range(n):
        counts[sampler.sample(logits.clone().unsqueeze(0), [req])[0]] += 1
    assert torch.allclose(counts / n, probs, atol=0.015)


def test_temperature_sharpens():
    logits = torch.tensor([2.0, 1.0, 0.0])
    sampler = Sampler(seed=0)
    req = fake_request(temperature=0.1, seed=1)
    picks = [sampler.sample(logits.clone().unsqueeze(0), [req])[0] for _ in range(200)]
    assert picks.count(0) >= 195  # p(0) = 1 / (1 + e^-10 + e^-20) ~ 0.99995


def test_top_k_top_p_min_p_filters():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0]).log_softmax(-1)  # any logits; probs p_i ~ e^{x_i}
    probs = logits.softmax(-1)
    kept = lambda out: (out > float("-inf")).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_top_k_top_p_min_p(logits, 2, 1.0, 0.0)) == [0, 1]
    # top_p: keep the smallest prefix whose mass reaches p.
    p = float(probs[0] + probs[1]) - 1e-4
    assert kept(filter_top_k_top_p_min_p(logits, 0, p, 0.0)) == [0, 1]
    assert kept(filter_top_k_top_p_min_p(logits, 0, 1e-6, 0.0)) == [0]
    # min_p: keep tokens with prob >= min_p * max prob.
    ratio = float(probs[2] / probs[0])
    assert kept(filter_top_k_top_p_min_p(logits, 0, 1.0, ratio - 1e-4)) == [0, 1, 2]


def test_penalty_formulas():
    row = torch.tensor([2.0, -2.0, 1.0, 0.5])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    apply_penalties(row, params, prompt_ids=[0], output_ids=[1, 1, 2])
    # token 0: in prompt only -> 2/2; token 1: -2*2 - 0.5 - 2*0.25; token 2: 1/2 - 0.5 - 0.25; token 3 untouched.
    assert row.tolist() == pytest.approx([1.0, -5.0, -0.25, 0.5])


def test_greedy_and_logprobs_entry():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    req = fake_request(temperature=0.0, logprobs=2)
    assert Sampler().sample(logits.clone(), [req]) == [1]
    lp, top = req.logprobs[0]
    ref = logits[0].log_softmax(-1)
    assert lp == pytest.approx(float(ref[1]))
    assert [t for t, _ in top] == [1, 2]
    assert math.isclose(top[1][1], float(ref[2]), rel_tol=1e-6)


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"logprobs": 50}, "logprobs"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"stop": [""]}, "stop"),
    ({"logit_bias": {1: 500}}, "logit_bias"), ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_invalid_params_name_the_parameter(kwargs, param):
    with pytest.raises(SamplingParamError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
    assert str(err.value).startswith(param)

"""The batched sampler, driven through the persistent batch's metadata, against formulas and against the per-row
sampler it replaced (tests/sampling/per_row_sampler.py): greedy tokens and logprobs identical, sampled tokens from
the same distribution (two-sample chi-square), seeded rows independent of their batch."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.sampling.per_row_sampler import Sampler as PerRowSampler
from tokenmill.engine.input_batch import InputBatch
from tokenmill.sampling.params import SamplingParamError, SamplingParams
from tokenmill.sampling.sampler import Sampler, apply_penalties, filter_top_k_top_p_min_p, to_host
from tokenmill.scheduler.output import NewRequestData


def metadata(params: list[SamplingParams], prompts=None, outputs=None, vocab: int = 16, eos=()):
    """Rows 0..n-1 of a persistent batch holding one request per ``params`` (prompt/output token ids optional)."""
    batch = InputBatch(len(params), 64, 4, 99, vocab, tuple(eos), torch.device("cpu"))
    for i, p in enumerate(params):
        prompt = (prompts or [[1]] * len(params))[i]
        output = (outputs or [[]] * len(params))[i]
        batch.add(NewRequestData(f"r{i}", prompt + output, len(prompt), p, [], 0))
    return batch.sampling_metadata(np.arange(len(params)))


def per_row_request(params: SamplingParams, prompt=(1,), output=(), eos=None):
    return SimpleNamespace(sampling_params=params, prompt_token_ids=list(prompt), output_token_ids=list(output),
                           eos_token_id=eos, sampler_state=None, logprobs=[])


def test_exponential_race_samples_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    m = metadata([SamplingParams(temperature=1.0)] * n, vocab=4)
    tokens = Sampler(seed=0).sample(probs.log().expand(n, 4).clone(), m).token_ids
    assert torch.allclose(torch.bincount(tokens, minlength=4) / n, probs, atol=0.015)


def test_filters_keep_what_each_row_asks():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0]).log_softmax(-1).expand(4, 5)  # probs p_i ~ e^{x_i}
    probs = logits[0].softmax(-1)
    p2 = float(probs[0] + probs[1]) - 1e-4
    ratio = float(probs[2] / probs[0])
    m = metadata([SamplingParams(top_k=2), SamplingParams(top_p=p2), SamplingParams(min_p=ratio - 1e-4),
                  SamplingParams()], vocab=5)
    out = filter_top_k_top_p_min_p(logits.clone(), m)
    kept = [(row > float("-inf")).nonzero().flatten().tolist() for row in out]
    assert kept == [[0, 1], [0, 1], [0, 1, 2], [0, 1, 2, 3, 4]]


def test_penalty_formulas():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    m = metadata([SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)],
                 prompts=[[0]], outputs=[[1, 1, 2]], vocab=4)
    apply_penalties(logits, m)
    # token 0: in prompt only -> 2/2; token 1: -2*2 - 0.5 - 2*0.25; token 2: 1/2 - 0.5 - 0.25; token 3 untouched.
    assert logits[0].tolist() == pytest.approx([1.0, -5.0, -0.25, 0.5])


def test_greedy_and_logprobs_entry():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    m = metadata([SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0)], vocab=3)
    tokens, logprobs = to_host(Sampler().sample(logits.clone(), m), m.num_logprobs)
    assert tokens == [1, 0] and logprobs[1] is None
    lp, top = logprobs[0]
    ref = logits[0].log_softmax(-1)
    assert lp == pytest.approx(float(ref[1]))
    assert [t for t, _ in top] == [1, 2]
    assert math.isclose(top[1][1], float(ref[2]), rel_tol=1e-6)


MIXED = [SamplingParams(temperature=0.0, logprobs=3),
         SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=-0.3),
         SamplingParams(temperature=0.0, logit_bias={5: 30.0, 7: -2.0}),
         SamplingParams(temperature=0.0, min_tokens=4, ignore_eos=True, stop_token_ids=[11]),
         SamplingParams(temperature=0.0, min_tokens=1, logprobs=0)]


def test_greedy_rows_equal_the_per_row_sampler():
    gen = torch.Generator().manual_seed(0)
    vocab, eos = 40, 3
    logits = torch.randn(len(MIXED), vocab, generator=gen) * 3
    logits[:, eos] += 8  # EOS would win where not banned
    logits[:, 11] += 7
    prompts = [[1, 2, 9, 9], [4, 5, 6], [7], [8, 8], [2]]
    outputs = [[], [6, 6, 12], [], [1], [5]]
    m = metadata(MIXED, prompts, outputs, vocab=vocab, eos=(eos,))
    tokens, logprobs = to_host(Sampler().sample(logits.clone(), m), m.num_logprobs)
    # The per-row sampler predates the min_tokens fix: it let EOS through when ignore_eos was set, so it gets the
    # bans of the fixed rule (EOS banned whatever ignore_eos says) spelled out as an explicit stop token id.
    reference = [per_row_request(p if not p.ignore_eos else SamplingParams(
        temperature=0.0, min_tokens=4, stop_token_ids=[11, eos]), prompt, out, eos)
        for p, prompt, out in zip(MIXED, prompts, outputs)]
    assert tokens == PerRowSampler().sample(logits.clone(), reference)
    assert tokens[3] not in (eos, 11) and tokens[4] != eos  # min_tokens bans, with and without ignore_eos
    for mine, ref in zip(logprobs, reference):
        if ref.logprobs:
            assert mine[0] == pytest.approx(ref.logprobs[0][0], abs=1e-5)
            assert [t for t, _ in mine[1]] == [t for t, _ in ref.logprobs[0][1]]


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square(df), Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
                                    SamplingParams(top_p=0.8), SamplingParams(min_p=0.05, temperature=0.9),
                                    SamplingParams(top_k=8, top_p=0.9, min_p=0.02, repetition_penalty=1.3)])
def test_sampled_distribution_equals_the_per_row_sampler(params):
    n, vocab = 4000, 12
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 2
    m = metadata([params] * n, prompts=[[2, 3]] * n, vocab=vocab)
    batched = Sampler(seed=5).sample(logits.expand(n, vocab).clone(), m).token_ids
    reference, request = PerRowSampler(seed=6), per_row_request(params, prompt=[2, 3])
    per_row = torch.tensor([reference.sample(logits[None].clone(), [request])[0] for _ in range(n)])
    a, b = torch.bincount(batched, minlength=vocab).double(), torch.bincount(per_row, minlength=vocab).double()
    assert torch.equal(a > 0, b > 0) or ((a > 0) ^ (b > 0)).sum() <= 1  # the same support (a rare tail token aside)
    used = (a + b) > 0
    stat = float((((a - b) ** 2)[used] / (a + b)[used]).sum())
    assert stat < _chi_square_critical(int(used.sum()) - 1), (a.tolist(), b.tolist())


def test_seeded_row_ignores_its_batch():
    vocab = 50
    gen = torch.Generator().manual_seed(3)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    others = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0), SamplingParams(top_p=0.5)]
    row_logits = torch.randn(vocab, generator=gen)
    alone = Sampler(seed=0).sample(row_logits[None].clone(), metadata([seeded], vocab=vocab)).token_ids[0]
    for position in range(4):
        params = others[:position] + [seeded] + others[position:]
        logits = torch.randn(len(params), vocab, generator=gen)
        logits[position] = row_logits
        tokens = Sampler(seed=position + 7).sample(logits, metadata(params, vocab=vocab)).token_ids
        assert tokens[position] == alone
    # The output index is part of the step's seed: the next step draws different noise.
    later = metadata([seeded], outputs=[[4]], vocab=vocab)
    draws = {int(Sampler().sample(row_logits[None].clone(), m).token_ids[0])
             for m in [later] + [metadata([seeded], outputs=[[4] * k], vocab=vocab) for k in range(2, 12)]}
    assert len(draws) > 1


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

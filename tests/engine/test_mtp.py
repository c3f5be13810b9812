"""DeepSeek-V3 multi-token-prediction (MTP) drafts on a tiny V3 with one MTP layer, fp32.

The truth for the drafts is an independent reference: transformers' DeepseekV3 decoder layer (a one-layer
DeepseekV3Model holding the MTP layer's weights) over the whole sequence, with the MTP formula written out here --
[enorm(embedding of token i+1, zero at position 0) | hnorm(main model's hidden h_i)] -> eh_proj -> the layer ->
shared_head.norm -> the LM head, and the layer's own output fed back for a further draft. The engine's drafts must
equal the reference's greedy tokens after every step, whatever the step accepted (an oracle plants drafts that are
right for 0..K positions), and every output must equal transformers' greedy decoding without speculation.
"""


import pytest
import torch
import transformers

from tests.conftest import hf_greedy
from tests.tiny_checkpoints import make_mtp_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError

K = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PROMPTS = [[(7 * i) % 11 + 300 for i in range(n)] for n in (5, 18, 31)]


class MTPReference:
    def __init__(self, hf, mtp: dict[str, torch.Tensor]):
        c = hf.config
        self.hf, self.mtp, self.eps = hf, mtp, c.rms_norm_eps
        one = transformers.DeepseekV3Config(**{**c.to_dict(), "num_hidden_layers": 1, "first_k_dense_replace": 0})
        self.layer_model = transformers.DeepseekV3Model(one).eval()
        block = {k: v for k, v in mtp.items() if k.split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                                      "post_attention_layernorm")}
        self.layer_model.layers[0].load_state_dict(block)

    def _norm(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.mtp[f"{name}.weight"]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """Greedy drafts for the tokens after ``tokens`` (whose last was just sampled)."""
        ids = torch.tensor([tokens])
        hidden = self.hf.model(ids).last_hidden_state[0]  # the main model's final (normed) hidden states
        embeds, previous = self.hf.model.embed_tokens(ids[0, 1:]), hidden[:-1]
        out = []
        for _ in range(k):
            e = embeds.clone()
            e[0] = 0
            x = torch.cat([self._norm(e, "enorm"), self._norm(previous, "hnorm")], -1) @ self.mtp["eh_proj.weight"].T
            captured = []
            hook = self.layer_model.layers[0].register_forward_hook(
                lambda _m, _i, o: captured.append(o[0] if isinstance(o, tuple) else o))
            self.layer_model(inputs_embeds=x[None], position_ids=torch.arange(len(x))[None])
            hook.remove()
            y = captured[0][0, -1]  # the layer's output at the last position, before the final norm
            token = int(self.hf.lm_head(self._norm(y, "shared_head.norm")).argmax())
            out.append(token)
            embeds = torch.cat([embeds, self.hf.model.embed_tokens(torch.tensor([token]))])
            previous = torch.cat([previous, y[None]])
        return out


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory, smollm_llm):
    path = tmp_path_factory.mktemp("v3-mtp")
    hf, mtp = make_mtp_checkpoint(path, smollm_llm)
    llm = LLM(model=str(path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="8MiB",
              max_num_batched_tokens=16, speculative_method="mtp", num_speculative_tokens=K)
    return path, hf, MTPReference(hf, mtp), llm


def test_cache_has_a_layer_for_the_mtp_module(tiny_mtp):
    _, hf, _, llm = tiny_mtp
    c = llm.engine.model_config
    assert c.num_mtp_layers == 1
    per_layer = (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim) * 4
    assert llm.engine.info.kv_bytes_per_token == (c.num_layers + 1) * per_layer


def test_drafts_equal_the_reference_after_every_step_whatever_was_accepted(tiny_mtp):
    """Three requests with chunked prefill (16 tokens a step, so the module also catches up over prompt chunks that
    sample nothing). After each step every decoding request's drafts equal the reference's; then an oracle replaces
    them with drafts right for the first 0, 1 or 2 positions (cycling), so the next step keeps 1..K+1 tokens."""
    _, hf, ref, llm = tiny_mtp
    engine = llm.engine
    truth = {llm.add_request(p, GREEDY): p + hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS}
    accepted_counts, checked, step = set(), 0, 0
    while engine.has_unfinished():
        engine.step()
        step += 1
        for rid, request in engine.scheduler.requests.items():
            if request.num_tokens - request.num_computed_tokens != 1:
                continue  # still prefilling
            tokens = request.all_token_ids
            assert tokens == truth[rid][:len(tokens)]
            assert request.spec_token_ids == ref.drafts(tokens, len(request.spec_token_ids))
            assert len(request.spec_token_ids) == K
            checked += 1
            right = (step + len(tokens)) % (K + 1)  # how many planted drafts are right
            future = truth[rid][len(tokens):len(tokens) + K]
            planted = future[:right] + [(t + 1) % 1000 for t in future[right:]]
            request.spec_token_ids = planted
            accepted_counts.add(right)
    assert checked >= 30 and accepted_counts == {0, 1, 2}
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens_total > 0


def test_greedy_outputs_equal_transformers_through_preemption(tiny_mtp, tmp_path):
    path, hf, _, llm = tiny_mtp
    expected = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == expected
    need = [len(p) + GREEDY.max_tokens for p in PROMPTS]
    capacity = max(max(need) + 16, sum(need) * 2 // 3) // 16 * 16  # one request always fits, all never do
    kv_bytes = llm.engine.info.kv_bytes_per_token
    tight = LLM(model=str(path), dtype="float32", kv_cache_dtype="fp32", max_model_len=capacity,
                kv_cache_memory=(capacity + 16) * kv_bytes, speculative_method="mtp", num_speculative_tokens=3)
    assert [r.token_ids for r in tight.generate(PROMPTS, GREEDY)] == expected
    assert tight.engine.scheduler.num_preemptions_total >= 1
    tight.engine.scheduler.check_integrity()
    assert tight.engine.scheduler.kv.pool.num_free_blocks == tight.engine.scheduler.kv.pool.num_blocks


def test_seeded_sampling_is_unchanged_by_drafts(tiny_mtp):
    path, _, _, llm = tiny_mtp
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True,
                            repetition_penalty=1.1)
    plain = LLM(model=str(path), dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="8MiB")
    want = [r.token_ids for r in plain.generate(PROMPTS, params)]
    drafted = llm.engine.stats().spec_num_draft_tokens_total
    assert [r.token_ids for r in llm.generate(PROMPTS, params)] == want
    assert llm.engine.stats().spec_num_draft_tokens_total > drafted


def test_mtp_needs_a_checkpoint_with_the_layer(tmp_path, smollm_llm):
    from tests.tiny_checkpoints import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path, smollm_llm, "v2-lite-like")  # DeepSeek-V2 has no MTP layer
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="8MiB", speculative_method="mtp")


def test_mtp_layer_weights_missing_is_a_load_error(tiny_mtp, tmp_path):
    """The config names an MTP layer (transformers' V3 config always does) but the weights lack it."""
    path, _, _, _ = tiny_mtp
    from tokenmill.models.loader import ModelLoadError

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if (path / name).exists():
            (tmp_path / name).write_bytes((path / name).read_bytes())
    with pytest.raises(ModelLoadError, match="mtp.enorm"):
        LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="8MiB", speculative_method="mtp")
    # Without drafting, a checkpoint with the MTP layer serves as one without: the layer is skipped.
    plain = LLM(model=str(path), dtype="float32", kv_cache_memory="8MiB")
    assert plain.engine.runner.model.mtp is None

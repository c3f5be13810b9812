"""Tokenizer.decode (the engine's detokenizer calls it twice a running request a step) takes the tokenizers library's
decode directly where transformers' would return the same: checked against transformers' own decode."""

import random

import pytest

from tokenmill.models.tokenizer import Tokenizer, _rust_decode


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.of_model(None)


def test_decode_is_transformers_decode(tokenizer):
    assert tokenizer._rust_decode is not None  # SmolLM2's: a fast BPE tokenizer with no clean-up
    rng = random.Random(0)
    special = sorted(tokenizer.hf.all_special_ids)
    text = "Grüße, 世界! 🦙 <|im_start|>user\n  two  spaces\tand a tab. Ĳ"
    ids = tokenizer.encode(text, add_special_tokens=False)
    cases = [[], ids, ids[:1], special + ids + special]
    # random windows, random ids (byte pieces that split characters: U+FFFD where incomplete) and special ones mixed
    cases += [ids[i:i + n] for i in range(len(ids)) for n in (1, 2, 3)]
    cases += [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 12))] + rng.sample(special, 1)
              for _ in range(300)]
    for case in cases:
        for skip in (True, False):
            assert tokenizer.decode(case, skip_special_tokens=skip) == \
                tokenizer.hf.decode(case, skip_special_tokens=skip), (case, skip)


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer.hf, "clean_up_tokenization_spaces", True)
    assert _rust_decode(tokenizer.hf) is None


def test_a_class_with_its_own_decode_keeps_it(tokenizer):
    class Own(type(tokenizer.hf)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    hf = tokenizer.hf
    original = hf.__class__
    try:
        hf.__class__ = Own
        assert _rust_decode(hf) is None
    finally:
        hf.__class__ = original

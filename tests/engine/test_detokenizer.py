"""Incremental detokenizer on the real SmolLM2 tokenizer: UTF-8 safety and exact concatenation."""

from tokenmill.engine.detokenizer import IncrementalDetokenizer

TEXT = "Waves 🌊 and confetti 🎉, café crème, 日本語のテキスト, Ελληνικά — done."


def feed(tokenizer, ids, stop=(), prompt=(1, 2, 3)):
    detok = IncrementalDetokenizer(tokenizer, list(prompt), list(stop))
    deltas = [detok.update([t], finished=(i == len(ids) - 1)) for i, t in enumerate(ids)]
    return detok, deltas


def test_multibyte_characters_are_held_until_complete(smollm_llm):
    tok = smollm_llm.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.split())  # emoji and CJK really split into several byte tokens
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some single tokens are partial characters
    _, deltas = feed(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT


def test_stop_string_is_cut_and_never_emitted(smollm_llm):
    tok = smollm_llm.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok, deltas = feed(tok, ids, stop=["crème, 日"])
    assert detok.stopped_by == "crème, 日"
    assert "".join(deltas) == TEXT[:TEXT.index("crème, 日")]


def test_trailing_partial_character_is_flushed_at_finish(smollm_llm):
    tok = smollm_llm.tokenizer
    ids = tok.encode("ok 🌊", add_special_tokens=False)
    _, deltas = feed(tok, ids[:-1])  # the request ends mid-character
    assert "".join(deltas) == tok.decode(ids[:-1])


def test_include_stop_str_ends_the_text_after_the_stop_string(smollm_llm):
    tok = smollm_llm.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1, 2, 3], ["crème, 日"], include_stop_str=True)
    deltas = [detok.update([t], finished=False) for t in ids]
    assert detok.stopped_by == "crème, 日"
    assert "".join(deltas) == TEXT[:TEXT.index("crème, 日") + len("crème, 日")]

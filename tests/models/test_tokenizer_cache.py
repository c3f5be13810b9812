"""The GGUF tokenizer cache: a tokenizer read back from the cache behaves as transformers' own conversion of the GGUF
file (vocabulary, special tokens, encoding, decoding, chat template), is used at the next start instead of
converting again, and a changed file converts afresh."""

import os
import shutil

import pytest
from transformers import AutoTokenizer

from tokenmill.models.loader import DEFAULT_MODEL_FILE, ModelLoadError, default_model_path
from tokenmill.models import tokenizer as tokenizer_module
from tokenmill.models.tokenizer import Tokenizer

TEXTS = ["Hello, world!", "héllo <|im_end|> wörld\n\ttabs  and   spaces", "1234567 + 89 = ?", "<|im_start|>user"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def converted():
    """transformers' conversion of the GGUF tokenizer, straight from the file: the reference."""
    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=DEFAULT_MODEL_FILE)


def count_conversions(monkeypatch) -> list[str]:
    """Record every load of a tokenizer from a GGUF file (the slow conversion)."""
    calls: list[str] = []
    original = AutoTokenizer.from_pretrained

    def spy(path, *args, **kwargs):
        if kwargs.get("gguf_file"):
            calls.append(kwargs["gguf_file"])
        return original(path, *args, **kwargs)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    return calls


def test_cached_tokenizer_behaves_as_the_conversion_and_is_reused(tmp_path, monkeypatch, converted):
    conversions = count_conversions(monkeypatch)
    first = Tokenizer.of_model(None, cache_dir=str(tmp_path))
    assert conversions == [DEFAULT_MODEL_FILE]
    [entry] = [p for p in tmp_path.iterdir()]  # one complete entry, no partial directory left behind
    assert not entry.name.startswith(".partial")

    again = Tokenizer.of_model(None, cache_dir=str(tmp_path))
    assert conversions == [DEFAULT_MODEL_FILE], "the second start converted again instead of reading the cache"
    for tokenizer in (first, again):
        hf = tokenizer.hf
        assert hf.get_vocab() == converted.get_vocab()
        assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == \
            (converted.bos_token_id, converted.eos_token_id, converted.pad_token_id)
        assert hf.all_special_ids == converted.all_special_ids
        for text in TEXTS:
            ids = converted.encode(text)
            assert tokenizer.encode(text) == ids
            assert tokenizer.decode(ids) == converted.decode(ids, skip_special_tokens=True)
        want = converted.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        assert tokenizer.apply_chat_template(MESSAGES) == converted.encode(want, add_special_tokens=False)


def fake_conversions(monkeypatch, converted) -> list[str]:
    """Make each GGUF conversion hand back the reference's result at once (the first test runs the real one), and
    record them; loads from the cache stay real."""
    calls: list[str] = []
    real_load = tokenizer_module._load

    def load(directory, gguf_file=None):
        if gguf_file:
            calls.append(gguf_file)
            return converted
        return real_load(directory)
    monkeypatch.setattr(tokenizer_module, "_load", load)
    return calls


def test_a_changed_file_converts_afresh_and_no_cache_dir_never_writes(tmp_path, monkeypatch, converted):
    gguf = tmp_path / "model" / DEFAULT_MODEL_FILE
    gguf.parent.mkdir()
    shutil.copyfile(default_model_path(), gguf)
    cache = tmp_path / "cache"
    conversions = fake_conversions(monkeypatch, converted)
    Tokenizer.of_model(str(gguf), cache_dir=str(cache))
    Tokenizer.of_model(str(gguf), cache_dir=str(cache))
    assert len(conversions) == 1
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))  # the file was replaced
    Tokenizer.of_model(str(gguf), cache_dir=str(cache))
    assert len(conversions) == 2 and len(list(cache.iterdir())) == 2

    Tokenizer.of_model(str(gguf), cache_dir="")
    assert len(conversions) == 3 and len(list(cache.iterdir())) == 2


def test_an_unwritable_cache_still_serves(tmp_path, monkeypatch, caplog, converted):
    fake_conversions(monkeypatch, converted)
    cache = tmp_path / "cache"
    cache.write_text("a file where the cache directory should be")
    tokenizer = Tokenizer.of_model(None, cache_dir=str(cache))
    assert tokenizer.encode("Hello") and "tokenizer not cached" in caplog.text


def test_a_missing_model_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        Tokenizer.of_model(str(tmp_path / "nothing.gguf"), cache_dir=str(tmp_path))

"""POST /v1/embeddings as the openai SDK sends it (base64 by default) and parses it: the default model's last-token
pooled, normalized final hidden states against transformers' own; a Qwen3 checkpoint with sentence-transformers'
files (mean pooling + Normalize; matryoshka dimensions) against sentence-transformers' own encode; the errors."""

import json

import httpx
import jsonschema
import openai
import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from tests.live_server import API_KEY, MODEL, inprocess_server

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "hi"]


def _cos(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(a @ b / (a.norm() * b.norm()))


def test_the_default_model_pools_its_last_token(fp32_server, smollm_hf):
    model, tokenizer = smollm_hf
    client = openai.OpenAI(base_url=fp32_server.base_url, api_key=API_KEY, max_retries=0)
    got = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 and decodes it
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == MODEL
    for text, encoded, plain in zip(TEXTS, got.data, floats.data):
        ids = tokenizer.encode(text)
        with torch.no_grad():
            want = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
        want = (want / want.norm()).tolist()
        assert len(plain.embedding) == len(want)
        assert max(abs(a - b) for a, b in zip(plain.embedding, want)) < 1e-4
        assert max(abs(a - b) for a, b in zip(encoded.embedding, plain.embedding)) < 1e-6
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    ids = client.embeddings.create(model=MODEL, input=[tokenizer.encode(TEXTS[0])], encoding_format="float")
    assert _cos(ids.data[0].embedding, floats.data[0].embedding) > 0.999999

    def refused(**fields) -> dict:
        answer = httpx.post(fp32_server.base_url + "/embeddings", headers={"Authorization": f"Bearer {API_KEY}"},
                            json={"model": MODEL, "input": TEXTS[0], **fields})
        assert answer.status_code == 400, answer.text
        return answer.json()["error"]
    assert refused(input=[])["param"] == "input"
    assert refused(input=["ok", ""])["param"] == "input.1"
    assert refused(dimensions=8)["param"] == "dimensions"  # not a matryoshka model
    assert refused(encoding_format="int8")["param"] == "encoding_format"
    doc = httpx.get(fp32_server.root + "/openapi.json").json()
    schema = doc["paths"]["/v1/embeddings"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    jsonschema.validate(floats.model_dump(), {**schema, "components": doc["components"]})


@pytest.fixture(scope="module")
def sentence_model(tmp_path_factory, smollm_llm):
    """A tiny Qwen3 with sentence-transformers' files: mean pooling, then Normalize; trained (says its config) for
    matryoshka dimensions 16 and 32."""
    path = tmp_path_factory.mktemp("st-qwen3")
    make_family_checkpoint(path, smollm_llm.tokenizer.hf, "qwen3")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": config["hidden_size"], "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    (path / "2_Normalize").mkdir()
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    return path


def test_sentence_transformers_pooling_as_it_encodes(sentence_model):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(sentence_model), device="cpu")
    want = reference.encode(TEXTS, convert_to_tensor=True).float()
    with inprocess_server(model=str(sentence_model), dtype="float32", kv_cache_dtype="fp32",
                          kv_cache_memory="16MiB") as (root, _):
        client = openai.OpenAI(base_url=root + "/v1", api_key="unused", max_retries=0)
        got = client.embeddings.create(model=sentence_model.name, input=TEXTS, encoding_format="float")
        for vector, expected in zip(got.data, want):
            assert max(abs(a - b) for a, b in zip(vector.embedding, expected.tolist())) < 1e-4
        cut = client.embeddings.create(model=sentence_model.name, input=TEXTS, dimensions=16)
        for vector, expected in zip(cut.data, want):
            short = expected[:16] / expected[:16].norm()
            assert len(vector.embedding) == 16 and max(abs(a - b) for a, b in zip(vector.embedding, short)) < 1e-4
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model=sentence_model.name, input=TEXTS, dimensions=20)

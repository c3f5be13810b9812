"""32 streaming clients at once: every one completes with its own, correct output."""

import asyncio

import openai
import pytest

from tests.live_server import API_KEY, MODEL, start_server, stop_server

NUM_CLIENTS = 32
MAX_TOKENS = 8  # 32 distinct answers already (checked below)
TOPICS = ["rivers", "cats", "the moon", "bread", "trains", "music", "snow", "chess", "bees", "volcanoes",
          "tea", "bridges", "owls", "rain", "maps", "glass", "salt", "clocks", "ships", "forests", "paper",
          "bicycles", "mountains", "coffee", "stars", "whales", "deserts", "gardens", "robots", "castles",
          "lighthouses", "honey"]


def prompts() -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write one sentence about {topic}."}] for topic in TOPICS[:NUM_CLIENTS]]


async def _stream_one(client: openai.AsyncOpenAI, messages) -> tuple[str, str | None]:
    stream = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                  max_tokens=MAX_TOKENS, stream=True)
    text, reason = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def run_alone_then_together(base_url: str) -> tuple[list[str], list[tuple[str, str | None]]]:
    async def run():
        client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0)
        alone = [(await _stream_one(client, m))[0] for m in prompts()]
        together = await asyncio.gather(*[_stream_one(client, m) for m in prompts()])
        return alone, together
    return asyncio.run(run())


def test_32_streams_fp32_equal_their_solo_runs(fp32_server):
    alone, together = run_alone_then_together(fp32_server.base_url)
    assert all(reason in ("stop", "length") for _, reason in together)
    assert len(set(alone)) == NUM_CLIENTS  # distinct prompts, distinct answers: no cross-talk possible to hide
    assert [text for text, _ in together] == alone


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("default"), "--api-key", API_KEY)
    yield server
    stop_server(server)


def test_32_streams_default_dtype_all_complete(default_server):
    """The default settings (dtypes measured at start-up, 16-bit KV cache): batching may change rounding, so outputs
    need not equal solo runs (the float32 test above checks that); every stream must complete with text."""
    async def run():
        client = openai.AsyncOpenAI(base_url=default_server.base_url, api_key=API_KEY, max_retries=0)
        return await asyncio.gather(*[_stream_one(client, m) for m in prompts()])
    together = asyncio.run(run())
    assert len(together) == NUM_CLIENTS
    assert all(reason in ("stop", "length") and text for text, reason in together)

"""EngineClient: the API process's one handle on the engine. The server sees this class and the message types only,
and gets from it plain data (``info``, ``chat_template``) or awaitables that run off the event loop.

It owns what the API side needs without the model: the tokenizer (encode, chat templates, decode, token pieces for
logprobs -- each call on a worker thread), the front-end path that validates requests and fans out their choices
(engine/messages.py's ``make_engine_requests``, shared with ``LLM``), the grammar checker (structured/checker.py:
compile and try a grammar in a child process, with a time and size budget), and a queue per live request fed by the
engine's outputs. Work done for callers (tokenizing, templates, grammar checks) queues per caller and is served
round-robin (tokenmill/fair.py), so one API key's many requests cannot hold up another's. The engine core itself
runs in a child process (engine/process.py) or, with ``in_process``, on a thread beside the server.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from tokenmill.config import EngineConfig
from tokenmill.engine.messages import (EngineInfo, EngineRequest, EngineStats, RequestOutput, StepOutputs,
                                       make_engine_requests)
from tokenmill.engine.process import EngineDeadError, EngineProcess, InProcessEngine
from tokenmill.fair import FairExecutor
from tokenmill.models.tokenizer import NoChatTemplate, Tokenizer
from tokenmill.sampling.params import SamplingParams
from tokenmill.structured.checker import CheckerUnavailable, GrammarChecker
from tokenmill.structured.spec import GrammarSpec

log = logging.getLogger(__name__)

__all__ = ["EngineClient", "EngineDeadError", "NoChatTemplate", "TokenPiece"]


@dataclass(frozen=True)
class TokenPiece:
    """One token as logprobs show it: its text decoded alone, and its exact bytes (a piece of a character split
    across tokens has bytes but no text of its own: its text is U+FFFD)."""
    text: str
    bytes: list[int]


class EngineClient:
    def __init__(self, config: EngineConfig, in_process: bool = False):
        self.config = config
        self._tokenizer: Tokenizer | None = None  # loaded by start(), while the engine loads its model
        # Tokenization and chat templates on one thread, grammar checks on two (the checker's children), each queue
        # served round-robin among the callers (API keys) waiting on it: tokenmill/fair.py.
        self._tokenizer_thread = FairExecutor(1, thread_name_prefix="tokenmill-tokenizer")
        self._grammar_thread = FairExecutor(2, thread_name_prefix="tokenmill-grammar-check")
        self._engine = InProcessEngine(config) if in_process else EngineProcess(config)
        self.engine_in_own_process = not in_process
        self.info: EngineInfo | None = None
        self.chat_template: str | None = None  # the model's chat template, once started
        self.stats = EngineStats()  # the engine's counters after its latest step
        self._live: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pieces: dict[int, TokenPiece] = {}
        self._token_bytes: list[bytes] | None = None
        self._tokenizer_info = None  # xgrammar's TokenizerInfo: each token's exact bytes; built on first use
        self._checker: GrammarChecker | None = None
        self._checker_lock = threading.Lock()  # the checker threads make it once
        self.error: BaseException | None = None
        # Called once the engine has failed and every request in flight has its error (``tokenmill serve`` exits).
        self.on_failure: Callable[[BaseException], None] = lambda exc: None

    # --- lifecycle
    def start(self) -> EngineInfo:
        """Start the engine and wait until its model is loaded (call off the event loop: it takes seconds)."""
        def load_tokenizer() -> Tokenizer:
            return Tokenizer.of_model(self.config.model, self.config.tokenizer_cache_dir)
        if self.engine_in_own_process:  # load it while the child loads the model
            tokenizer = self._tokenizer_thread.submit(load_tokenizer)
            self.info = self._engine.start(self._on_step, self._on_dead)
            self._tokenizer = tokenizer.result()
        else:  # one process: transformers' lazy imports are not safe to race from two threads
            self.info = self._engine.start(self._on_step, self._on_dead)
            self._tokenizer = load_tokenizer()
        if self.config.chat_template is not None:  # --chat-template: the operator's template replaces the checkpoint's
            self._tokenizer.hf.chat_template = Path(self.config.chat_template).expanduser().read_text()
        self.chat_template = self._tokenizer.hf.chat_template
        return self.info

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine (SIGKILL after ``timeout`` seconds; at once for 0) and the grammar checker."""
        self._engine.stop(timeout)
        if self._checker is not None:
            self._checker.close()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        self._grammar_thread.shutdown(wait=False, cancel_futures=True)

    @property
    def healthy(self) -> bool:
        return self.info is not None and self.error is None

    # --- tokenizer, off the event loop
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._off_loop(self._tokenizer.encode, text, add_special_tokens)

    async def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                                  tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None
                                  ) -> list[int]:
        return await self._off_loop(self._tokenizer.apply_chat_template, messages, add_generation_prompt, tools,
                                    template_kwargs)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self._off_loop(self._tokenizer.decode, token_ids, skip_special_tokens)

    async def token_strings(self, token_ids: list[int]) -> list[str]:
        """The vocabulary's own strings of these tokens (byte-level pieces as the tokenizer spells them)."""
        return await self._off_loop(self._tokenizer.hf.convert_ids_to_tokens, token_ids)

    async def token_pieces(self, token_ids: Sequence[int]) -> list[TokenPiece]:
        """Each token's text and exact bytes (remembered: a token is decoded once per server)."""
        missing = [t for t in dict.fromkeys(token_ids) if t not in self._pieces]
        if missing:
            self._pieces.update(await self._off_loop(self._make_pieces, missing))
        return [self._pieces[t] for t in token_ids]

    def _make_pieces(self, token_ids: list[int]) -> dict[int, TokenPiece]:
        if self._token_bytes is None:
            self._token_bytes = list(self._xgrammar_tokenizer_info().decoded_vocab)
        table = self._token_bytes
        return {t: TokenPiece(self._tokenizer.decode([t], skip_special_tokens=False),
                              list(table[t]) if t < len(table) else []) for t in token_ids}

    def _xgrammar_tokenizer_info(self):
        if self._tokenizer_info is None:
            import xgrammar as xgr

            self._tokenizer_info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer.hf, vocab_size=self.info.vocab_size, stop_token_ids=list(self.info.eos_token_ids))
        return self._tokenizer_info

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    # --- requests
    async def check_grammar(self, spec: GrammarSpec) -> None:
        """Compile and try ``spec`` within the configured time and size budget (structured/checker.py); raises
        GrammarError, or its GrammarBudgetError, saying why not. A checker that cannot run lets the grammar through
        (logged): the engine keeps its own budget on every grammar."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._grammar_thread, self._check_grammar, spec)
        except CheckerUnavailable as exc:
            log.error("grammar not checked before admission: %s", exc)

    def _check_grammar(self, spec: GrammarSpec) -> None:
        with self._checker_lock:
            if self._checker is None:
                info = self._tokenizer_thread.submit(self._xgrammar_tokenizer_info).result()
                self._checker = GrammarChecker(info.serialize_json(), list(self.info.eos_token_ids),
                                               self.config.grammar_timeout, self.config.grammar_max_bytes,
                                               cache_bytes=self.config.grammar_cache_bytes,
                                               memory_bytes=self.config.grammar_checker_memory)
        self._checker.check(spec)

    def make_requests(self, prompts: Sequence[list[int]], params: SamplingParams, arrival_time: float,
                      cache_salt: str | None = None, priority: int = 0, cache_scope: str | None = None
                      ) -> list[EngineRequest]:
        """Validated engine requests, ``params.n`` per prompt (make_engine_requests: SamplingParamError or
        PromptError naming the problem), of ``priority`` (0 interactive, 1 batch), sharing cached blocks within
        ``cache_scope`` only."""
        return make_engine_requests(self.info, prompts, params, arrival_time, cache_salt, priority=priority,
                                    cache_scope=cache_scope)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit ``request`` and yield its outputs until it finishes. Closing the iterator early (the client
        went away, the handler was cancelled) aborts the request and frees its KV blocks."""
        if self.error is not None:
            raise EngineDeadError(str(self.error))
        self._loop = asyncio.get_running_loop()
        rid = request.request_id
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._live[rid] = queue
        finished = False
        try:
            self._engine.submit(request)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(str(item)) from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._live.pop(rid, None)
            if not finished and self.error is None:
                self._engine.abort(rid)

    # --- engine side (called on the engine's receiver thread)
    def _on_step(self, step: StepOutputs) -> None:
        self.stats = step.stats
        if step.outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, step.outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._live.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _on_dead(self, exc: BaseException) -> None:
        self.error = exc
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_all, exc)
        self.on_failure(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for queue in self._live.values():
            queue.put_nowait(exc)

"""GrammarSpec -> xgrammar Grammar (no tokenizer: the API process validates with it) and the engine's compiler,
which turns specs into token-level grammars for one tokenizer and keeps them in an LRU cache keyed by the spec."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import xgrammar as xgr

from tokenmill.structured.errors import GrammarBudgetError, GrammarError, GrammarTimeout  # noqa: F401 (re-exported)
from tokenmill.structured.spec import GrammarSpec

# JSON written without free whitespace (a small model left free to indent can emit spaces until max_tokens), and
# strictly: an object takes only the properties its schema lists unless the schema itself allows more (OpenAI's
# strict mode asks for additionalProperties false anyway), so the output always validates against the schema.
_JSON_OPTIONS = dict(any_whitespace=False, strict_mode=True)
_ANY_OBJECT = '{"type": "object", "additionalProperties": true}'


def check_deadline(deadline: float) -> None:
    """Between two xgrammar calls of a request's grammar work: GrammarTimeout once ``deadline`` (a time.monotonic()
    time) has passed. A call itself cannot be interrupted."""
    if time.monotonic() > deadline:
        raise GrammarTimeout("its grammar ran past its deadline")


def _clean(exc: Exception) -> str:
    # xgrammar prefixes "[hh:mm:ss] /project/cpp/file.cc:123: " to its messages.
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(exc)).strip()


def _choice_ebnf(value: str) -> str:
    choices = json.loads(value)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(spec: GrammarSpec) -> xgr.Grammar:
    """The grammar a spec describes; GrammarError when it describes none."""
    try:
        if spec.kind == "json_object":  # OpenAI's JSON mode: an object (xgrammar's builtin JSON takes any value)
            return xgr.Grammar.from_json_schema(_ANY_OBJECT, **_JSON_OPTIONS)
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.value, **_JSON_OPTIONS)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(spec.value))
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.value)
        if spec.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec.value)
    except GrammarError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError/its own InvalidJSONError
        raise GrammarError(_clean(exc)) from None
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


class GrammarCompiler:
    """Compiles specs for one tokenizer; the ``max_entries`` most recently used compiled grammars are kept. Safe to
    call from several threads (the engine compiles on worker threads)."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int], max_entries: int = 256,
                 cache_max_bytes: float = math.inf):
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._compiling: dict[GrammarSpec, Future] = {}  # one compile per spec at a time; others wait for it
        self._lock = threading.Lock()  # guards both; compiling runs outside it
        self.max_entries, self.cache_max_bytes = max_entries, cache_max_bytes
        self.num_compiled = 0  # cache misses, for the tests and the log

    def compile(self, spec: GrammarSpec, max_bytes: float = math.inf, deadline: float = math.inf
                ) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``; GrammarError when it describes none, GrammarBudgetError when it compiles
        larger than ``max_bytes`` (and it is not kept), GrammarTimeout when another thread's compile of the same
        spec has not finished by ``deadline`` (time.monotonic())."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
            elif (waiting := self._compiling.get(spec)) is None:
                self._compiling[spec] = mine = Future()
        if compiled is None and waiting is not None:
            try:  # the other compile's grammar, or its error
                compiled = waiting.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise GrammarTimeout("its grammar is still compiling") from None
        elif compiled is None:
            compiled = self._compile_once(spec, mine)
        if compiled.memory_size_bytes > max_bytes:
            raise GrammarBudgetError(f"its compiled grammar takes {compiled.memory_size_bytes} bytes, more than the "
                                     f"{max_bytes:.0f} this server allows (grammar_max_bytes)")
        return compiled

    def _compile_once(self, spec: GrammarSpec, mine: Future) -> xgr.CompiledGrammar:
        """Compile ``spec`` for every thread waiting on ``mine``; kept in the cache when a grammar of its size may be
        kept at all (not larger than the largest allowed, ``cache_max_bytes``)."""
        try:
            compiled = self._compiler.compile_grammar(build_grammar(spec))
        except Exception as exc:
            error = exc if isinstance(exc, GrammarError) else GrammarError(_clean(exc))
            with self._lock:
                del self._compiling[spec]
            mine.set_exception(error)
            raise error from None
        with self._lock:
            del self._compiling[spec]
            self.num_compiled += 1
            if compiled.memory_size_bytes <= self.cache_max_bytes:
                self._cache[spec] = compiled
                if len(self._cache) > self.max_entries:
                    self._cache.popitem(last=False)
        mine.set_result(compiled)
        return compiled

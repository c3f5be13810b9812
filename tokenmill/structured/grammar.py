"""GrammarSpec -> xgrammar Grammar (no tokenizer: the API process validates with it) and the engine's compiler,
which turns specs into token-level grammars for one tokenizer and keeps them in an LRU cache keyed by the spec."""

from __future__ import annotations

import json
import re
from collections import OrderedDict

import xgrammar as xgr

from tokenmill.structured.spec import GrammarSpec

# JSON written without free whitespace (a small model left free to indent can emit spaces until max_tokens), and
# strictly: an object takes only the properties its schema lists unless the schema itself allows more (OpenAI's
# strict mode asks for additionalProperties false anyway), so the output always validates against the schema.
_JSON_OPTIONS = dict(any_whitespace=False, strict_mode=True)
_ANY_OBJECT = '{"type": "object", "additionalProperties": true}'


class GrammarError(ValueError):
    """The spec does not describe a valid grammar; the message says why (xgrammar's words, without its location)."""


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
    """Compiles specs for one tokenizer; the ``max_entries`` most recently used compiled grammars are kept."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int], max_entries: int = 256):
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self.max_entries = max_entries
        self.num_compiled = 0  # cache misses, for the tests and the log

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        compiled = self._cache.get(spec)
        if compiled is None:
            try:
                compiled = self._compiler.compile_grammar(build_grammar(spec))
            except GrammarError:
                raise
            except Exception as exc:
                raise GrammarError(_clean(exc)) from None
            self.num_compiled += 1
            self._cache[spec] = compiled
            if len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        self._cache.move_to_end(spec)
        return compiled

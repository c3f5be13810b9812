"""Grammar checks before a request is admitted. A grammar is compiled for the model's tokenizer and tried -- the
closing text that steers an output near max_tokens, then a walk of ``WALK_TOKENS`` tokens (each step's allowed-token
mask, then the allowed token with the longest text), then the closing text again -- which is the work it makes the
engine do while it runs. All of it happens in a child process with a time budget: a grammar that describes nothing,
compiles larger than ``max_bytes`` or takes longer than ``timeout_s`` is refused (the server answers 400 naming its
field) before it reaches the engine, and a check over its time is ended by killing the child (an xgrammar call
cannot be interrupted), never waited for. Verdicts are remembered (LRU), so a schema that comes with every request
is checked once, and a client that retries a refused grammar costs the server nothing more; the verdicts kept are
bounded by the bytes of their grammars' text (``cache_bytes``). Two checks run at once, a child each, so that one
costly grammar does not hold up the next new one. A child's address space may grow by at most ``memory_bytes`` past
what it holds once ready (RLIMIT_AS): a grammar that needs more fails its check ("exhausted the checker's memory")
instead of pushing the host into swap.

Why a walk: some grammars compile in milliseconds and still blow up later -- ``(a+)+`` repeated 200 times makes
xgrammar's matcher slower with every ``a`` it accepts (10 ms at the 8th token, 90 ms at the 12th) and its jump-forward
search run for minutes -- and the engine must not be the place that finds out.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from collections import OrderedDict

from tokenmill.structured.errors import GrammarBudgetError, GrammarError
from tokenmill.structured.spec import GrammarSpec

log = logging.getLogger(__name__)

__all__ = ["CheckerUnavailable", "GrammarBudgetError", "GrammarChecker", "WALK_TOKENS"]

WALK_TOKENS = 32


class CheckerUnavailable(RuntimeError):
    """The checker's child process could not start or talk (not the grammar's fault)."""


class GrammarChecker:
    def __init__(self, tokenizer_info_json: str, stop_token_ids: list[int], timeout_s: float, max_bytes: int,
                 cache_bytes: int = 16 * 2**20, children: int = 2, memory_bytes: int | None = None):
        self.timeout_s, self.max_bytes, self.cache_bytes = timeout_s, max_bytes, cache_bytes
        self._child_args = (tokenizer_info_json, list(stop_token_ids), max_bytes, memory_bytes)
        # spec -> None (it passed) or (the error's class, its message): raised afresh for each request. Invariant:
        # ``_cached_bytes`` is the sum of the kept specs' text lengths, at most ``cache_bytes``.
        self._verdicts: OrderedDict[GrammarSpec, tuple[type[GrammarError], str] | None] = OrderedDict()
        self._cached_bytes = 0
        self._slots = threading.Semaphore(children)  # checks at once, one child each (started when first needed)
        self._idle: list[_Child] = []
        self._lock = threading.Lock()  # guards _verdicts and _idle

    def check(self, spec: GrammarSpec) -> None:
        """Raises GrammarError (the spec describes no grammar), GrammarBudgetError, or CheckerUnavailable. Blocks for
        up to the time budget (plus a child's start-up): call it off the event loop."""
        with self._lock:
            known = spec in self._verdicts
            if known:
                self._verdicts.move_to_end(spec)
                verdict = self._verdicts[spec]
        if not known:
            verdict = self._trial(spec)
            self._remember(spec, verdict)
        if verdict is not None:
            raise verdict[0](verdict[1])

    def _remember(self, spec: GrammarSpec, verdict: tuple[type[GrammarError], str] | None) -> None:
        size = len(spec.value)
        if size > self.cache_bytes:
            return
        with self._lock:
            if spec in self._verdicts:  # a concurrent check of the same spec got there first
                return
            self._verdicts[spec] = verdict
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                old, _ = self._verdicts.popitem(last=False)
                self._cached_bytes -= len(old.value)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.kill()

    def _trial(self, spec: GrammarSpec) -> tuple[type[GrammarError], str] | None:
        with self._slots:
            with self._lock:
                child = self._idle.pop() if self._idle else None
            child = child or _Child(self._child_args)
            verdict, detail = child.trial(spec, self.timeout_s)
            if verdict == "died":
                child.kill()  # it reported its own memory error: it ends, or is ended, here
            elif child.alive:
                with self._lock:
                    self._idle.append(child)
        if verdict == "ok":
            return None
        if verdict == "timeout":
            return GrammarBudgetError, (f"it takes more than {self.timeout_s:g} s to compile and try (this server's "
                                        f"grammar_timeout)")
        if verdict == "died":  # out of memory: the grammar is what killed it
            return GrammarBudgetError, "checking it exhausted the checker's memory"
        if verdict == "too_big":
            return GrammarBudgetError, (f"its compiled grammar takes {detail} bytes, more than the {self.max_bytes} "
                                        f"this server allows (grammar_max_bytes)")
        return GrammarError, detail


class _Child:
    """One checker process: started and ready (its imports and the tokenizer's vocabulary are not the grammar's
    time), then one trial at a time."""

    STARTUP_TIMEOUT_S = 120.0

    def __init__(self, args: tuple):
        ctx = mp.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_child_main, args=(theirs, *args), daemon=True,
                                   name="tokenmill-grammar-check")
        try:
            self.process.start()
            theirs.close()
            if not self.conn.poll(self.STARTUP_TIMEOUT_S) or self.conn.recv() != "ready":
                raise CheckerUnavailable("the grammar checker did not start")
        except (OSError, EOFError) as exc:
            self.kill()
            raise CheckerUnavailable(f"the grammar checker did not start: {exc}") from None
        except CheckerUnavailable:
            self.kill()
            raise

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def trial(self, spec: GrammarSpec, timeout_s: float) -> tuple[str, object]:
        """("ok" | "invalid" | "too_big", detail) from the child; ("timeout" | "died", None) after killing it."""
        try:
            self.conn.send(spec)
        except OSError as exc:
            self.kill()
            raise CheckerUnavailable(f"the grammar checker is gone: {exc}") from None
        if not self.conn.poll(timeout_s):
            self.kill()
            return "timeout", None
        try:
            return self.conn.recv()
        except EOFError:
            self.kill()
            return "died", None

    def kill(self) -> None:
        if self.process.pid is not None:
            self.process.kill()
            self.process.join()
        self.conn.close()


def _limit_address_space(extra_bytes: int) -> None:
    """RLIMIT_AS at this process's address space now plus ``extra_bytes``: what one grammar may add."""
    import resource

    with open("/proc/self/statm") as fh:
        size = int(fh.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + extra_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _child_main(conn, tokenizer_info_json: str, stop_token_ids: list[int], max_bytes: int,
                memory_bytes: int | None) -> None:
    from tokenmill.runtime import exit_with_parent

    exit_with_parent()
    import numpy as np
    import xgrammar as xgr

    from tokenmill.structured.closing import allowed_tokens, closing_text
    from tokenmill.structured.grammar import _clean, build_grammar

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    vocab = info.decoded_vocab
    lengths = np.array([len(piece) for piece in vocab], dtype=np.int64)
    stops = set(stop_token_ids)
    width = -(-info.vocab_size // 32)
    if memory_bytes is not None and hasattr(__import__("resource"), "RLIMIT_AS"):
        _limit_address_space(memory_bytes)

    def decode(token: int) -> str:
        return vocab[token].decode("utf-8", errors="replace")

    def trial(spec: GrammarSpec) -> tuple[str, object]:
        try:
            compiled = compiler.compile_grammar(build_grammar(spec))
        except GrammarError as exc:
            return "invalid", str(exc)
        except MemoryError:
            return "died", None
        except Exception as exc:  # noqa: BLE001 - xgrammar's own error types
            return "invalid", _clean(exc)
        if compiled.memory_size_bytes > max_bytes:
            return "too_big", compiled.memory_size_bytes
        matcher = xgr.GrammarMatcher(compiled)
        closing_text(matcher, "", decode, width, stops)
        text = ""
        for _ in range(WALK_TOKENS):
            if matcher.is_terminated():
                break
            allowed = np.flatnonzero(allowed_tokens(matcher, width)[:len(vocab)])
            allowed = allowed[~np.isin(allowed, list(stops))] if stops else allowed
            if not len(allowed):
                break
            token = int(allowed[np.argmax(lengths[allowed])])
            if not matcher.accept_token(token):
                break
            text += decode(token)
        if not matcher.is_terminated():
            closing_text(matcher, text, decode, width, stops)
        return "ok", None

    conn.send("ready")
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            verdict = trial(spec)
        except MemoryError:  # past RLIMIT_AS in the walk: this child may be in no state to go on
            conn.send(("died", None))
            return
        conn.send(verdict)

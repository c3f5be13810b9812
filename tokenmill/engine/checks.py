"""The engine's reporters: each request's incremental detokenizer (its text deltas and stop strings) and its grammar
(engine/grammar.py). After every step they read the tokens each request kept past its token stops and report what
they found -- a stop string after token i, a complete grammar output after token i, the drafts a grammar accepts, the
text to send -- as plain data (``OutputReports``) for the scheduler's ``update_from_output``. They change no request.
"""

from __future__ import annotations

from tokenmill.engine.detokenizer import Decoder, IncrementalDetokenizer
from tokenmill.engine.grammar import GrammarService
from tokenmill.engine.isolation import failure_message, log_failure
from tokenmill.engine.messages import EngineRequest
from tokenmill.scheduler.output import Kept, OutputReports, Stop


class OutputChecks:
    def __init__(self, tokenizer: Decoder, grammars: GrammarService):
        self.tokenizer = tokenizer
        self.grammars = grammars
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add(self, request: EngineRequest) -> None:
        params = request.params
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.stop, params.skip_special_tokens,
            params.include_stop_str_in_output)
        if params.grammar is not None:
            self.grammars.add(request.request_id, params.grammar, request.max_tokens)

    def remove(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self.grammars.remove(request_id)

    def report(self, kept: dict[str, Kept], drafts: dict[str, list[int]], grace_s: float) -> OutputReports:
        """What this step's kept tokens show. A grammar's completion cuts the tokens the detokenizer reads (and ends
        its text); a stop string found in them cuts again. A request whose reporter fails is reported in ``errors``
        (engine/isolation.py's message; the exception goes to the log), with nothing else of the step."""
        found = self.grammars.advance(kept, drafts, grace_s)
        reports = OutputReports(drafts=found.drafts, completed=found.completed, errors=found.errors)
        for request_id, k in kept.items():
            try:
                self._read(request_id, k, found.complete_at.get(request_id), reports)
            except Exception as exc:  # noqa: BLE001 - the request's own
                self._fail(request_id, exc, reports)
        for request_id in found.completed:  # complete after tokens an earlier step sent: the held-back text
            if (detok := self._detokenizers.get(request_id)) is not None:
                try:
                    reports.texts[request_id] = detok.update([], finished=True)
                except Exception as exc:  # noqa: BLE001 - likewise
                    self._fail(request_id, exc, reports)
        return reports

    def _read(self, request_id: str, k: Kept, complete_at: int | None, reports: OutputReports) -> None:
        tokens, finishing, stop = k.token_ids, k.finishing, None
        if complete_at is not None:
            tokens, finishing, stop = tokens[:complete_at + 1], True, Stop(complete_at)
        detok, text = self._detokenizers[request_id], ""
        for i, token in enumerate(tokens):
            text += detok.update([token], finished=finishing and i == len(tokens) - 1)
            if detok.stopped_by is not None:
                stop = Stop(i, detok.stopped_by)
                break
        reports.texts[request_id] = text
        if stop is not None:
            reports.stops[request_id] = stop

    @staticmethod
    def _fail(request_id: str, exc: Exception, reports: OutputReports) -> None:
        log_failure(request_id, "reading its output", exc)
        reports.texts.pop(request_id, None)
        reports.stops.pop(request_id, None)
        reports.errors[request_id] = failure_message(request_id)

"""A failure stays in its request: a fault injected into ONE request's path -- its sampling parameters stored in the
runner's batch, the model forward over its tokens (found by bisection), its detokenizer, its admission, its output --
ends that request with finish_reason "error" and a generic message (the exception's text goes to the log only), while
greedy neighbours started before and after it in the same steps keep exactly the tokens of a run without it, the
engine steps on, and no KV block leaks. A fault that no single request explains still raises out of the step.

Each engine is a tiny random Llama (tests/tiny_checkpoints.py) built for its test: a fault test patches it."""

import dataclasses
import logging
import time

import pytest

from tests.tiny_checkpoints import make_llama_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.engine.checks import OutputChecks
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.messages import EngineRequest
from tokenmill.engine.process import apply_commands

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# The requests around the faulty one: two start before it, two with it (then it runs among all four).
NEIGHBOURS = [[1, 2, 3, 4, 5], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30, 31]]
MARKER = 4242  # a prompt token only the faulty request has
FAULT = "injected fault at /secret/engine/path.py"  # must never reach an output


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm_llm):
    path = tmp_path_factory.mktemp("fault-llama")
    make_llama_checkpoint(path, smollm_llm)
    return str(path)


def new_llm(checkpoint, **config) -> LLM:
    return LLM(model=checkpoint, dtype="float32", kv_cache_dtype="fp32", kv_cache_memory="8MiB", max_model_len=128,
               **config)


def collect(outputs, results: dict) -> None:
    for out in outputs:
        r = results.setdefault(out.request_id, {"tokens": [], "finish": None, "error": None})
        assert r["finish"] is None, f"{out.request_id} has an output after it finished"
        r["tokens"] += out.new_token_ids
        if out.finished:
            r["finish"], r["error"] = out.finish_reason, out.error


def run(llm: LLM, faulty: tuple[list[int], SamplingParams] | None, params: SamplingParams = GREEDY) -> dict:
    """n0 and n1 start and take two steps; then the faulty request (if any; queued as the engine receives it, past
    the front end's checks), n2 and n3 join; step until all end."""
    engine, results = llm.engine, {}
    for i in (0, 1):
        llm.add_request(NEIGHBOURS[i], params, request_id=f"n{i}")
    for _ in range(2):
        collect(engine.step().outputs, results)
    if faulty is not None:
        prompt, own = faulty
        engine.add_request(EngineRequest("faulty", prompt, own, own.max_tokens, time.monotonic()))
    for i in (2, 3):
        llm.add_request(NEIGHBOURS[i], params, request_id=f"n{i}")
    while engine.has_unfinished():
        collect(engine.step().outputs, results)
    return results


@pytest.fixture(scope="module")
def expected(checkpoint):
    """The neighbours' greedy tokens without the faulty request."""
    results = run(new_llm(checkpoint), None)
    assert all(len(r["tokens"]) == GREEDY.max_tokens for r in results.values())
    assert not any(MARKER in r["tokens"] for r in results.values())  # the marker stays the faulty request's own
    return results


def assert_isolated(llm: LLM, results: dict, expected: dict, free_before: int, caplog, raised=Injected,
                    params: SamplingParams = GREEDY) -> None:
    """The faulty request ended with a generic error, its exception (of type ``raised``) logged at ERROR with its id
    and traceback; the neighbours' tokens are the run's without it; a new request completes; no block leaked."""
    faulty = results["faulty"]
    logged = [rec for rec in caplog.records if rec.levelno == logging.ERROR and "faulty" in rec.getMessage()]
    assert logged and logged[0].exc_info is not None and isinstance(logged[0].exc_info[1], raised)
    assert faulty["finish"] == "error" and "faulty" in faulty["error"]
    assert str(logged[0].exc_info[1]) not in faulty["error"] and raised.__name__ not in faulty["error"]
    for rid, r in expected.items():
        assert results[rid] == r, rid
    engine = llm.engine
    after = llm.generate([NEIGHBOURS[0]], params)[0]  # the engine steps on
    assert after.finish_reason == "length" and after.token_ids == expected["n0"]["tokens"]
    engine.scheduler.check_integrity()
    assert engine.scheduler.kv.pool.num_free_blocks == free_before
    assert "faulty" not in engine.runner.batch.row_of and not engine.has_unfinished()
    engine.step()  # the last finished request's row goes with the next diff
    assert engine.runner.batch.row_of == {}


def faulty_run(checkpoint, caplog, faulty, patch=None, params: SamplingParams = GREEDY, **config):
    llm = new_llm(checkpoint, **config)
    if patch is not None:
        patch(llm)
    free_before = llm.engine.scheduler.kv.pool.num_free_blocks
    with caplog.at_level(logging.ERROR):
        results = run(llm, faulty, params)
    return llm, results, free_before


def patch_forward(monkeypatch, llm: LLM, fails) -> list[list[str]]:
    """The model forward raises whenever ``fails(input_ids, request_ids, batch)`` holds for the requests it computes
    (the step's, or a subset's when the engine bisects). Returns the list of the request sets computed."""
    runner = llm.engine.runner
    prepare, forward, computing, history = runner.batch.prepare, runner.model.forward, [], []

    def recording_prepare(num_scheduled):
        computing[:] = list(num_scheduled)
        history.append(list(num_scheduled))
        return prepare(num_scheduled)

    def faulty_forward(input_ids, *args, **kwargs):
        if fails(input_ids.tolist(), computing, runner.batch):
            raise Injected(FAULT)
        return forward(input_ids, *args, **kwargs)
    monkeypatch.setattr(runner.batch, "prepare", recording_prepare)
    monkeypatch.setattr(runner.model, "forward", faulty_forward)
    return history


def _past_int64_seed() -> SamplingParams:
    """Greedy params whose seed is past int64: SamplingParams refuses one at construction, so it is set after, as a
    value that got past the API's checks would arrive."""
    params = dataclasses.replace(GREEDY)
    params.seed = 2 ** 64
    return params


def test_an_overflowing_sampling_parameter_ends_its_request_only(checkpoint, expected, caplog):
    """A seed past int64 overflows the batch's seed array as the runner stores the request's row: a real fault in the
    engine's own code, no patch."""
    llm, results, free = faulty_run(checkpoint, caplog, ([40, 41, 42], _past_int64_seed()))
    assert results["faulty"]["tokens"] == []
    assert_isolated(llm, results, expected, free, caplog, raised=OverflowError)


def test_a_forward_fault_over_its_prompt_is_found_by_bisection(checkpoint, expected, caplog, monkeypatch):
    """The forward raises whenever the batch holds the faulty prompt's marker token: the whole step fails, then the
    halves that hold it, until it fails alone."""
    computed = []

    def patch(llm):
        computed.append(patch_forward(monkeypatch, llm, lambda input_ids, ids, batch: MARKER in input_ids))
    llm, results, free = faulty_run(checkpoint, caplog, ([MARKER, 40, MARKER, 41], GREEDY), patch)
    assert results["faulty"]["tokens"] == []
    step = next(i for i, ids in enumerate(computed[0]) if "faulty" in ids)
    assert computed[0][step] == ["n0", "n1", "faulty", "n2", "n3"]  # its neighbours shared the step
    assert computed[0][step + 1:step + 5] == [["n0", "n1"], ["faulty", "n2", "n3"], ["faulty"], ["n2", "n3"]]
    assert_isolated(llm, results, expected, free, caplog)


def test_a_sampler_fault_is_found_by_bisection(checkpoint, expected, caplog):
    """A logit_bias token id past the vocabulary (the front end refuses it; the engine must survive it anyway) makes
    the batched sampler's index_put raise for the whole step: no patch."""
    params = dataclasses.replace(GREEDY, logit_bias={10 ** 6: 5.0})
    llm, results, free = faulty_run(checkpoint, caplog, ([40, 41, 42], params))
    assert results["faulty"]["tokens"] == []
    assert_isolated(llm, results, expected, free, caplog, raised=IndexError)


def test_a_forward_fault_mid_stream_ends_it_after_its_tokens(checkpoint, expected, caplog, monkeypatch):
    """The forward raises once the faulty request has 3 outputs: it has streamed them and holds blocks."""
    prompt = [40, 41, 42]

    def fails(input_ids, ids, batch):
        return "faulty" in ids and batch.num_tokens[batch.row_of["faulty"]] >= len(prompt) + 3

    llm, results, free = faulty_run(checkpoint, caplog, (prompt, GREEDY),
                                    lambda llm: patch_forward(monkeypatch, llm, fails))
    assert len(results["faulty"]["tokens"]) == 3
    assert_isolated(llm, results, expected, free, caplog)


@pytest.mark.parametrize("penalized", [False, True])
def test_a_drafter_fault_after_sampling_is_taken_back(checkpoint, caplog, monkeypatch, penalized):
    """With n-gram drafts, the proposer raises -- after the step's tokens were appended to the batch -- whenever the
    faulty request is among its rows: the batch takes them back before the halves run again, so the neighbours keep
    the tokens of a run without the faulty request (drafts verified along the way), and penalized rows' output
    counts stay those of their tokens at every step."""
    config = dict(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    params = dataclasses.replace(GREEDY, repetition_penalty=1.5, frequency_penalty=0.5) if penalized else GREEDY
    baseline = new_llm(checkpoint, **config)
    expected = run(baseline, None, params)

    def patch(llm):
        runner = llm.engine.runner
        batch, draft = runner.batch, runner.proposer.draft

        def faulty_draft(ctx):
            for row in ctx.rows.tolist():  # output_counts[r] counts row r's sampled tokens
                if batch.output_counts is not None:
                    assert batch.output_counts[row].sum() == batch.num_tokens[row] - batch.num_prompt_tokens[row]
            if batch.row_of.get("faulty") in ctx.rows.tolist():
                raise Injected(FAULT)
            return draft(ctx)
        monkeypatch.setattr(runner.proposer, "draft", faulty_draft)
    llm, results, free = faulty_run(checkpoint, caplog, ([40, 41, 42], params), patch, params, **config)
    assert results["faulty"]["tokens"] == []
    assert (llm.engine.runner.batch.output_counts is not None) == penalized
    if not penalized:
        assert llm.engine.scheduler.spec.num_draft_tokens_total > 0
    assert_isolated(llm, results, expected, free, caplog, params=params)


def test_a_detokenizer_fault_ends_its_request_only(checkpoint, expected, caplog, monkeypatch):
    """The faulty request's detokenizer (marked by its stop string) raises as it reads the request's tokens."""
    update = IncrementalDetokenizer.update

    def faulty_update(self, *args, **kwargs):
        if "<fault>" in self.stop:
            raise Injected(FAULT)
        return update(self, *args, **kwargs)
    monkeypatch.setattr(IncrementalDetokenizer, "update", faulty_update)
    llm, results, free = faulty_run(checkpoint, caplog, ([40, 41, 42], dataclasses.replace(GREEDY, stop=["<fault>"])))
    assert results["faulty"]["tokens"] == []
    assert_isolated(llm, results, expected, free, caplog)


def test_a_fault_while_adding_ends_its_request_only(checkpoint, expected, caplog, monkeypatch):
    """The reporters fail to take the request up after the scheduler has queued it: it is taken out again and
    answered with an error by the next step."""
    add = OutputChecks.add

    def faulty_add(self, request):
        add(self, request)
        if request.request_id == "faulty":
            raise Injected(FAULT)
    monkeypatch.setattr(OutputChecks, "add", faulty_add)
    llm, results, free = faulty_run(checkpoint, caplog, ([40, 41, 42], GREEDY))
    assert results["faulty"]["tokens"] == []
    assert "faulty" not in llm.engine.checks._detokenizers
    assert_isolated(llm, results, expected, free, caplog)


def test_a_fault_building_its_output_ends_its_request_only(checkpoint, expected, caplog, monkeypatch):
    """Building the faulty request's second output raises: the request ends there, after its first token."""
    calls = []

    def patch(llm):
        output = llm.engine._output

        def faulty_output(update, *args):
            if update.request.request_id == "faulty":
                calls.append(1)
                if len(calls) == 2:
                    raise Injected(FAULT)
            return output(update, *args)
        monkeypatch.setattr(llm.engine, "_output", faulty_output)
    llm, results, free = faulty_run(checkpoint, caplog, ([40, 41, 42], GREEDY), patch)
    assert len(results["faulty"]["tokens"]) == 1
    assert_isolated(llm, results, expected, free, caplog)


def test_a_refused_add_is_answered_with_an_error(checkpoint, expected, caplog):
    """The engine process's command loop answers a request the engine refuses (a duplicate id: the API side makes
    ids unique, so this is a bug's trace) with an error, and the request already running under that id goes on."""
    llm = new_llm(checkpoint)
    engine, results = llm.engine, {}
    llm.add_request(NEIGHBOURS[0], GREEDY, request_id="n0")
    collect(engine.step().outputs, results)
    duplicate = EngineRequest("n0", [7, 8, 9], GREEDY, GREEDY.max_tokens, 0.0)
    with caplog.at_level(logging.ERROR):
        step = apply_commands(engine, [duplicate], [])
    refused = step.outputs[0]
    assert refused.request_id == "n0" and refused.finished and refused.finish_reason == "error"
    assert "n0" in refused.error and "duplicate" not in refused.error
    assert any(rec.levelno == logging.ERROR and "n0" in rec.getMessage() and rec.exc_info for rec in caplog.records)
    collect(step.outputs[1:], results)
    while engine.has_unfinished():
        collect(apply_commands(engine, [], []).outputs, results)
    assert results["n0"]["tokens"] == expected["n0"]["tokens"]


def test_a_fault_of_every_request_raises_out_of_the_step(checkpoint, monkeypatch):
    """Every request of a step failing alone is no request's fault: the step raises (the engine restarts)."""
    llm = new_llm(checkpoint)
    patch_forward(monkeypatch, llm, lambda input_ids, ids, batch: True)
    for i in (0, 1):
        llm.add_request(NEIGHBOURS[i], GREEDY, request_id=f"n{i}")
    with pytest.raises(Injected):
        llm.engine.step()


def test_requests_failing_alone_step_after_step_raise(checkpoint, expected, monkeypatch):
    """Lone requests that fail in consecutive steps with no success between them are the engine's fault: the third
    raises. A step that succeeds starts the count over."""
    llm = new_llm(checkpoint)
    engine = llm.engine
    patch_forward(monkeypatch, llm, lambda input_ids, ids, batch: any(rid.startswith("r") for rid in ids))

    def fails_alone(request_id):
        llm.add_request(NEIGHBOURS[1], GREEDY, request_id=request_id)
        assert [(o.request_id, o.finish_reason) for o in engine.step().outputs] == [(request_id, "error")]
    fails_alone("r0")
    fails_alone("r1")
    assert llm.generate([NEIGHBOURS[0]], GREEDY)[0].token_ids == expected["n0"]["tokens"]
    fails_alone("r2")
    fails_alone("r3")
    llm.add_request(NEIGHBOURS[1], GREEDY, request_id="r4")
    with pytest.raises(Injected):
        engine.step()

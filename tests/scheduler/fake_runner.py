"""A fake model runner for scheduler tests: it keeps a fake KV cache and computes each next token from what that cache
holds, so a block shared by mistake, a prefix hit with the wrong contents or a write into a shared block changes the
outputs or fails an assertion. With KV groups (kvcache/groups.py) it reads each group's own table, a window group
only the positions its window sees: a block returned to the pool too early, or a window-group hit with the wrong
contents, changes the outputs too."""

import random

from tokenmill.sampling.params import SamplingParams
from tokenmill.scheduler.output import OutputReports, RunnerOutput
from tokenmill.scheduler.request import Request
from tokenmill.scheduler.scheduler import Scheduler

VOCAB = 97


def fake_next_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole context, as a real one does."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) + 7) % VOCAB


def windowed_context(tokens: list[int], windows: tuple[int, ...]) -> list[int]:
    """What the fake model reads before sampling after ``tokens``: per KV group, the tokens its window sees."""
    query = len(tokens) - 1
    return [t for w in windows for t in tokens[(max(0, query - w + 1) if w else 0):]]


def make_request(rid: str, prompt_len: int, max_tokens: int, seed: int = 0, prefix: list[int] | None = None,
                 cache_salt: str | None = None) -> Request:
    """A random prompt of ``prompt_len`` tokens after an optional shared ``prefix``."""
    rng = random.Random(seed)
    prompt = list(prefix or []) + [rng.randrange(1, VOCAB) for _ in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens=max_tokens,
                   cache_salt=cache_salt)


class FakeRunner:
    """A runner that knows only what SchedulerOutput tells it (the real runner's contract): it keeps each request's
    tokens, blocks and computed count from the diffs, writes each computed token into its KV slot, samples
    fake_next_token over the tokens read back from the request's slots, and drops dropped rows."""

    def __init__(self, sched: Scheduler):
        self.block_size, self.pool, self.null = sched.kv.block_size, sched.kv.pool, sched.kv.null_block
        self.windows = sched.kv.groups.windows
        self.rows: dict[str, dict] = {}
        self.kv: dict[int, int] = {}  # flat slot -> the token whose K/V it holds (a block is one group's at a time)

    def _slot(self, row: dict, group: int, position: int) -> int:
        block = row["blocks"][group][position // self.block_size]
        assert block != self.null, f"position {position} of group {group} reads the null block"
        return block * self.block_size + position % self.block_size

    def _verify(self, row: dict, drafts: list[int]) -> list[int]:
        """The model's token after each accepted draft, from the KV read back: accepted drafts, then its own."""
        tokens = []
        for j in range(len(drafts) + 1):
            query = len(row["tokens"]) + j - 1
            context = [self.kv[self._slot(row, g, p)] for g, w in enumerate(self.windows)
                       for p in range(max(0, query - w + 1) if w else 0, query + 1)]
            tokens.append(fake_next_token(context))
            if j == len(drafts) or tokens[-1] != drafts[j]:
                return tokens
        return tokens

    def execute(self, out) -> dict[str, list[int]]:
        for rid in out.finished_ids + out.preempted_ids:
            self.rows.pop(rid, None)
        for new in out.new_requests:
            assert new.request_id not in self.rows
            self.rows[new.request_id] = {"tokens": list(new.token_ids), "computed": new.num_computed_tokens,
                                         "blocks": [list(table) for table in new.block_tables]}
        for diff in out.running:
            row = self.rows[diff.request_id]
            for g, (added, live_from) in enumerate(zip(diff.new_block_ids, diff.live_from)):
                table = row["blocks"][g][:diff.num_blocks - len(added)] + added
                row["blocks"][g] = [self.null] * live_from + table[live_from:]
            row["computed"] = diff.num_computed_tokens
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            row = self.rows[rid]
            assert n > 0, f"{rid} is scheduled with no token to compute"
            assert all(len(t) * self.block_size >= row["computed"] + n for t in row["blocks"])  # the chunk has blocks
            drafts = out.spec_token_ids.get(rid, [])
            known = row["tokens"] + drafts
            for position in range(row["computed"], row["computed"] + n):
                for g, table in enumerate(row["blocks"]):
                    block = table[position // self.block_size]
                    assert self.pool.blocks[block].ref_cnt == 1, f"{rid} writes into shared block {block}"
                    self.kv[self._slot(row, g, position)] = known[position]
            if row["computed"] + n == len(known):
                sampled[rid] = self._verify(row, drafts)
                row["tokens"] += sampled[rid]
        return sampled


def run_step(sched: Scheduler, budget_seen: list[int] | None = None, propose=None, reports=None):
    """One step through the fake runner; ``propose(request, tokens)``, when given, drafts for each request that
    sampled from its tokens after the step, as the runner's proposer does (they come back in the runner's output);
    ``reports``: what the engine's detokenizers and grammars would report (default: nothing)."""
    runner = sched.__dict__.setdefault("_fake_runner", FakeRunner(sched))
    out = sched.schedule()
    assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    if budget_seen is not None:
        budget_seen.append(out.total_num_scheduled_tokens)
    sampled = runner.execute(out)
    for rid in out.num_scheduled_tokens:  # the runner's view equals the scheduler's
        req, row = sched.requests[rid], runner.rows[rid]
        assert (row["blocks"], row["computed"]) == (req.block_tables, req.num_computed_tokens)
        assert row["tokens"][:req.num_tokens] == req.all_token_ids
    drafts = {rid: propose(sched.requests[rid], runner.rows[rid]["tokens"]) for rid in sampled} if propose else {}
    updates = sched.update_from_output(out, RunnerOutput(sampled, drafts=drafts), reports or OutputReports())
    sched.check_integrity()
    return out, [u.request for u in updates if u.request.is_finished]


def random_workload(sched: Scheduler, rng: random.Random, prefixes: list[list[int]], max_prompt: int,
                    max_new: int, steps: int = 600, admit_steps: int = 200, propose=None) -> list[Request]:
    """Random requests (a random shared prefix, then ``1..max_prompt - 1`` own tokens, ``1..max_new - 1`` outputs)
    arriving during the first ``admit_steps`` steps, a few aborted, run to the end; returns them all."""
    reqs = []
    for step in range(steps):
        if step < admit_steps and rng.random() < 0.35:
            r = make_request(f"r{step}", rng.randrange(1, max_prompt), rng.randrange(1, max_new), seed=step,
                             prefix=rng.choice(prefixes))
            reqs.append(r)
            sched.add_request(r)
        if reqs and rng.random() < 0.03:
            sched.abort(rng.choice(reqs).request_id)
        if sched.has_unfinished():
            run_step(sched, propose=propose)  # checks the scheduler's integrity after every step
    drain(sched, propose=propose)
    return reqs


def drain(sched: Scheduler, max_steps: int = 10_000, propose=None):
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outs
        outs.append(run_step(sched, propose=propose)[0])
    raise AssertionError("scheduler did not finish")


def run_step_sampled(sched: Scheduler):
    """run_step, returning the tokens sampled in the step instead of the finished requests."""
    before = {rid: r.num_output_tokens for rid, r in sched.requests.items()}
    out, _ = run_step(sched)
    reqs = {**{r.request_id: r for r in sched.running}, **{r.request_id: r for r in sched.waiting}}
    return out, {rid: r.output_token_ids[-1] for rid, r in reqs.items() if r.num_output_tokens > before.get(rid, 0)}


def expected_output(req: Request, windows: tuple[int, ...] = (0,)) -> list[int]:
    """The fake model's outputs from the true tokens (``windows``: the KV groups' windows the runner reads)."""
    tokens = list(req.prompt_token_ids)
    for _ in range(req.max_tokens):
        tokens.append(fake_next_token(windowed_context(tokens, windows)))
    return tokens[req.num_prompt_tokens:]

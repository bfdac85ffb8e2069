"""Speculative decoding in one process: the n-gram proposer, the router's scheduler and the worker's
runner on tiny random Qwen2 and Llama (greedy output token-identical with and without speculation, KV
exact), and rejection sampling keeping the target's distribution."""
import pytest
import torch

from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from llaunch.runtime.config import SpecConfig, SpecMethod
from llaunch.runtime.ipc.messages import AddRequest, SamplingParams
from llaunch.runtime.models.loader import build_model
from llaunch.runtime.router.request import Request, Status
from llaunch.runtime.router.scheduler import Scheduler, SchedulerLimits
from llaunch.runtime.router.spec_decode import propose
from llaunch.runtime.worker.spec_verify import filtered_probs, verify_greedy, verify_sampled

from unit.spec_support import EOS, MAX_LEN, ROWS, SLOTS, serve


def test_proposal_is_what_followed_the_latest_longest_match():
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 0, 6, 7]
    assert propose(tokens, 3, 1, 3) == [3, 4, 0]  # "6 7" last seen before the end at index 6
    assert propose(tokens, 1, 1, 3) == [3]
    assert propose([1, 2, 3, 4], 4, 1, 3) == []  # nothing repeats
    assert propose([9, 4, 4, 4], 4, 1, 3) == [4, 4, 4, 4]  # "4 4" seen at 1..2, then 4, and it repeats
    assert propose([1, 2, 9, 1, 2], 2, 2, 2) == [9, 1]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request, tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{request.param}-spec"), request.param)
    return build_model(model_config_from_folder(folder), device=torch.device("cpu"), dtype=torch.float32)


PROMPT = [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44, 45, 40, 41, 42]  # repetitive: proposals from the prompt


def greedy_requests(n: int, stops: dict[int, list[int]] = {}) -> list:
    return [(PROMPT[i % 5:] + [60 + i], SamplingParams(max_new_tokens=[40, 23, 17, 31][i % 4], temperature=0.0,
                                                       stop_token_ids=stops.get(i, [])))
            for i in range(n)]


def cut_at(tokens: list[int], stop: int) -> tuple[list[int], str]:
    return (tokens[:tokens.index(stop) + 1], "stop") if stop in tokens else (tokens, "length")


@pytest.mark.parametrize("chain, adaptive, k", [(True, False, 4), (False, False, 4), (True, True, 4), (True, False, 8)])
def test_greedy_output_is_token_identical_with_speculation(model, chain, adaptive, k):
    """16 requests; max_tokens (40, 23, 17, 31) and stop tokens land mid-proposal; 40-token steps make
    later prompts prefill in chunks in the steps where earlier rows verify. Chained verifies (spec.chain) kept
    and voided, or none; proposals as long as each row recently accepted (spec.adaptive); k = 8 (spec.num_tokens:
    the chunks of 9 tokens, steps padded past verify_graphs.EXACT)."""
    n = 16
    plain, _ = serve(model, greedy_requests(n), spec=False, step_tokens=40)
    stops = {i: [plain[i][0][-3]] for i in range(1, n, 2)}  # odd requests stop at their last-but-two token's first use
    want = {i: cut_at(plain[i][0], stops[i][0]) if i in stops else plain[i] for i in range(n)}
    fast, sched = serve(model, greedy_requests(n, stops), spec=True, step_tokens=40, chain=chain, adaptive=adaptive,
                        num_tokens=k)
    assert fast == want
    assert sched.spec.accepted > 0 and sched.spec.verify_rows > 0  # it did speculate, and it paid off
    assert sched.spec.accepted <= sched.spec.proposed
    if not chain:
        assert sched.spec.chained == 0
        return
    assert sched.spec.voided > 0 and sched.spec.void_slots == 0  # void chunks ran, and their slots came back
    if k == 4:  # chained verifies kept too (at k = 8 none of this model's rows keeps 8 proposals and the guess after)
        assert sched.spec.chained > sched.spec.voided


def _rows(kv_slots: int, max_batch: int, vocab_size: int = 2**62, adaptive: bool = False):
    limits = SchedulerLimits(kv_slots=kv_slots, max_running=ROWS, batch_max_tokens=256, chunked_prefill=True,
                             chunked_prefill_size=256, max_wait_tokens=1, token_ratio=0.0, max_model_len=MAX_LEN,
                             eos_ids=(EOS,), spec=SpecConfig(method=SpecMethod.ngram, max_batch=max_batch,
                                                             adaptive=adaptive),
                             vocab_size=vocab_size)
    sched = Scheduler(limits)
    reqs = [Request(AddRequest(str(i), 0, p, sp, 0.0), sp) for i, (p, sp) in enumerate(greedy_requests(4))]
    for row, r in enumerate(reqs):
        r.output_ids = [40]  # "41" follows in every prompt: a proposal exists
        r.row, sched.running[row] = row, r
        r.status, r.num_computed = Status.RUNNING, r.prompt_len
    return sched, reqs


def test_speculation_is_off_above_max_batch():
    sched, reqs = _rows(SLOTS, max_batch=3)
    assert sched.spec.split(sched, reqs) == (reqs, {})  # 4 rows > max_batch 3: no row verifies
    plain, proposals = sched.spec.split(sched, reqs[:3])
    assert plain == [] and sorted(proposals) == [0, 1, 2] and proposals[0][0] == 41


def test_a_row_whose_verify_is_out_sits_out_above_max_batch():
    """Above spec.max_batch nothing proposes, but a row whose verify is still out does not decode either: its
    position and last token are the verdict's, not known yet (a decode planned then would overwrite the KV of
    a token it may keep, and take the slot its rejected tail frees)."""
    from llaunch.runtime.ipc.messages import StepPlan

    sched, reqs = _rows(SLOTS, max_batch=3)
    plain, proposals = sched.spec.split(sched, reqs[:1])
    sched.spec.plan(sched, StepPlan(step=1), proposals)
    reqs[0].steps_in_flight = 1
    assert sched.spec.split(sched, reqs) == (reqs[1:], {})


def test_a_chained_verify_stands_on_the_verdict_it_assumed():
    """While a greedy row's verify is out, its next verify is planned as if the whole proposal and the token the
    lookup predicts after it were kept: it starts with that guess where the first chunk ends. The verdict it
    assumed keeps it; another one voids it: its slots leave the request (freed when it returns), and the row plans
    at once a chunk with its own last token at the position after what it kept (behind the void one on the
    worker: the device does not wait a round trip for the void verdict)."""
    from llaunch.runtime.ipc.messages import StepPlan, StepResult

    def step(sched, r, n):
        plan = StepPlan(step=n)
        sched.spec.plan(sched, plan, sched.spec.split(sched, [r])[1])
        r.steps_in_flight += 1
        return plan.verify[0] if plan.verify else None

    def verdict(sched, r, n, kept):
        deltas = sched.spec.verified(sched, StepResult(step=n, rows=[], token_ids=[], verified=[kept]))
        r.steps_in_flight -= 1
        return deltas

    for agree in (True, False):
        sched, reqs = _rows(SLOTS, max_batch=16)
        r = reqs[0]
        start = r.num_computed
        first = step(sched, r, 1)
        assert first.token_ids == [40, 41, 42, 60, 40] and first.start == start
        chained = step(sched, r, 2)  # after "... 60 40" the prompt goes on "41": the guess, then "42 60 40 41"
        assert chained.token_ids == [41, 42, 60, 40, 41] and chained.start == start + 5
        assert sched.spec.split(sched, [r]) == ([], {})  # one chained verify at a time
        kept = [41, 42, 60, 40, 41] if agree else [41, 42, 7]
        verdict(sched, r, 1, kept)
        assert r.output_ids == [40] + kept
        if agree:
            assert r.num_computed == start + 10 and r.slots == first.slots + chained.slots
            continue
        # void: the chained chunk's slots are off the request; the rejected tail of the first is freed
        assert r.slots == first.slots[:3] and r.num_computed == start + 3 and sched.spec.void_slots == 5
        assert sched.kv.num_used == 3 + 5
        again = step(sched, r, 3)  # its own last token, at the position after the kept ones, the void chunk still out
        assert again.token_ids[0] == 7 and again.start == start + 3 and r.slots == first.slots[:3] + again.slots
        assert again.token_ids == [7]  # nothing follows "7" in the prompt: no proposal, so nothing to chain onto
        assert sched.spec.split(sched, [r]) == ([], {})
        assert verdict(sched, r, 2, [41, 42, 60, 40, 41, 9]) == []  # the void verdict: dropped
        assert sched.spec.void_slots == 0 and sched.kv.num_used == 3 + len(again.slots)
        assert r.output_ids == [40] + kept
        assert sched.spec.chained == 1 and sched.spec.voided == 1


@pytest.mark.parametrize("adaptive", [False, True])
def test_adaptive_proposals_follow_what_the_row_accepted(adaptive):
    """spec.adaptive: a row proposes num_tokens (4) at first, then 1 + its recent accepted tokens per verify (an
    average halved each verify: 4 → 2 → 2 → 1 → 1.5 after verifies that kept 0, 2, 0 and 2 of their proposals).
    Without it, 4 every time."""
    from llaunch.runtime.ipc.messages import StepPlan, StepResult
    from llaunch.runtime.router.spec_decode import propose

    sched, reqs = _rows(SLOTS, max_batch=16, adaptive=adaptive)
    r = reqs[0]
    lengths = []
    for step, accepted in enumerate([0, 2, 0, 2, 0]):
        plan = StepPlan(step=step)
        sched.spec.plan(sched, plan, sched.spec.split(sched, [r])[1])
        proposal = plan.verify[0].token_ids[1:]
        lengths.append(len(proposal))
        # the verdict: `accepted` tokens and the model's own after them, here the copy's next token (the text goes on
        # copying, so every lookup finds 4 tokens: only the row's recent acceptance limits its proposal)
        kept = proposal[:accepted]
        kept += propose(r.prompt_ids + r.output_ids + kept, 1, 1, 3)
        sched.spec.verified(sched, StepResult(step=step, rows=[], token_ids=[], verified=[kept]))
    assert lengths == ([4, 3, 3, 2, 3] if adaptive else [4, 4, 4, 4, 4])


def test_proposals_stop_before_an_image_token():
    """An image's prompt tokens are vocab_size + a hash, with no embedding row: a proposal copying the
    prompt ends before the first of them (a verify step with one would index past the embeddings)."""
    for vocab, want in ((2**62, [41, 42, 60, 40]), (60, [41, 42]), (41, None)):
        sched, reqs = _rows(SLOTS, max_batch=16, vocab_size=vocab)
        assert sched.spec.split(sched, reqs[:1])[1].get(0) == want, vocab


def test_no_speculation_unless_every_peak_fits():
    """Admission's KV estimate assumes a row grows one token a step: a row may speculate only while
    every live request could hold its peak at once, the proposals' slots included."""
    sched, reqs = _rows(SLOTS, max_batch=16)
    need = sum(r.peak_tokens for r in reqs) + sum(len(p) for p in sched.spec.split(sched, reqs)[1].values())
    sched, reqs = _rows(need - 1, max_batch=16)
    assert sched.spec.split(sched, reqs)[1] == {}
    sched, reqs = _rows(need, max_batch=16)
    assert len(sched.spec.split(sched, reqs)[1]) == 4


# ---- rejection sampling --------------------------------------------------------------------------

def _draws(logits, draft, n, **params):
    """`n` verdicts on one proposal, each with its own seed: [n, len(draft) + 1] tokens, -1 padded."""
    full = lambda v, dt=torch.float32: torch.full((n,), v, dtype=dt)  # noqa: E731
    return verify_sampled(logits.expand(n, *logits.shape), torch.tensor(draft).expand(n, len(draft)),
                          full(params.get("temperature", 1.0)), full(params.get("top_p", 1.0)),
                          full(params.get("top_k", -1), torch.int64), torch.arange(n) * 7919 + 13,
                          torch.zeros(n, dtype=torch.int64))


@pytest.mark.parametrize("params", [dict(), dict(temperature=0.7, top_k=4), dict(top_p=0.8)], ids=str)
def test_rejection_sampling_keeps_the_target_distribution(params):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, generator=gen) * 1.5
    draft = [int(torch.argsort(logits[0])[-2]), int(torch.argsort(logits[1])[-1])]  # a likely and a best guess
    target = filtered_probs(logits, torch.tensor(params.get("temperature", 1.0)), torch.tensor(params.get("top_p", 1.0)),
                            torch.tensor(params.get("top_k", -1)))
    n = 20000
    draws = _draws(logits, draft, n, **params)
    first = torch.bincount(draws[:, 0], minlength=8).double() / n
    assert 0.5 * (first - target[0]).abs().sum() < 0.02  # TV distance; its sampling noise is ~0.006
    after = draws[draws[:, 0] == draft[0], 1]  # the second token, where the first proposal was kept
    second = torch.bincount(after, minlength=8).double() / len(after)
    assert len(after) > 2000 and 0.5 * (second - target[1]).abs().sum() < 0.04
    assert (draws[:, 2] >= 0).any()  # both kept: a bonus token drawn from the last position
    # and that distribution is the one decoding without speculation draws from (kernels.sample)
    from llaunch.kernels import reference

    full = lambda v, dt=torch.float32: torch.full((n,), v, dtype=dt)  # noqa: E731
    plain = reference.sample(logits[0].expand(n, 8), full(params.get("temperature", 1.0)), full(params.get("top_p", 1.0)),
                             full(params.get("top_k", -1), torch.int64), torch.arange(n) * 31 + 5,
                             torch.zeros(n, dtype=torch.int64))
    assert 0.5 * (torch.bincount(plain, minlength=8).double() / n - first).abs().sum() < 0.03


def test_greedy_verdict_is_the_agreeing_prefix_and_one_more():
    logits = torch.full((4, 6), -1.0)
    for pos, best in enumerate([3, 1, 4, 5]):
        logits[pos, best] = 1.0
    assert verify_greedy(logits, torch.tensor([3, 1, 2])).tolist() == [3, 1, 4, -1]
    assert verify_greedy(logits, torch.tensor([0, 1, 4])).tolist() == [3, -1, -1, -1]
    assert verify_greedy(logits, torch.tensor([3, 1, 4])).tolist() == [3, 1, 4, 5]


# ---- the benchmark's figures -------------------------------------------------------------------

def test_bench_reads_the_spec_counters_and_builds_copy_prompts():
    bench = _bench_spec()
    text = ('llaunch:spec_decode_num_drafts_total{model_name="m"} 10.0\n'
            'llaunch:spec_decode_num_draft_tokens_total{model_name="m"} 40.0\n'
            'llaunch:spec_decode_num_accepted_tokens_total{model_name="m"} 25.0\n')
    after = bench.spec_counts(text)
    assert after == (10.0, 40.0, 25.0) and bench.spec_counts("llaunch:other_total 1.0\n") is None
    result = bench.spec_result((2.0, 8.0, 5.0), after)
    assert result["spec_acceptance_rate"] == 20 / 32 and result["spec_tokens_per_verify"] == 1 + 20 / 8
    prompts = bench.copy_prompts(3, 10, 500, seed=1)
    assert all(len(p) == 10 and p[:5] == p[5:] for p in prompts) and prompts[0] != prompts[1]


def test_text_copy_prompts_give_a_passage_of_the_corpus_twice_after_a_header_no_other_prompt_shares(tmp_path):
    bench = _bench_spec()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("".join(chr(65 + i % 26) for i in range(300)))
    (tmp_path / "docs" / "b.md").write_text("".join(chr(97 + i % 26) for i in range(170)))
    tokenize = lambda text: [ord(c) for c in text]  # noqa: E731 (a character a token)
    prompts = bench.text_copy_prompts(30, 60, tokenize, seed=3, root=tmp_path)  # 12 + 6 passages of 25 characters
    corpus = [ord(c) for c in (tmp_path / "docs" / "a.md").read_text() + (tmp_path / "docs" / "b.md").read_text()]
    assert all(len(p) == 60 for p in prompts)
    heads, passages = set(), set()
    for p in prompts:
        head, body = p[:p.index(ord("\n")) + 1], p[p.index(ord("\n")) + 1:]
        heads.add(tuple(head[:2]))
        passage = body[:body.index(ord("\n"))]  # the passage, the blank line, then the passage again
        assert len(passage) == 25 and body[len(passage) + 2:] == passage[:len(body) - len(passage) - 2]
        assert any(corpus[j:j + len(passage)] == passage for j in range(len(corpus)))
        passages.add(tuple(passage))
    assert len(heads) >= 28  # prompts share no prefix (two tokens: but by chance), though passages repeat
    assert len(passages) == 18  # every passage of the corpus, in 30 prompts
    assert prompts[:5] != bench.text_copy_prompts(5, 60, tokenize, seed=4, root=tmp_path)


def _bench_spec():
    import importlib.util
    import sys

    from unit.spec_support import REPO

    if str(REPO / "scripts") not in sys.path:  # the script imports its siblings, as `python scripts/...` finds them
        sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location("bench_spec", REPO / "scripts" / "bench_spec.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_a_row_without_proposals_keeps_pipelining_until_its_next_probe():
    from llaunch.runtime.router.spec_decode import PROBE_EVERY

    sched, reqs = _rows(SLOTS, max_batch=16)
    r = reqs[0]
    r.output_ids = [99]  # 99 never occurred before: no proposal
    assert sched.spec.split(sched, [r]) == ([r], {})
    r.steps_in_flight = 1  # its step is out: it is planned again, pipelined, PROBE_EVERY times
    assert [sched.spec.split(sched, [r])[0] for _ in range(PROBE_EVERY + 1)] == [[r]] * PROBE_EVERY + [[]]
    r.steps_in_flight, r.output_ids = 0, [40]  # then it waits for its tokens and looks again: a proposal
    assert sched.spec.split(sched, [r])[1] == {0: [41, 42, 60, 40]}  # after the prompt's last 40
    r.steps_in_flight = 1
    assert sched.spec.split(sched, [r]) == ([], {})  # a row that found one waits for its verdict


def test_a_row_whose_proposals_keep_failing_backs_off_until_its_next_probe():
    """Two verifies that keep nothing (each yields one token for a verify step's cost): the row decodes
    pipelined for PROBE_EVERY steps, then proposes again; one that keeps a token does not back off."""
    from llaunch.runtime.ipc.messages import StepPlan, StepResult
    from llaunch.runtime.router.spec_decode import PROBE_EVERY

    sched, reqs = _rows(SLOTS, max_batch=16)
    r = reqs[0]

    def verify(step: int, kept: list[int]) -> None:
        plan = StepPlan(step=step)
        sched.spec.plan(sched, plan, sched.spec.split(sched, [r])[1])
        assert len(plan.verify) == 1
        sched.spec.verified(sched, StepResult(step=step, rows=[], token_ids=[], verified=[kept]))
        r.output_ids[-len(kept):] = [40]  # back to a last token whose lookup finds a proposal

    verify(1, [41, 42, 7])  # two of four kept: its recent yield (1.0 at first) is 1.5
    verify(2, [7])  # none kept: 0.75, still above the bar
    assert sched.spec.backoffs == 0
    assert sched.spec.accepted_per_pos == [1, 1, 0, 0]  # positions 0 and 1 were accepted once
    verify(3, [7])  # none kept again: 0.375, it backs off
    assert sched.spec.backoffs == 1
    r.steps_in_flight = 1
    assert [sched.spec.split(sched, [r])[0] for _ in range(PROBE_EVERY + 1)] == [[r]] * PROBE_EVERY + [[]]
    r.steps_in_flight = 0
    assert sched.spec.split(sched, [r])[1].get(0)  # its next probe proposes


def test_sampled_rows_verify_through_the_runner(model, request):
    """temperature > 0 through the scheduler and runner: rows verify proposals (rejection sampling,
    test_rejection_sampling_keeps_the_target_distribution), lengths as asked, every KV slot back, and a
    seed repeats its output."""
    if request.node.callspec.params["model"] != "qwen2":
        pytest.skip("the runner's sampled verification does not depend on the family: one covers it")
    requests = [(PROMPT[i:] + [60 + i], SamplingParams(max_new_tokens=30, temperature=0.05, top_p=0.95, seed=i))
                for i in range(2)]
    first, sched = serve(model, requests, spec=True)
    again, _ = serve(model, requests, spec=True)
    assert first == again and all(len(tokens) == 30 for tokens, _ in first.values())
    assert sched.spec.verify_rows > 0


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A draft of another family, depth and seed than either target, with the same tokenizer."""
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-draft"), "llama", seed=7, num_hidden_layers=1)
    return build_model(model_config_from_folder(folder), device=torch.device("cpu"), dtype=torch.float32)


def test_a_draft_model_keeps_greedy_output_token_identical(model, other_draft):
    """spec.method=draft: the same 16 requests as the n-gram case, stops and max_tokens mid-proposal,
    prompts prefilling in chunks beside verifying rows. The model as its own draft proposes exactly
    its next tokens, so nearly every proposal is accepted (the draft's KV follows the model's through
    prefill chunks, decode steps and rejected tails); a different random draft has proposals rejected
    and the output is the same."""
    n = 16
    plain, _ = serve(model, greedy_requests(n), spec=False, step_tokens=40)
    stops = {i: [plain[i][0][-3]] for i in range(1, n, 2)}
    want = {i: cut_at(plain[i][0], stops[i][0]) if i in stops else plain[i] for i in range(n)}
    itself, sched = serve(model, greedy_requests(n, stops), spec=True, step_tokens=40, draft=model)
    assert itself == want
    assert sched.spec.verify_rows > 0 and sched.spec.accepted >= 0.95 * sched.spec.proposed
    other, sched = serve(model, greedy_requests(n, stops), spec=True, step_tokens=40, draft=other_draft)
    assert other == want
    assert sched.spec.verify_rows > 0 and sched.spec.accepted < sched.spec.proposed  # rejected tails rolled back


def test_padded_draft_steps_propose_as_the_unpadded_ones(model, other_draft):
    """The draft's k steps as the GPU replays them (runtime/worker/draft_graphs.py: every chunk k steps in a
    bucket of rows, a chunk with less room and the padding rows on the scratch row and slot): the same output,
    and the same proposals accepted as step by step (which runs only the rows that still propose)."""
    n = 16
    stops = {i: [7 + i] for i in range(1, n, 3)}
    for draft in (model, other_draft):
        plain, sched = serve(model, greedy_requests(n, stops), spec=True, step_tokens=40, draft=draft)
        runners = []
        padded, padded_sched = serve(model, greedy_requests(n, stops), spec=True, step_tokens=40, draft=draft,
                                     padded_draft=True, runners=runners)
        assert padded == plain
        assert runners[0].drafter.steps.runs > 0
        assert runners[0].drafter.kept_on_device > 0  # greedy verify steps read them on the device
        assert (padded_sched.spec.proposed, padded_sched.spec.accepted) == (sched.spec.proposed, sched.spec.accepted)


def test_proposals_drafted_ahead_of_the_plan_are_the_ones_drafted_after_it(model, other_draft):
    """spec.draft_ahead: a greedy step drafts its rows' next proposals behind its verdict, before the router's next
    plan (positions from the verdict on the device, K/V in slots the router never gives out); the next step takes
    them when it continues the same rows. The output and the proposals accepted are those drafted after the plan,
    alone and with 16 rows (stops and max_tokens mid-proposal, prompts prefilling beside verifying rows), and
    no step drafts ahead for rows the next step does not continue but where a row ends."""
    stops = {i: [7 + i] for i in range(1, 16, 3)}
    for n in (1, 16):
        for draft in (model, other_draft):
            after, sched = serve(model, greedy_requests(n, stops), spec=True, step_tokens=40, draft=draft,
                                 padded_draft=True)
            runners = []
            ahead, ahead_sched = serve(model, greedy_requests(n, stops), spec=True, step_tokens=40, draft=draft,
                                       padded_draft=True, draft_ahead=True, runners=runners)
            assert ahead == after
            assert (ahead_sched.spec.proposed, ahead_sched.spec.accepted) == (sched.spec.proposed, sched.spec.accepted)
            drafter = runners[0].drafter
            if n == 1 and draft is model:  # a row alone, its proposals all kept: every verify but the first
                assert drafter.drafted_ahead > 0 and drafter.drafted_ahead == drafter.kept_on_device - 2
            # drafted ahead and not taken: only where a row ended (16 rows alternate steps: none drafted ahead)
            assert drafter.ahead_runs - drafter.drafted_ahead <= n


def test_rows_drafted_ahead_past_the_steps_bound_leave_their_context_alone(model, monkeypatch):
    """The padded steps' longest context (the CUDA graphs' bound, model.graph_max_len_in_batch) may be short of
    the rows': a row whose next positions pass it drafts those steps on the scratch row, never over a position of
    its own context. The model's cache holds noise at the ahead slots, so a table entry left pointing there would
    change the output; rows cross the bound at every phase of their verify (prompts of 8-15 tokens)."""
    from llaunch.runtime.worker.drafter import Drafter

    bound = 32
    pad_steps = Drafter.pad_steps

    def bounded(self, max_len, scratch_row, scratch_slot, capture):
        pad_steps(self, max_len, scratch_row, scratch_slot, capture)
        self.steps.max_len = bound

    monkeypatch.setattr(Drafter, "pad_steps", bounded)
    runners = []
    requests = [(PROMPT[:n] + [60], SamplingParams(max_new_tokens=40, temperature=0.0)) for n in range(8, 16)]
    plain, _ = serve(model, requests, spec=False)
    for request in requests:  # one row at a time: each verify drafts the next ahead
        runners.clear()
        g = torch.Generator().manual_seed(0)

        def noisy(kv):
            first = kv.num_slots - 1 - Drafter.ahead_slots(4, 16)
            for t in kv.k + kv.v:
                t[first:kv.num_slots - 1] = torch.randn(t[first:kv.num_slots - 1].shape, generator=g) * 3

        ahead, _ = serve(model, [request], spec=True, draft=model, padded_draft=True, draft_ahead=True,
                         runners=runners, before_requests=lambda runner: noisy(runner.kv))
        assert ahead[0] == plain[requests.index(request)]
        assert runners[0].drafter.drafted_ahead > 0


def test_sampled_rows_beside_a_padded_draft_verify_its_proposals_read_back(model, other_draft, request):
    """A step with a sampled verifying row reads the draft's proposals back into the chunks (rejection sampling
    needs them on the host); greedy steps keep them on the device. Either way the greedy rows' output is
    spec=none's and a seed repeats its sampled output."""
    if request.node.callspec.params["model"] != "qwen2":
        pytest.skip("the proposals' route does not depend on the family: one covers it")
    greedy = greedy_requests(3)
    sampled = [(PROMPT[1:] + [70], SamplingParams(max_new_tokens=24, temperature=0.05, top_p=0.95, seed=3))]
    plain, _ = serve(model, greedy, spec=False)
    runners = []
    first, sched = serve(model, greedy + sampled, spec=True, draft=model, padded_draft=True, runners=runners)
    again, _ = serve(model, greedy + sampled, spec=True, draft=model, padded_draft=True)
    assert {i: first[i] for i in range(3)} == plain and first == again and len(first[3][0]) == 24
    drafter = runners[0].drafter
    assert sched.spec.verify_rows > 0 and 0 < drafter.kept_on_device < drafter.steps.runs


def test_a_draft_with_fewer_embedding_rows_than_the_model(tmp_path, other_draft):
    """The model's padded vocabulary (as Qwen2-7B's 152,064 rows against Qwen2-0.5B's 151,936): its
    random weights sample ids the draft has no row for, and the draft reads past them unharmed."""
    folder = write_tiny_checkpoint(tmp_path / "padded", "qwen2", seed=5, vocab_size=49152 + 4096)
    padded = build_model(model_config_from_folder(folder), device=torch.device("cpu"), dtype=torch.float32)
    plain, _ = serve(padded, greedy_requests(4), spec=False)
    assert any(t >= 49152 for tokens, _ in plain.values() for t in tokens)  # the case arises
    drafted, sched = serve(padded, greedy_requests(4), spec=True, draft=other_draft)
    assert drafted == plain and sched.spec.verify_rows > 0


def test_the_offline_acceptance_replay_counts_verifies_as_greedy_n_gram_speculation_takes_them():
    import importlib.util
    import sys

    from unit.spec_support import REPO

    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location("spec_acceptance", REPO / "scripts" / "spec_acceptance.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # copying the prompt: 1 (its last token) proposes 2 3, both kept, plus the model's own: 3 tokens a verify
    assert replay.replay(prompt + [1], [2, 3, 4, 5, 6, 7], k=2) == (3.0, 3.0)
    # the model strays after 4: the proposal 5 6 fails at once (1 token), then nothing matches the history
    # (2 steps without a proposal): 2 verifies of 3 + 1 tokens, 4 steps for 6 tokens
    assert replay.replay(prompt + [1], [2, 3, 4, 99, 98, 97], k=2) == (2.0, 6 / 4)
    assert replay.replay([5], [6, 7, 8], k=4) == (1.0, 1.0)  # no proposal: a token a step
    # a greedy draft, teacher-forced: it agrees at 0, 1, then not at 2 (the model's own), then agrees at 3-5: k = 2
    # keeps 0-1 (+2 own), then 3-4 (+5 own): 2 steps for 6 tokens, 3 tokens a verify
    assert replay.replay_draft([True, True, False, True, True, True], k=2) == (3.0, 3.0)
    assert replay.replay_draft([False] * 4, k=4) == (1.0, 1.0)  # a draft that never agrees: a token a verify

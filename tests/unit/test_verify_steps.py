"""Verify steps as decode steps (runtime/worker/verify_graphs.py): a step's verify chunks laid out as
several decode tokens per row give the logits the chunked-prefill route gives (causal attention
within each chunk over the row's cached prefix), padded to a CUDA-graph bucket or not; a CPU runs the
padded step eagerly, as a GPU replays it."""
import pytest
import torch

from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from llaunch.runtime.config import SpecConfig, SpecMethod
from llaunch.runtime.ipc.messages import SamplingParams, StepPlan, VerifyChunk
from llaunch.runtime.models.loader import build_model
from llaunch.runtime.worker.runner import ModelRunner
from llaunch.runtime.worker.sampling_state import SamplingState
from llaunch.runtime.worker.spec_verify import Verifier, greedy_verdict, verify_greedy
from llaunch.runtime.models.memory import spec_step_tokens
from llaunch.runtime.worker.verify_graphs import verify_tokens

ROWS, LEN = 6, 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-verify-steps"), "qwen2")
    return build_model(model_config_from_folder(folder), device=torch.device("cpu"), dtype=torch.float32)


def _runner(model, verify_tokens: int, device=torch.device("cpu"), cuda_graphs: bool = False) -> ModelRunner:
    """Rows 0..3 hold 20, 33, 7, 50 cached tokens of random K/V; each row's last token is known.
    (tests/gpu/test_verify_graphs_gpu.py builds it on a GPU, with graphs.)"""
    kv = model.make_kv_cache(ROWS * LEN + 1, ROWS + 1, LEN)
    runner = ModelRunner(model, kv, ROWS, device, cuda_graphs=cuda_graphs, verify_tokens=verify_tokens)
    gen = torch.Generator().manual_seed(7)
    for layer_k, layer_v in zip(kv.k, kv.v):
        layer_k.copy_(torch.randn(layer_k.shape, generator=gen))
        layer_v.copy_(torch.randn(layer_v.shape, generator=gen))
    for row, cached in enumerate([20, 33, 7, 50]):
        kv.req_to_slots[row, :cached] = torch.arange(row * LEN, row * LEN + cached, dtype=torch.int32)
        runner.seq_len[row] = cached
        runner.last_token[row] = 11 + row
    return runner


def _plan() -> StepPlan:
    """Rows 0 and 2 decode one token; row 1 verifies 4 proposals, row 3 one (a proposal may be short)."""
    slot = lambda row, pos: row * LEN + pos  # noqa: E731
    return StepPlan(step=1, decode_rows=[0, 2], decode_slots=[slot(0, 20), slot(2, 7)],
                    verify=[VerifyChunk(row=1, token_ids=[12, 40, 41, 42, 43], start=33,
                                        slots=[slot(1, p) for p in range(33, 38)]),
                            VerifyChunk(row=3, token_ids=[14, 9], start=50, slots=[slot(3, 50), slot(3, 51)])])


@pytest.mark.parametrize("graph_tokens", [0, 8, 80])  # unpadded; buckets too small (unpadded); padded to 16
def test_verify_step_as_decode_tokens_matches_the_chunked_prefill_route(model, graph_tokens):
    plan = _plan()
    runner = _runner(model, graph_tokens)
    want = model.forward(runner.build_batch(plan)[0], runner.kv)  # decode rows, then verify chunks as chunks
    runner = _runner(model, graph_tokens)
    tokens = verify_tokens(plan, runner.seq_len)
    assert tokens[1] == [0, 2, 1, 1, 1, 1, 1, 3, 3]
    assert tokens[4] == [21, 8, 34, 35, 36, 37, 38, 51, 52]  # token j of a chunk sees start + j + 1 tokens
    assert runner.seq_len[:4] == [21, 33, 8, 50]  # verify rows' lengths follow the verdict, not the step
    assert runner.verify_steps.bucket(9, 52) == (16 if graph_tokens == 80 else None)
    got, verdict = runner.verify_steps.run(tokens)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert verdict.shape == (9,)  # the step's greedy verdict beside its logits (greedy_verdict's test below)


@pytest.mark.parametrize("graph_tokens", [0, 80])  # unpadded; padded to 16
def test_proposals_read_on_the_device_give_the_step_of_the_same_tokens_from_the_host(model, graph_tokens):
    """A draft's proposals left on the device (spec=draft: the host never waits for them before the verify): ids
    below -1 read them, and the step's logits and greedy verdict are those of the same tokens sent from the host."""
    plan = _plan()
    host = _runner(model, graph_tokens)
    want, want_verdict = host.verify_steps.run(verify_tokens(plan, host.seq_len))
    k = 6  # the proposals' width: longer than any chunk's, as spec.num_tokens may be
    proposed = torch.full((3, k), -5, dtype=torch.int64)
    for i, chunk in enumerate(plan.verify):
        proposed[i, :len(chunk.token_ids) - 1] = torch.tensor(chunk.token_ids[1:])
    device = _runner(model, graph_tokens)
    device.verify_steps.proposed = proposed.view(-1)
    tokens = verify_tokens(plan, device.seq_len, proposed=k)
    assert tokens[0] == [-1, -1, 12, -2, -3, -4, -5, 14, -2 - k]  # chunk i's token j >= 1: element i * k + j - 1
    got, verdict = device.verify_steps.run(tokens)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert verdict.tolist() == want_verdict.tolist()
    assert device.last_token.tolist() == host.last_token.tolist()  # the verify rows' last kept tokens


def test_verify_graphs_cover_the_largest_speculating_step():
    spec = SpecConfig(method=SpecMethod.ngram, num_tokens=4, max_batch=16)
    assert spec_step_tokens(spec, max_rows=256) == 80
    assert spec_step_tokens(spec, max_rows=8) == 40  # no more rows than the server runs
    assert spec_step_tokens(SpecConfig(), max_rows=256) == 0
    big = SpecConfig(method=SpecMethod.ngram, num_tokens=16, max_batch=256)
    assert spec_step_tokens(big, max_rows=256) == 512  # larger verify steps run eagerly


def test_a_steps_greedy_verdicts_are_each_chunks_own():
    """Verifier.launch judges a step's greedy chunks in one batch (short chunks padded): each chunk's
    tokens and its row's last token are verify_greedy's for that chunk alone, beside a sampled row."""
    vocab = 50
    sampling = SamplingState(6, vocab, torch.device("cpu"), (), None)
    sampling.set_rows([(2, SamplingParams(max_new_tokens=8, temperature=0.7, seed=3), [1, 2])])
    last_token = torch.zeros(7, dtype=torch.int64)
    logits = torch.randn(14, vocab, generator=torch.Generator().manual_seed(5))
    best = logits.argmax(-1).tolist()
    # row 0 agrees 4 times, row 1 once, row 3 never (3 is never a best token: its logit is lowest)
    logits[:, 3] = -1e9
    chunks = [VerifyChunk(row=0, token_ids=[9] + best[0:4], start=10, slots=[0] * 5),
              VerifyChunk(row=1, token_ids=[9, best[5], 3], start=4, slots=[0] * 3),
              VerifyChunk(row=2, token_ids=[9, best[8]], start=6, slots=[0] * 2),
              VerifyChunk(row=3, token_ids=[9, 3, 3, 3], start=7, slots=[0] * 4)]
    pending = Verifier(sampling, last_token, torch.device("cpu")).launch(logits, chunks)
    got = [[t for t in row if t >= 0] for row in pending.tokens.tolist()]
    starts = [0, 5, 8, 10]
    for i in (0, 1, 3):
        c = chunks[i]
        want = verify_greedy(logits[starts[i]:starts[i] + len(c.token_ids)], torch.tensor(c.token_ids[1:])).tolist()
        assert got[i] == [t for t in want if t >= 0]
        assert last_token[c.row] == got[i][-1]
    assert [len(g) for g in got[:2]] + [len(got[3])] == [5, 2, 1]
    assert 1 <= len(got[2]) <= 2 and last_token[2] == got[2][-1]  # the sampled row: rejection sampling's verdict


def test_a_steps_greedy_verdict_in_fixed_shapes_is_each_chunks_verify_greedy():
    """greedy_verdict (what a verify step's CUDA graph judges) on verify_tokens' layout, decode rows first and
    padding last: each chunk's kept tokens and its row's last token are verify_greedy's for that chunk alone; a
    decode row reads its argmax, its last token left to its sampling."""
    vocab, scratch = 50, 6
    logits = torch.randn(16, vocab, generator=torch.Generator().manual_seed(11))
    logits[:, 3] = -1e9  # 3 is never a best token
    best = logits.argmax(-1).tolist()
    plan = StepPlan(step=1, decode_rows=[4, 5], decode_slots=[0, 0], verify=[
        VerifyChunk(row=0, token_ids=[9] + best[2:6], start=10, slots=[0] * 5),  # all 4 kept
        VerifyChunk(row=1, token_ids=[9, best[7], 3], start=4, slots=[0] * 3),  # 1 of 2 kept
        VerifyChunk(row=2, token_ids=[9, 3, best[10]], start=6, slots=[0] * 3),  # none kept, then a match
        VerifyChunk(row=3, token_ids=[9], start=7, slots=[0])])  # no proposal
    tokens = verify_tokens(plan, [0] * 6)
    n = len(tokens[0])
    pad = 16 - n
    ids = torch.tensor(tokens[0] + [0] * pad)
    rows = torch.tensor(tokens[1] + [scratch] * pad)
    starts = torch.tensor(tokens[5] + list(range(n, 16)))
    last_token = torch.full((scratch + 1,), -7, dtype=torch.int64)
    verdict = greedy_verdict(logits, ids, ids != -1, starts, rows, last_token, scratch).tolist()
    assert verdict[:2] == best[:2] and last_token[4] == last_token[5] == -7  # decode rows: their sampling's
    offset = 2
    for chunk, kept in zip(plan.verify, (5, 2, 1, 1)):
        k = len(chunk.token_ids)
        want = verify_greedy(logits[offset:offset + k], torch.tensor(chunk.token_ids[1:])).tolist()
        assert verdict[offset:offset + k] == want  # kept tokens, then -1
        assert len([t for t in want if t >= 0]) == kept and last_token[chunk.row] == want[kept - 1]
        offset += k

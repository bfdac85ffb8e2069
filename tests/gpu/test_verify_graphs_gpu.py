"""Verify CUDA graphs (runtime/worker/verify_graphs.py) on a GPU: a verify step replayed from its
graph (decode rows and verify chunks as several decode tokens per row, padded to a bucket) gives the
logits of the eager chunked-prefill route for the same step (tests/unit/test_verify_steps.py's case,
float32 on a tiny random Qwen2)."""
from __future__ import annotations

import torch

from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from llaunch.runtime.models.loader import build_model
from llaunch.runtime.worker.spec_verify import greedy_verdict
from llaunch.runtime.worker.verify_graphs import verify_tokens
from unit.test_verify_steps import _plan, _runner


def test_a_replayed_verify_step_matches_the_eager_chunked_prefill_route(tmp_path):
    cuda = torch.device("cuda")
    model = build_model(model_config_from_folder(write_tiny_checkpoint(tmp_path, "qwen2")), device=cuda,
                        dtype=torch.float32)
    plan = _plan()
    eager = _runner(model, 0, cuda)
    want = model.forward(eager.build_batch(plan)[0], eager.kv)
    runner = _runner(model, 80, cuda, cuda_graphs=True)
    assert 16 in runner.verify_steps.graphs  # 9 tokens replay the 16-token graph
    for _ in range(2):  # twice: a replay reads the inputs copied for it, not the capture's
        tokens = verify_tokens(plan, list(runner.seq_len))
        got, verdict = runner.verify_steps.run(tokens)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # the graph's verdict is greedy_verdict's of its own logits (the rows' last tokens alike)
        last_token = runner.last_token.clone()
        ids, rows, starts = (torch.tensor(tokens[i], device=cuda) for i in (0, 1, 5))
        assert torch.equal(verdict, greedy_verdict(got, ids, ids != -1, starts, rows, last_token, runner.max_rows))
        assert torch.equal(last_token, runner.last_token)
    assert runner.verify_steps.replays == 2

"""Mixed steps (decode rows beside prefill chunks, several chunks, a chunk continuing its cached prefix) replayed
from piecewise CUDA graphs give the eager steps' tokens, top logprobs and K/V: the plans of
tests/unit/test_mixed_graphs.py on tiny random checkpoints in float32 on the GPU, a runner with every graph kind
against one without graphs; across families whose pieces differ (Gemma 3's sandwich norms and local rope, Phi-3's
fused projections, a MoE block's fused kernels inside a graph)."""
from __future__ import annotations

import pytest
import torch

from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from unit.test_mixed_graphs import ROWS, SLOTS, plans


def serve(model, graphs: bool):
    from llaunch.runtime.worker.runner import ModelRunner

    kv = model.make_kv_cache(SLOTS + 1, ROWS + 1, 96)
    runner = ModelRunner(model, kv, ROWS, torch.device("cuda"), cuda_graphs=graphs, prefill_graph_tokens=64,
                         mixed_graph_tokens=128 if graphs else 0)
    results = [runner.execute(plan) for plan in plans()]
    return results, kv, runner


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text", "phi3", "qwen3_moe"])
def test_mixed_steps_replayed_piecewise_match_eager(family, tmp_path):
    from llaunch.runtime.models.loader import build_model

    folder = write_tiny_checkpoint(tmp_path / family, family)
    model = build_model(model_config_from_folder(folder), device=torch.device("cuda"), dtype=torch.float32)
    eager, eager_kv, _ = serve(model, graphs=False)
    replayed, kv, runner = serve(model, graphs=True)
    assert runner.mixed_graphs is not None and runner.mixed_graphs.replays == 2  # the two mixed steps
    for a, b in zip(eager, replayed):
        assert (a.rows, a.token_ids, a.top_ids) == (b.rows, b.token_ids, b.top_ids)
        torch.testing.assert_close(torch.tensor(b.top_logprobs), torch.tensor(a.top_logprobs), rtol=1e-4, atol=1e-4)
    used = sorted({s for plan in plans() for c in plan.prefill for s in c.slots} |
                  {s for plan in plans() for s in plan.decode_slots})
    for e, p in zip(eager_kv.k + eager_kv.v, kv.k + kv.v):
        torch.testing.assert_close(p[used], e[used], rtol=1e-4, atol=1e-4)

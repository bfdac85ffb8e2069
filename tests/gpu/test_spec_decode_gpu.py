"""Speculative decoding on the GPU with real weights (SmolLM2-135M-Instruct): n-gram proposals on
copy-heavy chat prompts, served as the worker serves them (decode CUDA graphs for plain steps, verify
CUDA graphs for verify steps: k+1 decode tokens per verifying row, runtime/worker/verify_graphs.py).
Greedy output must be token-identical to decoding without speculation, at 1 and 16 requests at once,
proposals must be accepted, and verify steps must replay graphs.

float32: the verify step (k+1 query tokens per row, GEMM) and the decode step (GEMV) round
differently, and bf16 would flip near-tied argmaxes between the two paths; in float32 the two agree
to ~1e-6, so identity is the exact claim."""
from __future__ import annotations

import pytest
import torch

from fixtures.tiny_models import model_config_from_folder, smollm2_dir
from llaunch.runtime.ipc.messages import SamplingParams
from unit.spec_support import serve

TEXTS = [
    "The old lighthouse stood at the edge of the cliff, its lamp long dark, while gulls circled the rocks below.",
    "To bake bread, mix flour, water, salt and yeast, knead the dough for ten minutes, then let it rise.",
    "The committee met on Tuesday to review the budget, and agreed to fund the new library wing next year.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside the leaves of plants.",
]
NEW_TOKENS = 96


@pytest.fixture(scope="module")
def model():
    from llaunch.runtime.models.loader import build_model

    path = smollm2_dir()
    if not (path / "model.safetensors").is_file():
        pytest.fail(f"{path} missing: scripts/prepare_models.py converts SmolLM2 (gpu_run.sh does on the GPU host)")
    return build_model(model_config_from_folder(path), device=torch.device("cuda"), dtype=torch.float32)


def copy_requests(n: int) -> list:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    for i in range(n):
        text = " ".join(TEXTS[(i + j) % len(TEXTS)] for j in range(2))
        ids = tok.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}],
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        out.append((ids, SamplingParams(max_new_tokens=[NEW_TOKENS, 37, 61, 80][i % 4], temperature=0.0)))
    return out, (eos, tok.eos_token_id)


@pytest.mark.parametrize("n", [1, 16])
def test_ngram_greedy_is_token_identical_on_smollm2(model, n):
    requests, eos = copy_requests(n)
    kw = dict(kv_slots=16 * 512, max_len=512, device=torch.device("cuda"), cuda_graphs=True, eos_ids=eos)
    plain, _ = serve(model, requests, spec=False, **kw)
    runners = []
    fast, sched = serve(model, requests, spec=True, runners=runners, **kw)
    assert fast == plain
    verify = runners[0].verify_steps
    assert verify.graphs and verify.replays > 0, "verify steps ran eagerly: no graph replayed"
    s = sched.spec
    print(f"n={n}: {s.verify_rows} verify row-steps, {s.accepted}/{s.proposed} proposed tokens accepted, "
          f"{1 + s.accepted / max(s.verify_rows, 1):.2f} tokens per verify step")
    assert s.accepted > 0


@pytest.fixture(scope="module")
def model_bf16():
    from llaunch.runtime.models.loader import build_model

    return build_model(model_config_from_folder(smollm2_dir()), device=torch.device("cuda"), dtype=torch.bfloat16)


@pytest.mark.parametrize("k", [4, 8])
def test_bf16_ngram_greedy_is_token_identical_under_row_invariant(model_bf16, kernel_settings, k):
    """bfloat16, one stream: with kernels.row_invariant a verify step's rows are summed as batch-1 decode sums its
    row (each row on the GEMV's one-row code, decode attention split alike), so speculation gives the decode path's
    text. k = 8: a verify of 9 tokens replays the graph padded to 16 (verify_graphs.EXACT is 8), still a small step."""
    kernel_settings(row_invariant=True)
    requests, eos = copy_requests(1)
    kw = dict(kv_slots=16 * 512, max_len=512, device=torch.device("cuda"), cuda_graphs=True, eos_ids=eos)
    plain, _ = serve(model_bf16, requests, spec=False, **kw)
    runners = []
    fast, sched = serve(model_bf16, requests, spec=True, runners=runners, num_tokens=k, **kw)
    assert fast == plain
    assert sched.spec.accepted > 0
    assert runners[0].verify_steps.replays > 0, "verify steps ran eagerly: no graph replayed"


@pytest.mark.parametrize("n", [1, 16])
@pytest.mark.parametrize("ahead", [False, True])
def test_draft_greedy_is_token_identical_on_smollm2(model, n, ahead):
    """spec.method=draft with SmolLM2 drafting for itself (the only real weights on the host): the
    draft's proposing steps replayed from its CUDA graphs and its eager mirror beside the model's graphs keep
    its KV in step, so nearly every proposal holds; with spec.draft_ahead a row alone has its proposals drafted
    behind the verdict before, from positions the graph reads off it."""
    requests, eos = copy_requests(n)
    kw = dict(kv_slots=16 * 512, max_len=512, device=torch.device("cuda"), cuda_graphs=True, eos_ids=eos)
    plain, _ = serve(model, requests, spec=False, **kw)
    runners = []
    fast, sched = serve(model, requests, spec=True, draft=model, runners=runners, draft_ahead=ahead, **kw)
    if ahead and n == 1:
        assert runners[0].drafter.drafted_ahead > 0, "no verify step took proposals drafted ahead"
    assert fast == plain
    steps, mirror = runners[0].drafter.steps, runners[0].draft_mirror
    assert steps.graphs and steps.replays > 0, "the draft proposed eagerly: no graph replayed"
    assert mirror.graphs and mirror.replays > 0, "the draft mirrored every step eagerly: no graph replayed"
    assert runners[0].drafter.kept_on_device > 0, "every verify step waited for the draft's proposals"
    s = sched.spec
    print(f"draft n={n}: {s.accepted}/{s.proposed} proposed tokens accepted")
    assert s.verify_rows > 0 and s.accepted >= 0.9 * s.proposed

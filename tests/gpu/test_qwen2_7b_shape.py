"""llaunch's model path on the GPU against transformers, on the benchmark model's shape (Qwen2-7B,
random bf16 weights, the same tensors in both): a 512-token prefill, 32 teacher-forced decode steps
(eager and replayed from the decode CUDA graphs) and a lone prefill replayed from its graph."""
from __future__ import annotations

import pytest
import torch

from gpu.conftest import profile_shape
from gpu.support import StateDictSource, batch_of, cosine_rows

PROMPT, STEPS = 512, 32
COSINE_MIN = 0.999  # the prefill's logits, every position
# llaunch's decode steps may be as far from transformers' whole-sequence forward as transformers'
# own decode steps are (two bf16 shapes of one model), plus this much
DECODE_SLACK = 1e-3


@pytest.fixture(scope="module")
def models():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from llaunch.runtime.models.arch import ModelArch
    from llaunch.runtime.models.decoder import DecoderLM
    from llaunch.runtime.models.layers import TpGroup
    from llaunch.runtime.models.weights import load_from

    torch.manual_seed(0)
    shape = profile_shape("qwen2-7b")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in shape.items() if k != "model_type"})).eval()
    torch.set_default_dtype(torch.float32)
    ours = DecoderLM(ModelArch.from_hf_config(shape), TpGroup(0, 1, None), torch.device("cuda"), torch.bfloat16,
                     4096).eval()
    load_from(ours, StateDictSource(hf.state_dict()))
    total = PROMPT + STEPS
    ids = torch.randint(0, 150000, (total,), generator=torch.Generator().manual_seed(1)).tolist()
    kv = ours.make_kv_cache(8192, 257, 4096)
    slots = torch.randperm(8000, generator=torch.Generator().manual_seed(2))[:total].tolist()
    kv.req_to_slots[0, :total] = torch.tensor(slots, dtype=torch.int32, device="cuda")
    with torch.inference_mode():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
    return dict(hf=hf, ours=ours, ids=ids, kv=kv, slots=slots, ref=ref)


@pytest.fixture(scope="module")
def eager_decode(models):
    """The prompt prefilled, then llaunch's teacher-forced decode logits [STEPS, vocab], eager."""
    m, n = models, PROMPT
    with torch.inference_mode():
        m["ours"].forward(batch_of(m["ids"][:n], list(range(n)), m["slots"][:n], [], [], prefill=0), m["kv"])
        steps = [m["ours"].forward(batch_of([m["ids"][i]], [i], [m["slots"][i]], [0], [i + 1]), m["kv"])[0]
                 for i in range(n, n + STEPS)]
    return torch.stack(steps)


def test_prefill_logits_match_transformers(models):
    m, n = models, PROMPT
    with torch.inference_mode():
        got = m["ours"].forward(batch_of(m["ids"][:n], list(range(n)), m["slots"][:n], [], [], prefill=0), m["kv"])
    assert cosine_rows(got, m["ref"][:n]).min().item() >= COSINE_MIN


def test_teacher_forced_decode_is_as_close_to_transformers_as_its_own_decode_steps(models, eager_decode):
    m, n = models, PROMPT
    with torch.inference_mode():
        out = m["hf"](torch.tensor([m["ids"][:n]], device="cuda"), use_cache=True)
        past, hf_steps = out.past_key_values, []
        for i in range(n, n + STEPS):
            o = m["hf"](torch.tensor([[m["ids"][i]]], device="cuda"), past_key_values=past, use_cache=True)
            past = o.past_key_values
            hf_steps.append(o.logits[0, -1].float())
    ref = m["ref"][n:n + STEPS]
    floor = cosine_rows(torch.stack(hf_steps), ref).min().item()
    ours = cosine_rows(eager_decode, ref).min().item()
    assert ours >= min(COSINE_MIN, floor) - DECODE_SLACK, (ours, floor)


def test_decode_graph_replay_equals_eager_and_records_the_greedy_token(models, eager_decode):
    from llaunch.runtime.worker.cuda_graphs import DecodeGraphs

    m, n = models, PROMPT
    kv = m["kv"]
    last = torch.zeros(257, dtype=torch.int64, device="cuda")
    scratch = kv.num_slots - 1
    kv.req_to_slots[256].fill_(scratch)
    graphs = DecodeGraphs(m["ours"], kv, last, 256, 4096, scratch_row=256, scratch_slot=scratch)
    graphs.capture()
    replayed, greedy = [], []
    for i in range(n, n + STEPS):
        last[0] = m["ids"][i]
        logits, tokens = graphs.run([0], [i], [m["slots"][i]], [i + 1])
        replayed.append(logits[0].clone())
        greedy.append((tokens[0].item(), logits[0].argmax().item(), last[0].item()))
    assert (torch.stack(replayed) - eager_decode).abs().max().item() <= 1e-2
    assert all(a == b == c for a, b, c in greedy)


@pytest.mark.parametrize("length", [PROMPT, PROMPT - 12], ids=["fills its bucket", "padded to its bucket"])
def test_prefill_graph_replay_equals_the_eager_step(models, length):
    from llaunch.runtime.ipc.messages import PrefillChunk
    from llaunch.runtime.worker.prefill_graphs import PrefillGraphs

    m, kv = models, models["kv"]
    graphs = PrefillGraphs(m["ours"], kv, 1024, scratch_row=256, scratch_slot=kv.num_slots - 1)
    graphs.capture()
    ids, slots = m["ids"][:length], m["slots"][:length]
    with torch.inference_mode():
        kv.req_to_slots[0, :length] = torch.tensor(slots, dtype=kv.req_to_slots.dtype, device="cuda")
        batch = batch_of(ids, list(range(length)), slots, [], [], prefill=0)
        batch.logits_index = batch.logits_index[length - 1:]  # the last token alone, as the graph: same LM head
        eager = m["ours"].forward(batch, kv)[0]
        replayed = graphs.run(PrefillChunk(row=0, token_ids=ids, start=0, slots=slots, sample=True))[0]
    assert replayed.argmax() == eager.argmax()
    if length == PROMPT:  # padded, cuBLAS may tile the rows differently: same token, close logits
        assert (replayed - eager).abs().max().item() <= 1e-2
    else:
        assert cosine_rows(replayed[None], eager[None]).item() >= COSINE_MIN

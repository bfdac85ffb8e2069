"""Teacher-forced top-1 agreement of llaunch's model path with transformers, and of tensor-parallel
llaunch with tp1, on real weights (SmolLM2-135M-Instruct by default).

transformers (bf16, SDPA on a GPU; float32 on CPU) answers 16 chat prompts greedily with 64 tokens.
Then every run feeds those same tokens (teacher forcing): llaunch prefills the 16 prompts in one
step and decodes the 64 tokens as 16-row batches, and the argmax of each position's logits is
compared with transformers' argmax over the full sequence. With --tp 2, two processes (NCCL on
GPUs, gloo on CPU) run the tp2 model and their argmaxes are compared with tp1's.
With --truth, transformers also scores the same tokens in float32: each bf16 run's agreement with
that exact answer is printed, and for every position where llaunch and transformers (bf16) pick
different tokens, the float32 logit gap between the two picks (a near-tie has a gap below bf16's
resolution at that logit's magnitude).
Prints one JSON line per check; exit 1 if one is under --min-agreement.

    python scripts/gpu_agreement.py --model-dir .models/smollm2-135m [--tp 1 2] [--device cuda|cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile

import torch

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "What is 12 times 7?", "Give me a tip for learning to cook.",
    "Who wrote Romeo and Juliet?", "Describe a cat to someone who has never seen one.",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?", "Name a famous painting.",
    "What does a CPU do?", "Suggest a name for a small bakery.", "How many days are in a leap year?",
    "What is the boiling point of water?", "Tell me a fun fact about octopuses.",
]


def float32_logits(model_dir: str, device: str, prompts, conts) -> list[torch.Tensor]:
    """transformers' float32 logits [new_tokens, vocab] at each continuation position (on the CPU)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    with torch.inference_mode():
        for ids, cont in zip(prompts, conts):
            x = torch.tensor([ids + cont], device=device)
            out.append(hf(x).logits[0, len(ids) - 1: len(ids) - 1 + len(cont)].float().cpu())
    return out


def tie_report(truth: list[torch.Tensor], a: list[list[int]], b: list[list[int]]) -> dict:
    """At positions where a and b differ: the float32 logit gap between their picks, and how many of
    those gaps are under one bf16 step (2^-7 of the logit's magnitude)."""
    gaps, ties = [], 0
    for logits, ra, rb in zip(truth, a, b):
        for i, (x, y) in enumerate(zip(ra, rb)):
            if x != y:
                lx, ly = float(logits[i, x]), float(logits[i, y])
                gaps.append(abs(lx - ly))
                ties += abs(lx - ly) <= max(abs(lx), abs(ly)) * 2 ** -7
    gaps.sort()
    return dict(differing=len(gaps), under_one_bf16_step=ties, median_gap=round(gaps[len(gaps) // 2], 4) if gaps else None,
                max_gap=round(gaps[-1], 4) if gaps else None)


def reference(model_dir: str, device: str, dtype: torch.dtype, new_tokens: int):
    """(prompt ids, continuation ids, transformers' teacher-forced argmax per continuation position,
    the same with eager attention instead of SDPA, the first answer's text)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    prompts, conts, tops, eager_tops = [], [], [], []
    eager = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").to(device).eval()
    with torch.inference_mode():
        for text in PROMPTS:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
            x = torch.tensor([ids], device=device)
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=tok.eos_token_id)
            cont = out[0, len(ids):].tolist()
            logits = hf(out).logits[0, len(ids) - 1: len(ids) - 1 + new_tokens]
            prompts.append(ids)
            conts.append(cont)
            tops.append(logits.argmax(-1).tolist())
            eager_logits = eager(out).logits[0, len(ids) - 1: len(ids) - 1 + new_tokens]
            eager_tops.append(eager_logits.argmax(-1).tolist())
    sample = tok.decode(conts[0], skip_special_tokens=True)
    return prompts, conts, tops, eager_tops, sample


def llaunch_argmax(model_dir: str, rank: int, tp: int, device: torch.device, dtype: torch.dtype, prompts,
                   conts, whole: bool = False) -> list[list[int]]:
    """llaunch's argmax per continuation position. Served shape: one prefill step for all prompts, then
    decode steps of all rows fed the given continuation tokens. whole: one prefill step per prompt over
    prompt + continuation, logits at every continuation position, the shape transformers' reference
    forward has (the same matrix shapes, so cuBLAS picks the same algorithms)."""
    from llaunch.runtime.models.arch import ModelArch
    from llaunch.runtime.models.batch import ForwardBatch
    from llaunch.runtime.models.decoder import DecoderLM
    from llaunch.runtime.models.layers import TpGroup
    from llaunch.runtime.models.weights import SafetensorsSource, load_from

    with open(os.path.join(model_dir, "config.json")) as f:
        arch = ModelArch.from_hf_config(json.load(f))
    model = DecoderLM(arch, TpGroup(rank, tp, None), device, dtype, 4096).eval()
    source = SafetensorsSource(model_dir)
    load_from(model, source)
    source.close()
    n, span = len(prompts), 1024
    kv = model.make_kv_cache(n * span + 1, n + 1, span)
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    for r in range(n):
        kv.req_to_slots[r] = torch.arange(r * span, (r + 1) * span, dtype=torch.int32, device=device)
    ids, pos, slots, starts, lens, last = [], [], [], [], [], []
    for r, p in enumerate(prompts):
        starts.append(len(ids))
        ids += p
        pos += range(len(p))
        slots += range(r * span, r * span + len(p))
        lens.append(len(p))
        last.append(len(ids) - 1)
    if whole:
        return [_whole_argmax(model, kv, r, span, p, c, t) for r, (p, c) in enumerate(zip(prompts, conts))]
    rows = list(range(n))
    batch = ForwardBatch(t(ids), t(pos), t(slots), t([]), t([]), t(rows), t(starts), t(lens), t([0] * n), t(last),
                         0, len(ids), max(lens), 0)
    with torch.inference_mode():
        top = [model.forward(batch, kv).argmax(-1).tolist()]
        for step in range(len(conts[0]) - 1):
            cur = [len(p) + step for p in prompts]
            batch = ForwardBatch(t([c[step] for c in conts]), t(cur), t([r * span + c for r, c in enumerate(cur)]),
                                 t(rows), t([c + 1 for c in cur]), t([]), t([]), t([]), t([]), t(rows), n, 0, 0,
                                 max(cur) + 1)
            top.append(model.forward(batch, kv).argmax(-1).tolist())
    return [list(col) for col in zip(*top)]  # per prompt


def _whole_argmax(model, kv, row: int, span: int, prompt: list[int], cont: list[int], t) -> list[int]:
    from llaunch.runtime.models.batch import ForwardBatch

    ids, first_slot = prompt + cont, row * span
    n = len(ids)
    logits_at = list(range(len(prompt) - 1, len(prompt) - 1 + len(cont)))
    batch = ForwardBatch(t(ids), t(range(n)), t(range(first_slot, first_slot + n)), t([]), t([]),
                         t([row]), t([0]), t([n]), t([0]), t(logits_at), 0, n, n, 0)
    with torch.inference_mode():
        return model.forward(batch, kv).argmax(-1).tolist()


def _rank_main(rank: int, tp: int, port: int, device_type: str, dtype: torch.dtype, model_dir: str, data: dict,
               out_path: str, whole: bool) -> None:
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=tp)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    top = llaunch_argmax(model_dir, rank, tp, device, dtype, data["prompts"], data["conts"], whole)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(top, f)
    dist.barrier()
    dist.destroy_process_group()


def run_tp(tp: int, device_type: str, dtype: torch.dtype, model_dir: str, prompts, conts,
           whole: bool = False) -> list[list[int]]:
    if tp == 1:
        device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
        return llaunch_argmax(model_dir, 0, 1, device, dtype, prompts, conts, whole)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        mp.spawn(_rank_main, args=(tp, port, device_type, dtype, model_dir, {"prompts": prompts, "conts": conts}, f.name, whole),
                 nprocs=tp)
        with open(f.name) as g:
            return json.load(g)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=".models/smollm2-135m")
    ap.add_argument("--tp", type=int, nargs="+", default=[1])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--min-agreement", type=float, default=0.99)
    ap.add_argument("--truth", action="store_true", help="also compare every run with transformers in float32")
    ap.add_argument("--whole", action="store_true",
                    help="also run llaunch tp1 as one prefill per prompt over prompt + continuation (the reference's shape)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    prompts, conts, hf_top, eager_top, sample = reference(args.model_dir, args.device, dtype, args.new_tokens)
    print(json.dumps(dict(check="transformers eager attention vs SDPA (the noise floor)", dtype=str(dtype),
                          agreement=round(agreement(eager_top, hf_top), 4))))
    ok, tops = True, {}
    for tp in args.tp:
        tops[tp] = run_tp(tp, args.device, dtype, args.model_dir, prompts, conts)
        checks = [("transformers", agreement(tops[tp], hf_top))]
        if tp != 1 and 1 in tops:
            checks.append(("tp1", agreement(tops[tp], tops[1])))
        for other, value in checks:
            passed = value >= args.min_agreement
            ok &= passed
            print(json.dumps(dict(check=f"teacher-forced top-1, llaunch tp{tp} vs {other}", model=args.model_dir,
                                  device=args.device, dtype=str(dtype), positions=sum(map(len, conts)), agreement=round(value, 4),
                                  min_agreement=args.min_agreement, **{"pass": passed})))
    if args.whole:
        tops["1-whole"] = run_tp(1, args.device, dtype, args.model_dir, prompts, conts, whole=True)
        print(json.dumps(dict(check="teacher-forced top-1, llaunch tp1 one prefill per prompt (the reference's shape) "
                                    "vs transformers", model=args.model_dir, device=args.device, dtype=str(dtype),
                              positions=sum(map(len, conts)), agreement=round(agreement(tops["1-whole"], hf_top), 4))))
        if 1 in tops:
            print(json.dumps(dict(check="teacher-forced top-1, llaunch tp1 one prefill per prompt vs served shape",
                                  agreement=round(agreement(tops["1-whole"], tops[1]), 4))))
    if args.truth:
        truth = float32_logits(args.model_dir, args.device, prompts, conts)
        truth_top = [t.argmax(-1).tolist() for t in truth]
        runs = {f"transformers {dtype} SDPA": hf_top, f"transformers {dtype} eager": eager_top,
                **{f"llaunch tp{tp} {dtype}": top for tp, top in tops.items()}}
        for name, top in runs.items():
            print(json.dumps(dict(check=f"teacher-forced top-1, {name} vs transformers float32",
                                  agreement=round(agreement(top, truth_top), 4))))
        for tp, top in tops.items():
            print(json.dumps(dict(check=f"float32 logit gap where llaunch tp{tp} and transformers {dtype} differ",
                                  **tie_report(truth, top, hf_top))))
        print(json.dumps(dict(check=f"float32 logit gap where transformers {dtype} eager and SDPA differ",
                              **tie_report(truth, eager_top, hf_top))))
    print(json.dumps(dict(check="transformers' answer to the first prompt", prompt=PROMPTS[0], answer=sample)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

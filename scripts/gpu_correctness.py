"""GPU correctness of llaunch's model path against transformers, on a Qwen2-7B-shaped model with
random bf16 weights (the same tensors in both): per-position cosine similarity of the logits for a
512-token prompt (prefill attention) and for 32 teacher-forced decode steps (decode attention,
eager and replayed from a CUDA graph). Prints one JSON line per check; exit 1 if a check fails.

    python scripts/gpu_correctness.py [--layers N]
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

import torch

from llaunch.kernels import dispatch, pdl
from llaunch.runtime.models.arch import ModelArch
from llaunch.runtime.models.batch import ForwardBatch
from llaunch.runtime.models.decoder import DecoderLM
from llaunch.runtime.models.layers import TpGroup
from llaunch.runtime.worker.cuda_graphs import DecodeGraphs
from llaunch.runtime.models.weights import _slice, load_from

QWEN2_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                rms_norm_eps=1e-6, tie_word_embeddings=False)
COSINE_MIN = 0.999


class StateDictSource:
    """Checkpoint tensors straight from a transformers model (no files)."""

    def __init__(self, state):
        self.state = state

    def has(self, name):
        return name in self.state

    def read(self, shard):
        return _slice(self.state[shard.name], shard)

    def close(self):
        pass


def cosine_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def batch_of(ids, positions, slots, rows, lens, prefill=None, device="cuda") -> ForwardBatch:
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    if prefill is None:
        return ForwardBatch(t(ids), t(positions), t(slots), t(rows), t(lens), t([]), t([]), t([]), t([]),
                            t(list(range(len(ids)))), len(ids), 0, 0, max(lens))
    n = len(ids)
    return ForwardBatch(t(ids), t(positions), t(slots), t([]), t([]), t([prefill]), t([0]), t([n]), t([0]),
                        t(list(range(n))), 0, n, n, 0)


def decode_args(kv, b: int, context: int):
    """graphs.run arguments for a decode step of `b` rows over `context` cached tokens each."""
    rows = list(range(b))
    base = 8192  # slots past the correctness check's
    for r in rows:
        kv.req_to_slots[r, :context] = torch.arange(base + r * context, base + (r + 1) * context,
                                                    dtype=torch.int32, device="cuda")
    return rows, [context - 1] * b, [base + r * context + context - 1 for r in rows], [context] * b


def time_decode_steps(graphs: DecodeGraphs, kv, context: int = 1024, batches=(1, 64, 256)) -> list[dict]:
    """Device time of one decode step (graph replay only, no sampling or host work) at batch sizes
    1, 64 and 256 over `context` cached tokens each: the floor the engine's TPOT is compared with."""
    out = []
    for b in batches:
        args = decode_args(kv, b, context)
        for _ in range(3):
            graphs.run(*args)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graphs.run(*args)
        end.record()
        torch.cuda.synchronize()
        out.append(dict(check=f"decode step device time, batch {b}, context {context}",
                        ms=start.elapsed_time(end) / 50))
    return out


def time_variants(model, kv, last, scratch, variants: dict, batches, rounds: int = 2) -> list[dict]:
    """Decode-step device time per variant, `rounds` times alternated (the spread between rounds is
    the noise). A variant changes some switches from the process's settings: `pdl` and `late` (the
    kernel sets of LLAUNCH_PDL_KERNELS and LLAUNCH_PDL_LATE), `qkv_rotary` (LLAUNCH_QKV_ROTARY), `shapes`
    (LLAUNCH_GEMV_SHAPES), `attn_pre_wait` (LLAUNCH_ATTN_PRE_WAIT), `attn_shape` (decode attention's
    stage-1 launch shape function), `lm_head_f32` (the staged LM head's float32 logits),
    `greedy_kernel` (kernels/greedy.py's argmax), `x_ahead` (LLAUNCH_GEMV_X_AHEAD). Each is captured as the server does, every bucket
    up to max(batches)."""
    from llaunch.kernels import gemv

    attention = importlib.import_module("llaunch.kernels.decode_attention")  # the package binds the op's name
    attributes = {"shapes": (gemv, "_OVERRIDES"), "qkv_rotary": (dispatch, "_FUSED_QKV_ROTARY"),
                  "attn_pre_wait": (attention, "PRE_WAIT"), "attn_shape": (attention, "_launch_shape"),
                  "lm_head_f32": (dispatch, "_LM_HEAD_FLOAT32"), "greedy_kernel": (dispatch, "_GREEDY_KERNEL"),
                  "x_ahead": (gemv, "_X_AHEAD")}
    out = []
    for _ in range(rounds):
        for name, changes in variants.items():
            saved = {key: getattr(*where) for key, where in attributes.items()}
            for key, (module, attr) in attributes.items():
                setattr(module, attr, changes.get(key, saved[key]))
            kernels_before = pdl.set_kernels(changes.get("pdl", pdl._kernels))
            late_before = pdl.set_late(changes.get("late", pdl._late))
            graphs = DecodeGraphs(model, kv, last, max(batches), 4096, scratch_row=256, scratch_slot=scratch)
            graphs.capture()
            for c in time_decode_steps(graphs, kv, batches=batches):
                out.append(dict(c, check=c["check"] + f", {name}"))
            del graphs
            pdl.set_kernels(kernels_before), pdl.set_late(late_before)
            for key, (module, attr) in attributes.items():
                setattr(module, attr, saved[key])
    return out


def step_ab(model, kv, last, scratch) -> list[dict]:
    """The batch-1 step with each switch on and off and PDL on subsets of the kernels that have it."""
    from llaunch.kernels import gemv

    attention = ("gemv", "rmsnorm", "decode_attention")
    other_qkv = ("qkv GEMV then rotary kernel (LLAUNCH_QKV_ROTARY=0)" if dispatch._FUSED_QKV_ROTARY
                 else "qkv GEMV and rotary in one kernel (LLAUNCH_QKV_ROTARY=1)")
    variants = {
        f"default ({'fused' if dispatch._FUSED_QKV_ROTARY else 'unfused'} qkv+rotary, PDL on "
        f"{'+'.join(sorted(pdl._kernels))}, late: {'+'.join(sorted(pdl._late)) or '-'})": {},
        **{f"GEMVs request x's next tile with the weights' (LLAUNCH_GEMV_X_AHEAD={v})": dict(x_ahead=v)
           for v in ("all", "ungated", "0") if v != gemv._X_AHEAD},
        other_qkv: dict(qkv_rotary=not dispatch._FUSED_QKV_ROTARY),
        "decode attention tiles of 128 tokens (64 by default for split contexts)":
            dict(attn_shape=lambda q, dim, splits: (128, 4, 2)),
        "decode attention waits before its early exit (LLAUNCH_ATTN_PRE_WAIT=0)": dict(attn_pre_wait=False),
        "LM head writes bf16 logits, a cast kernel makes them float32": dict(lm_head_f32=False),
        "greedy tokens by torch.argmax and an index write": dict(greedy_kernel=False),
        "LM head on cuBLAS": dict(shapes={**gemv._OVERRIDES, (QWEN2_7B["vocab_size"], QWEN2_7B["hidden_size"], False):
                                          (2, 1024, 4, 0)}),
        "no PDL": dict(pdl=()),
        "PDL on gemv+rmsnorm (the 11c98d0 default)": dict(pdl=("gemv", "rmsnorm"), late=()),
        "PDL on gemv+rmsnorm+decode_attention, attention late": dict(pdl=attention, late=("decode_attention",)),
    }
    if gemv._OVERRIDES:
        variants["built-in launch shapes (LLAUNCH_GEMV_SHAPES ignored)"] = dict(shapes={})
    return time_variants(model, kv, last, scratch, variants, batches=(1,))


def pdl_ab_wide(model, kv, last, scratch) -> list[dict]:
    """The default PDL kernel set against the GEMVs and norms only, and the greedy kernel against
    torch.argmax, at batch sizes where decode attention reads most of the bytes."""
    variants = {"default PDL set": {},
                "PDL on gemv+rmsnorm (the 11c98d0 default)": dict(pdl=("gemv", "rmsnorm"), late=()),
                "greedy tokens by torch.argmax and an index write": dict(greedy_kernel=False)}
    return time_variants(model, kv, last, scratch, variants, batches=(64, 256))


def time_prefill(model, kv, ids, slots) -> list[dict]:
    """Device time of an eager prefill step (no graph), back to back and from an idle device. (Its
    linear layers measured the same on cuBLAS and cuBLASLt, and with and without PDL on the eager
    launches: docs/benchmarks.md.)"""
    n = len(ids)
    batch = batch_of(ids, list(range(n)), slots, [], [], prefill=0)
    with torch.inference_mode():
        for _ in range(3):
            model.forward(batch, kv)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            model.forward(batch, kv)
        end.record()
        torch.cuda.synchronize()
    out = [dict(check=f"prefill step, {n} tokens, eager, back to back", ms=start.elapsed_time(end) / 20)]
    return out + latency_from_idle(f"prefill step, {n} tokens, eager", lambda: model.forward(batch, kv))


def latency_from_idle(what: str, run, rounds: int = 5) -> list[dict]:
    """`run()` from an idle device, as a new request meets it: the host's time to enqueue it, the
    device's time, and the wall time to its result (medians). Back-to-back timing hides the host's
    share; a host slower than the device shows as enqueue ≈ wall."""
    host, device, wall = [], [], []
    with torch.inference_mode():
        for _ in range(rounds):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            run()
            host.append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            wall.append(time.perf_counter() - t0)
            device.append(start.elapsed_time(end) / 1e3)
    med = lambda v: 1000 * sorted(v)[len(v) // 2]  # noqa: E731
    return [dict(check=f"{what}, one from idle: {part}", ms=med(v))
            for part, v in (("host enqueue", host), ("device", device), ("wall", wall))]


def prefill_graph_checks(model, kv, ids, slots, scratch: int) -> list[dict]:
    """A lone prefill replayed from its CUDA graph as the server does (runtime/worker/prefill_graphs.py):
    the last token's logits against the eager step's, for a prompt that fills its bucket and one
    padded to it, and the replay's latency from idle, as the eager step's is timed above."""
    from llaunch.runtime.ipc.messages import PrefillChunk
    from llaunch.runtime.worker.prefill_graphs import PrefillGraphs

    t0 = time.perf_counter()
    graphs = PrefillGraphs(model, kv, 1024, scratch_row=256, scratch_slot=scratch)
    graphs.capture()
    out = [dict(check=f"prefill graphs: capture of {len(graphs.buckets)} buckets",
                ms=1000 * (time.perf_counter() - t0))]
    with torch.inference_mode():
        for n in (len(ids), len(ids) - 12):
            # the runner's eager path records the chunk's slots first (the decode timings rewrote row 0's)
            kv.req_to_slots[0, :n] = torch.tensor(slots[:n], dtype=kv.req_to_slots.dtype, device="cuda")
            batch = batch_of(ids[:n], list(range(n)), slots[:n], [], [], prefill=0)
            batch.logits_index = batch.logits_index[n - 1:]  # the last token alone, as the graph: same LM head
            eager = model.forward(batch, kv)[0]
            replayed = graphs.run(PrefillChunk(row=0, token_ids=ids[:n], start=0, slots=slots[:n], sample=True))[0]
            bucket = next(b for b in graphs.buckets if b >= n)
            check = dict(check=f"prefill CUDA graph vs eager, {n} tokens (bucket {bucket}), last token's logits",
                         max_abs_diff=(replayed - eager).abs().max().item(),
                         cosine=cosine_rows(replayed[None], eager[None]).item(),
                         same_argmax=bool(replayed.argmax() == eager.argmax()))
            if n != len(ids):  # cuBLAS may tile 500 rows and 512 differently: a measurement, not a check
                check["measurement"] = True
            out.append(check)
    chunk = PrefillChunk(row=0, token_ids=list(ids), start=0, slots=list(slots), sample=True)
    return out + latency_from_idle(f"prefill graph, {len(ids)} tokens", lambda: graphs.run(chunk))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--fp32-reference", action="store_true", help="also compare both bf16 runs with float32")
    ap.add_argument("--profile", action="store_true", help="print the decode step's and the prefill's kernel time by kernel")
    ap.add_argument("--smoke", action="store_true", help="a small shape on CPU in float32 (checks the script)")
    args = ap.parse_args()
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(QWEN2_7B, num_hidden_layers=args.layers)
    if args.smoke:
        shape.update(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                     vocab_size=160000)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        hf = Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
    torch.set_default_dtype(torch.float32)
    arch = ModelArch.from_hf_config(dict(shape, model_type="qwen2"))
    ours = DecoderLM(arch, TpGroup(0, 1, None), torch.device(device), dtype, 4096).eval()
    load_from(ours, StateDictSource(hf.state_dict()))

    total = args.prompt_len + args.decode_steps
    ids = torch.randint(0, 150000, (total,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids], device=device)).logits[0].float()
    kv = ours.make_kv_cache(8192 * 40, 257, 4096)
    slots = torch.randperm(8000, generator=torch.Generator().manual_seed(2))[:total].tolist()
    kv.req_to_slots[0, :total] = torch.tensor(slots, dtype=torch.int32, device=device)
    checks, ok = [], True

    with torch.inference_mode():
        n = args.prompt_len
        got = ours.forward(batch_of(ids[:n], list(range(n)), slots[:n], [], [], prefill=0, device=device), kv)
        cos = cosine_rows(got, ref[:n])
        checks.append(dict(check="prefill 512 tokens vs transformers", min_cosine=cos.min().item(),
                           top1_agreement=(got.argmax(-1) == ref[:n].argmax(-1)).float().mean().item()))
        decode_logits = []
        for i in range(n, total):
            step = batch_of([ids[i]], [i], [slots[i]], [0], [i + 1], device=device)
            decode_logits.append(ours.forward(step, kv)[0])
        got = torch.stack(decode_logits)
        cos = cosine_rows(got, ref[n:total])
        checks.append(dict(check="teacher-forced decode vs transformers", min_cosine=cos.min().item(),
                           top1_agreement=(got.argmax(-1) == ref[n:total].argmax(-1)).float().mean().item()))
        # transformers' own decode steps (KV cache, one token each) against its whole-sequence forward:
        # how far two bf16 shapes of the same model are apart, the floor for the check above
        past = hf(torch.tensor([ids[:n]], device=device), use_cache=True).past_key_values
        hf_steps = []
        for i in range(n, total):
            o = hf(torch.tensor([[ids[i]]], device=device), past_key_values=past, use_cache=True)
            past = o.past_key_values
            hf_steps.append(o.logits[0, -1].float())
        hf_steps = torch.stack(hf_steps)
        for name, a, b in (("transformers decode steps vs its whole-sequence forward", hf_steps, ref[n:total]),
                           ("teacher-forced decode vs transformers decode steps", got, hf_steps)):
            c = cosine_rows(a, b)
            checks.append(dict(check=name, min_cosine=c.min().item(), mean_cosine=c.mean().item(),
                               top1_agreement=(a.argmax(-1) == b.argmax(-1)).float().mean().item(), measurement=True))
        if args.fp32_reference:
            # Which bf16 run is closer to the exact answer? transformers in float32 on the same weights.
            ours_prefill = ours.forward(batch_of(ids[:n], list(range(n)), slots[:n], [], [], prefill=0,
                                                 device=device), kv)
            ref32 = hf.float()(torch.tensor([ids[:n]], device=device)).logits[0].float()
            for name, logits in (("llaunch bf16", ours_prefill), ("transformers bf16", ref[:n])):
                c = cosine_rows(logits, ref32)
                checks.append(dict(check=f"{name} prefill vs transformers float32", min_cosine=c.min().item(),
                                   mean_cosine=c.mean().item(), measurement=True))
            hf.to(torch.bfloat16)
    if device == "cuda":
        # the same decode steps replayed from a CUDA graph (positions rewritten: same slots, same K/V)
        last = torch.zeros(257, dtype=torch.int64, device="cuda")
        scratch = kv.num_slots - 1
        kv.req_to_slots[256].fill_(scratch)
        graphs = DecodeGraphs(ours, kv, last, 256, 4096, scratch_row=256, scratch_slot=scratch)
        graphs.capture()
        replayed, greedy_ok = [], True
        for i in range(n, total):
            last[0] = ids[i]
            logits, tokens = graphs.run([0], [i], [slots[i]], [i + 1])
            replayed.append(logits[0].clone())
            greedy_ok = greedy_ok and tokens[0].item() == logits[0].argmax().item() == last[0].item()
        diff = (torch.stack(replayed) - got).abs().max().item()
        checks.append(dict(check="decode CUDA graph replay vs eager", max_abs_diff=diff))
        checks.append(dict(check="decode graph's greedy token = argmax of its logits, recorded as the last token",
                           max_abs_diff=0.0 if greedy_ok else 1.0))
        checks += time_decode_steps(graphs, kv)
        checks += time_decode_steps(graphs, kv, context=640, batches=(1,))  # mid-way through the single case
        checks += prefill_graph_checks(ours, kv, ids[:n], slots[:n], scratch)
        if torch.cuda.get_device_capability()[0] >= 9:
            checks += step_ab(ours, kv, last, scratch)
            checks += pdl_ab_wide(ours, kv, last, scratch)
            checks += time_prefill(ours, kv, ids[:n], slots[:n])
        if args.profile:
            import gpu_profile  # imports this module's step builders: only when asked for

            gpu_profile.profile_decode_step(graphs, kv)
            gpu_profile.profile_prefill(ours, kv, ids[:n], slots[:n])
    for c in checks:
        if c.pop("measurement", False):
            c["pass"] = True
        elif "min_cosine" in c:
            c["pass"] = c["min_cosine"] >= COSINE_MIN
        elif "ms" in c:
            c["pass"] = True  # a measurement
        else:
            c["pass"] = c["max_abs_diff"] <= 1e-2
        ok &= c["pass"]
        print(json.dumps(c))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

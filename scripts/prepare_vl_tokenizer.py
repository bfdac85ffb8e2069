"""Write .models/qwen2-vl-tokenizer: the Qwen2 tokenizer (.models/qwen2-tokenizer) with Qwen2-VL's special
tokens at their real ids and a chat template that renders image parts as Qwen2-VL's does (what
model=qwen2-vl-7b with dummy weights tokenizes with). No network."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.tiny_vl import write_vl_tokenizer  # noqa: E402

if __name__ == "__main__":
    out = REPO / ".models" / "qwen2-vl-tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    write_vl_tokenizer(out)
    print(out)

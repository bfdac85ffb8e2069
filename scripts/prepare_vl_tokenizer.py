"""Write .models/qwen2-vl-tokenizer and .models/qwen2-audio-tokenizer: the Qwen2 tokenizer
(.models/qwen2-tokenizer) with Qwen2-VL's / Qwen2-Audio's special tokens at their real ids and a chat
template that renders image / audio parts as those models' do (what model=qwen2-vl-7b and
model=qwen2-audio-7b with dummy weights tokenize with). No network."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.tiny_audio import AUDIO_TOKENS, CHAT_TEMPLATE as AUDIO_TEMPLATE  # noqa: E402
from tests.fixtures.tiny_vl import write_vl_tokenizer  # noqa: E402

if __name__ == "__main__":
    for name, args in (("qwen2-vl-tokenizer", ()), ("qwen2-audio-tokenizer", (AUDIO_TOKENS, AUDIO_TEMPLATE))):
        out = REPO / ".models" / name
        out.mkdir(parents=True, exist_ok=True)
        write_vl_tokenizer(out, *args)
        print(out)

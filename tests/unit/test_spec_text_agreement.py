"""scripts/spec_text_agreement.py: a spec server's greedy texts against spec=none's on the same prompts (#38's
bfloat16 criterion), from the result files bench_serving.py --keep-text writes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "spec_text_agreement.py"


def _result(path: Path, seed: int, texts: list) -> None:
    requests = [{"success": t is not None, "generated_text": t or ""} for t in texts]
    path.write_text(json.dumps({"args": {"seed": seed}, "requests": requests}))


def _run(out: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_counts_identical_texts_and_where_the_others_part(tmp_path):
    _result(tmp_path / "bench-none-c1-1.json", 24, ["the cat sat", "on the mat", "a failed one"])
    _result(tmp_path / "bench-spec-c1-1.json", 24, ["the cat sat", "on the hat", None])
    _result(tmp_path / "bench-none-c1-2.json", 1024, ["one", "two"])
    _result(tmp_path / "bench-spec-c1-2.json", 1024, ["one", "twice"])
    line = _run(tmp_path, "--variants", "none", "spec", "--repeats", "2")
    assert line == "c1 spec: 2 of 4 greedy texts as spec=none's; the others part after 2-7 characters"


def test_other_prompts_or_no_texts_are_said_not_counted(tmp_path):
    _result(tmp_path / "bench-none-c1-1.json", 24, ["a"])
    _result(tmp_path / "bench-spec-c1-1.json", 25, ["a"])
    assert "sent other prompts" in _run(tmp_path, "--repeats", "1")
    (tmp_path / "bench-spec-c1-1.json").unlink()
    assert "no texts to compare" in _run(tmp_path, "--repeats", "1")


def test_a_row_invariant_server_is_held_against_none_ri(tmp_path):
    """NAME_ri (kernels.row_invariant=true) against none_ri's texts, not none's: the decode path of a server like it."""
    _result(tmp_path / "bench-none-c1-1.json", 24, ["x", "y"])
    _result(tmp_path / "bench-none_ri-c1-1.json", 24, ["the cat sat", "on the mat"])
    _result(tmp_path / "bench-spec_ri-c1-1.json", 24, ["the cat sat", "on the mat"])
    line = _run(tmp_path, "--variants", "none", "none_ri", "spec_ri", "--repeats", "1")
    assert line == "c1 spec_ri: 2 of 2 greedy texts as none_ri's"


def test_runs_whose_prompts_hit_the_prefix_cache_otherwise_are_not_compared(tmp_path):
    """A cached prefix changes how a prompt is prefilled (bfloat16 may then part anywhere after it): texts of runs
    whose prefix-cache hits differ are not counted either way."""
    for name, hits in (("none", 42.0), ("k8", 22.0)):
        record = {"args": {"seed": 24}, "requests": [{"success": True, "generated_text": "a"}],
                  "prefix_cache_hits": hits}
        (tmp_path / f"bench-{name}-c1-1.json").write_text(json.dumps(record))
    line = _run(tmp_path, "--variants", "k8", "--repeats", "1")
    assert line == ("c1 k8: run 1 not comparable with none's: its prompts hit the prefix cache for 22.0 tokens "
                    "against 42.0 (prefilled otherwise; run both servers through the same cases)")

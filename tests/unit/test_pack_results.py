"""A device call's results come back as one archive (the device tool returns 8 files of $OUT): every file is in
it, a benchmark result too large to carry keeps the scalar figures the summaries read, and an archive over the
limit leaves the largest files out and says which."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import tarfile
from pathlib import Path

PACK = Path(__file__).resolve().parents[2] / "scripts" / "pack_results.py"


def _members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive, "r:xz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_every_file_comes_back_and_a_large_result_keeps_its_figures(tmp_path):
    work = tmp_path / "spec"
    (work / "bf16kv").mkdir(parents=True)
    (work / "console.log").write_text("c256 8339.9\n")
    big = {"output_throughput": 6957.4, "median_tpot_ms": 28.7, "date": "2026-12-05",
           "requests": [{"itl": [0.01] * 64} for _ in range(4096)]}
    (work / "bf16kv" / "bench-c256-1.json").write_text(json.dumps(big))
    small = {"output_throughput": 1461.7, "requests": [{"itl": [0.5]}]}
    (work / "bench-none-c1-1.json").write_text(json.dumps(small))
    for i in range(12):  # more files than the device tool brings back
        (work / f"bench-k8-c64-{i}.json").write_text(json.dumps(small))
    subprocess.run([sys.executable, str(PACK), str(work), str(tmp_path / "results.tar.xz")], check=True)
    got = _members(tmp_path / "results.tar.xz")
    assert len(got) == 15 and got["spec/console.log"] == b"c256 8339.9\n"
    packed = json.loads(got["spec/bf16kv/bench-c256-1.json"])
    assert packed["output_throughput"] == 6957.4 and packed["median_tpot_ms"] == 28.7 and "requests" not in packed
    assert json.loads(got["spec/bench-none-c1-1.json"]) == small  # small enough: as it was


def test_an_archive_over_the_limit_leaves_the_largest_files_out_and_names_them(tmp_path):
    work = tmp_path / "kv8"
    work.mkdir()
    rng = random.Random(0)
    (work / "noise.bin").write_bytes(rng.randbytes(3 << 20))  # incompressible, past a 2 MiB limit
    (work / "console.log").write_text("done\n")
    subprocess.run([sys.executable, str(PACK), str(work), str(tmp_path / "r.tar.xz"), "--limit-mib", "2"], check=True)
    got = _members(tmp_path / "r.tar.xz")
    assert set(got) == {"kv8/console.log", "kv8/LEFT_OUT.txt"}
    assert got["kv8/LEFT_OUT.txt"].decode().startswith("noise.bin (3145728 bytes)")
    assert (tmp_path / "r.tar.xz").stat().st_size < 2 << 20

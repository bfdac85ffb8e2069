"""Pack a device call's results into one archive that the device tool brings back.

    python3 scripts/pack_results.py WORK ARCHIVE [--limit-mib 15]

The device tool returns at most 8 files of 16 MiB from $OUT (/work/.library/device/README.md): a call that
leaves its servers' benchmark files there loses all but 8 of them, and the console's tail alone keeps the last
12,000 characters. So a call writes everything under WORK and this packs WORK into one .tar.xz: each file as it
is, but a benchmark result (.json) over 1 MiB keeps only its scalar fields (the per-request lists are most of
its bytes, and every figure the summaries read is a scalar); if the archive is still over the limit, the
largest files are left out, and named in the archive's LEFT_OUT.txt.

Here: `tar xJf /work/.device/N/results.tar.xz -C DIR`.
"""
from __future__ import annotations

import argparse
import io
import json
import lzma
import sys
import tarfile
from pathlib import Path

BIG_JSON = 1 << 20


def content(path: Path) -> bytes:
    """The bytes the archive holds for `path`: a large JSON object reduced to its scalar fields."""
    data = path.read_bytes()
    if path.suffix != ".json" or len(data) <= BIG_JSON:
        return data
    try:
        obj = json.loads(data)
    except ValueError:
        return data
    if not isinstance(obj, dict):
        return data
    kept = {k: v for k, v in obj.items() if not isinstance(v, (list, dict))}
    kept["packed"] = f"scalar fields only (of {len(data)} bytes; scripts/pack_results.py)"
    return json.dumps(kept, indent=1).encode()


def pack(work: Path, files: list[tuple[str, bytes]], left_out: list[str]) -> bytes:
    buf = io.BytesIO()
    with lzma.open(buf, "wb", preset=6) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for name, data in files + ([("LEFT_OUT.txt", "\n".join(left_out).encode() + b"\n")] if left_out else []):
            info = tarfile.TarInfo(f"{work.name}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("archive", type=Path)
    ap.add_argument("--limit-mib", type=float, default=15.0)
    args = ap.parse_args()
    files = [(str(p.relative_to(args.work)), content(p)) for p in sorted(args.work.rglob("*")) if p.is_file()]
    left_out: list[str] = []
    archive = pack(args.work, files, left_out)
    while len(archive) > args.limit_mib * 2**20 and files:
        biggest = max(files, key=lambda f: len(f[1]))
        files.remove(biggest)
        left_out.append(f"{biggest[0]} ({len(biggest[1])} bytes)")
        archive = pack(args.work, files, left_out)
    args.archive.write_bytes(archive)
    print(f"packed {len(files)} files into {args.archive} ({len(archive) / 2**20:.1f} MiB)"
          + (f"; left out: {', '.join(left_out)}" if left_out else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cut a llama-family GGUF to fewer decoder blocks (and optionally store its token embedding in a
smaller quantization), so real weights fit in one GPU call's carry: SmolLM2-135M's Q4_1 GGUF is 98 MB,
a call carries 64 MiB with the wheelhouse. The kept blocks are renumbered 0..n-1 and block_count is
rewritten; every other tensor, the tokenizer and the chat template are copied unchanged. The result is
still real weights: the GPU tests compare llaunch against transformers on the same (cut) checkpoint.

    python scripts/cut_gguf.py IN.gguf OUT.gguf --blocks 0-5,27-29 [--embedding Q4_1]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def parse_blocks(spec: str, total: int) -> list[int]:
    """'0-5,27-29' → [0, 1, 2, 3, 4, 5, 27, 28, 29]; ascending, each once, all below `total`."""
    blocks: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        blocks.extend(range(int(lo), int(hi or lo) + 1))
    if sorted(set(blocks)) != blocks or not blocks or blocks[-1] >= total:
        raise SystemExit(f"--blocks {spec}: need ascending block indexes below {total}, each once")
    return blocks


def _field_value(field):
    """A reader field as the writer's add_key_value wants it (scalars, strings, arrays of either)."""
    import gguf

    kind = field.types[0]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    if kind == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    return field.parts[-1].tolist()[0]


def cut(src: str, dst: str, blocks: list[int], embedding: str | None) -> str:
    import gguf

    reader = gguf.GGUFReader(src)
    arch = _field_value(reader.fields["general.architecture"])
    total = _field_value(reader.fields[f"{arch}.block_count"])
    if blocks[-1] >= total:
        raise SystemExit(f"{src} has {total} blocks")
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        value = _field_value(field)
        if name == f"{arch}.block_count":
            value = len(blocks)
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, kind, sub_type=sub)
    renumber = {old: new for new, old in enumerate(blocks)}
    for t in reader.tensors:
        name = t.name
        if name.startswith("blk."):
            index = int(name.split(".")[1])
            if index not in renumber:
                continue
            name = f"blk.{renumber[index]}." + name.split(".", 2)[2]
        data, qtype = t.data, t.tensor_type
        if name == "token_embd.weight" and embedding:
            target = gguf.GGMLQuantizationType[embedding]
            if target != qtype:
                rows = gguf.quants.dequantize(data, qtype).astype(np.float32)
                data, qtype = gguf.quants.quantize(rows, target), target
        # the reader's shape is GGML's (fastest dimension first); the writer takes the numpy shape of
        # the raw bytes and, for quantized data, the type to infer the element shape from
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return f"cut_gguf: {src} → {dst}: blocks {blocks} of {total}" + (f", token_embd {embedding}" if embedding else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--blocks", required=True, help="blocks to keep, e.g. 0-5,27-29")
    ap.add_argument("--embedding", help="store token_embd in this GGML type (Q8_0, Q5_0, Q4_1, ...)")
    args = ap.parse_args(argv)
    import gguf

    fields = gguf.GGUFReader(args.src).fields
    total = _field_value(fields[f"{_field_value(fields['general.architecture'])}.block_count"])
    print(cut(args.src, args.dst, parse_blocks(args.blocks, total), args.embedding))
    return 0


if __name__ == "__main__":
    sys.exit(main())

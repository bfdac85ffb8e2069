"""Weight loaders: fill a model's parameters from a Hugging Face safetensors folder, a GGUF file, or
seeded random (dummy) weights. Each rank reads only its shards: the model says which slices it needs
(`checkpoint_layout()` → `Shard`s); a source returns exactly those slices.
"""
from __future__ import annotations

import glob
import json
import os
import zlib
from contextlib import ExitStack
from dataclasses import replace
from typing import Callable, Optional, Protocol

import numpy as np
import torch

from llaunch.runtime.config import ModelConfig
from llaunch.runtime.models.checkpoint import find_gguf, model_tensor_names, per_expert_names, read_checkpoint

# Dummy weights of models up to this size are drawn as full tensors on CPU and then sliced, so any
# tp size sees the same model (tests compare tp2 with tp1); larger ones draw each shard on the device.
DUMMY_FULL_TENSOR_MAX_PARAMS = 1_000_000_000
DUMMY_STD = 0.02  # transformers' initializer_range: keeps activations of random models sane


class TensorSource(Protocol):
    def has(self, name: str) -> bool: ...

    def read(self, shard) -> torch.Tensor:
        """The slice `shard` of a checkpoint tensor, on CPU or the model's device, any float dtype."""


def _slice(t, shard):
    if shard.dim is None:
        return t[:]
    index = [slice(None)] * len(shard.full_shape)
    index[shard.dim] = slice(shard.start, shard.start + shard.size)
    return t[tuple(index)]


def _check_shape(name: str, found, expected) -> None:
    if tuple(found) != tuple(expected):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(found)}, the model config expects "
                         f"{tuple(expected)}: config.json and the weights disagree")


class SafetensorsSource:
    """A Hugging Face folder: *.safetensors, sharded per model.safetensors.index.json or not, in any layout
    transformers has written; read by the names llaunch's modules use (checkpoint.model_tensor_names)."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        self._folder = folder
        self._files = ExitStack()
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.safetensors")))
            weight_map = None
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        handles = {f: self._files.enter_context(safe_open(os.path.join(folder, f), framework="pt")) for f in files}
        if weight_map is None:
            weight_map = {name: f for f, h in handles.items() for name in h.keys()}
        self._file = {name: handles[f] for name, f in weight_map.items()}  # checkpoint name → its file
        self._names = model_tensor_names(weight_map)  # our name → checkpoint name

    def has(self, name: str) -> bool:
        return name in self._names or self._expert_parts(name, 0) is not None

    def _expert_parts(self, stacked: str, expert: int) -> Optional[list[str]]:
        """Our names of the per-expert tensors that hold `expert`'s part of the stacked tensor `stacked`, in the
        spelling this checkpoint uses; None when it has none."""
        return next((parts for parts in per_expert_names(stacked, expert) if parts[0] in self._names), None)

    def _read_stacked(self, shard) -> torch.Tensor:
        """A slice of a stacked experts tensor [E, R, C] from a checkpoint holding one tensor per expert and part
        (the parts stacked along R), reading only the rows and columns the slice needs."""
        experts, rows, cols = (range(n) for n in shard.full_shape)
        picked = [experts, rows, cols]
        if shard.dim is not None:
            picked[shard.dim] = range(shard.start, shard.start + shard.size)
        experts, rows, cols = picked
        stacked = []
        for e in experts:
            parts = self._expert_parts(shard.name, e)
            if parts is None:
                self._tensor(per_expert_names(shard.name, e)[0][0])  # raises, naming the tensor
            part_rows = shard.full_shape[1] // len(parts)
            pieces = []
            for p, name in enumerate(parts):
                lo, hi = max(rows.start, p * part_rows), min(rows.stop, (p + 1) * part_rows)
                if lo < hi:
                    real, file = self._tensor(name)
                    tensor = file.get_slice(real)
                    _check_shape(real, tensor.get_shape(), (part_rows, shard.full_shape[2]))
                    pieces.append(tensor[lo - p * part_rows: hi - p * part_rows, cols.start: cols.stop])
            stacked.append(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
        return torch.stack(stacked)

    def _tensor(self, name: str) -> tuple[str, object]:
        """(the checkpoint's name for our `name`, its file)."""
        if name not in self._names:
            tops = sorted({n.split(".")[0] for n in self._file})
            raise KeyError(f"checkpoint {self._folder} has no tensor {name} in any layout transformers has "
                           f"written (its {len(self._file)} tensors' names begin with {', '.join(tops)})")
        real = self._names[name]
        return real, self._file[real]

    def read(self, shard) -> torch.Tensor:
        if shard.name not in self._names and self._expert_parts(shard.name, 0) is not None:
            return self._read_stacked(shard)
        real, file = self._tensor(shard.name)
        tensor = file.get_slice(real)
        _check_shape(real, tensor.get_shape(), shard.full_shape)
        return _slice(tensor, shard)

    def read_whole(self, name: str) -> torch.Tensor:
        """A whole tensor of any shape (0-d included): the small scales of an fp8 checkpoint."""
        real, file = self._tensor(name)
        return file.get_tensor(real)

    def close(self) -> None:
        self._files.close()


# Hugging Face parameter names → llama.cpp's GGUF tensor names (the part after "model.layers.N.").
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
_GGUF_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_tensor_name(hf_name: str) -> str:
    module, kind = hf_name.rsplit(".", 1)
    if module in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[module]}.{kind}"
    parts = module.split(".")  # model.layers.N.<sub>.<proj>
    if parts[:2] != ["model", "layers"] or ".".join(parts[3:]) not in _GGUF_LAYER_NAMES:
        raise KeyError(f"no GGUF name for {hf_name}")
    return f"blk.{parts[2]}.{_GGUF_LAYER_NAMES['.'.join(parts[3:])]}.{kind}"


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf q/k row permutation (interleaved → rotate-half order)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GgufSource:
    """A GGUF file (llama or qwen2 architecture). Tensors are dequantized whole, then sliced: GGUF
    models are small, and quantization blocks do not align with shard boundaries."""

    def __init__(self, path: str):
        import gguf

        path = find_gguf(path)
        meta = read_checkpoint(path)
        self._gguf = gguf
        self._tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
        self._arch = meta.family
        self._heads, self._kv_heads = meta.arch["num_attention_heads"], meta.arch["num_key_value_heads"]

    def has(self, name: str) -> bool:
        return gguf_tensor_name(name) in self._tensors

    def read(self, shard) -> torch.Tensor:
        name = gguf_tensor_name(shard.name)
        if name not in self._tensors:
            raise KeyError(f"GGUF has no tensor {name} (for {shard.name})")
        t = self._tensors[name]
        w = self._gguf.quants.dequantize(t.data, t.tensor_type)
        _check_shape(name, w.shape, shard.full_shape)
        if self._arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = _unpermute_rows(w, self._heads if ".attn_q." in name else self._kv_heads)
        return torch.from_numpy(np.array(_slice(w, shard)))  # a copy: the file is memory-mapped read-only

    def close(self) -> None:
        pass


class DummySource:
    """Seeded random weights: N(0, 0.02) for matrices and biases, ones for norms. Full-tensor mode
    draws each whole checkpoint tensor on CPU from a generator seeded by (seed, name) and slices it
    (identical model at every tp size); shard mode draws only the slice, on the device, seeded by
    (seed, name, slice), for models too large to draw whole."""

    def __init__(self, seed: int, device: torch.device, full_tensors: bool):
        self.seed, self.device, self.full_tensors = seed, torch.device(device), full_tensors

    def has(self, name: str) -> bool:
        return True

    def read(self, shard) -> torch.Tensor:
        if shard.name.endswith("norm.weight"):  # identity norms (Gemma's store w of 1 + w: zeros)
            return torch.full(shard.shape, 1.0 - shard.plus, device=self.device)
        key = f"{shard.name}" if self.full_tensors else f"{shard.name}:{shard.dim}:{shard.start}:{shard.size}"
        device = torch.device("cpu") if self.full_tensors else self.device
        gen = torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + zlib.crc32(key.encode()))
        shape = shard.full_shape if self.full_tensors else shard.shape
        t = torch.randn(shape, generator=gen, device=device) * DUMMY_STD
        return _slice(t, shard) if self.full_tensors else t

    def close(self) -> None:
        pass


def resolve_load_format(cfg: ModelConfig) -> str:
    fmt = getattr(cfg.load_format, "value", cfg.load_format)
    if fmt != "auto":
        return fmt
    if cfg.path is None:
        return "dummy"
    if cfg.path.endswith(".gguf") or (not glob.glob(os.path.join(cfg.path, "*.safetensors"))
                                      and glob.glob(os.path.join(cfg.path, "*.gguf"))):
        return "gguf"
    return "safetensors"


def open_source(cfg: ModelConfig, device: torch.device, num_params: int) -> TensorSource:
    fmt = resolve_load_format(cfg)
    if fmt == "dummy":
        return DummySource(cfg.seed, device, full_tensors=num_params <= DUMMY_FULL_TENSOR_MAX_PARAMS)
    if cfg.path is None:
        raise ValueError(f"model.load_format={fmt} needs model.path")
    return GgufSource(cfg.path) if fmt == "gguf" else SafetensorsSource(cfg.path)


def load_checkpoint_module(module: torch.nn.Module, cfg: ModelConfig, device: torch.device, num_params: int) -> torch.nn.Module:
    """Fill a module that lays out its own tensors (a vision or audio tower) from the model's
    checkpoint (or dummy weights); returned in eval mode."""
    source = open_source(cfg, device, num_params)
    try:
        load_from(module, source)
    finally:
        source.close()
    return module.eval()


def load_from(model: torch.nn.Module, source: TensorSource, progress: Optional[Callable[[float], None]] = None) -> None:
    """Fill every parameter of `model` (a DecoderLM) with its shards from `source`; `progress` gets the
    share of the parameters' bytes loaded after each one."""
    params = dict(model.named_parameters())
    total, done = sum(p.numel() for p in params.values()) or 1, 0
    for pname, shards in model.checkpoint_layout().items():
        param = params[pname]
        if any(s.name == "lm_head.weight" for s in shards) and not source.has("lm_head.weight"):
            shards = [replace(s, name="model.embed_tokens.weight") for s in shards]  # untied config, tied file
        parts = [torch.zeros(s.shape, dtype=param.dtype, device=param.device) if s.padding
                 else source.read(s).float() + s.plus if s.plus else source.read(s) for s in shards]
        cat_dim = 1 if shards[0].dim == 1 else 0
        t = parts[0] if len(parts) == 1 else torch.cat([p.to(param.device, param.dtype) for p in parts], dim=cat_dim)
        with torch.no_grad():
            if tuple(t.shape) == tuple(param.shape):
                param.copy_(t)
            elif t.shape[1:] == param.shape[1:] and t.shape[0] < param.shape[0]:  # last vocab block
                param[: t.shape[0]].copy_(t)
                param[t.shape[0]:].zero_()
            else:
                raise ValueError(f"{pname}: shards give {tuple(t.shape)}, parameter is {tuple(param.shape)}")
        done += param.numel()
        if progress is not None:
            progress(done / total)


def load_weights(model: torch.nn.Module, cfg: ModelConfig, progress: Optional[Callable[[float], None]] = None) -> None:
    """Load `model`'s weights as `cfg.load_format` says (dummy | safetensors | gguf | auto)."""
    source = open_source(cfg, model.device, model.arch.num_params)
    try:
        load_from(model, source, progress)
    finally:
        source.close()


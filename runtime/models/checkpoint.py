"""What a checkpoint says about itself: one reader for config.json (+ generation_config.json) and one
for GGUF metadata, used by the launcher's planner (derived values, rules) and by the worker (the
architecture of a checkpoint it loads); and one map from the tensor names of every layout transformers
has written to the names llaunch's modules read. No torch: the launcher imports this.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable, Optional

from llaunch.runtime.config import DType
from llaunch.runtime.models import rope
from llaunch.runtime.models.audio_config import audio_fields
from llaunch.runtime.models.decoder_variants import (VARIANT_FIELDS, default_rope_theta, split_rope_parameters,
                                                     variant_fields, with_family_defaults)
from llaunch.runtime.models.moe_config import MOE_FIELDS, moe_fields
from llaunch.runtime.models.vision_config import multimodal_fields
from llaunch.runtime.models.quant_scheme import WeightQuant, checkpoint_weight_quant

# The architecture fields, in ModelConfig's (and config.json's) names.
ARCH_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
    "rope_scaling", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "num_labels",
    "mrope_section", "vision", "audio", "sliding_window", *MOE_FIELDS, *VARIANT_FIELDS,
)
# config.json architectures whose head scores a sequence instead of predicting tokens (model.task=score)
SCORE_HEADS = ("ForSequenceClassification", "RewardModel")  # RewardModel: also *ForProcessRewardModel (refused)
REWARD_HEADS = ("ForRewardModel",)  # a two-layer MLP head (Qwen2.5-Math-RM's remote code), one output
# Spellings of config.json's dtype (and LightLLM's --data_type) that we can run.
DTYPE_NAMES = {
    "float16": DType.float16, "fp16": DType.float16, "half": DType.float16,
    "bfloat16": DType.bfloat16, "bf16": DType.bfloat16,
    "float32": DType.float32, "fp32": DType.float32, "float": DType.float32,
}


class CheckpointError(ValueError):
    """model.path exists but cannot be read as a checkpoint."""


# Where transformers has put each part of a served model: a checkpoint name's prefix → the name llaunch's
# modules read, which is transformers 4.x's layout of Llama, Qwen2 and Qwen2-VL/2.5-VL (model., lm_head.,
# visual.) with Qwen2-Audio's towers (audio_tower., multi_modal_projector.). The first prefix that matches
# wins, so the longer come first. Which version writes which: tests/unit/test_checkpoint_layouts.py.
TENSOR_PREFIXES = (
    ("language_model.model.model.", "model."),  # Qwen2-Audio saved by transformers 5.10-5.20 (renamed twice on save)
    ("language_model.model.", "model."),  # Qwen2-Audio saved by 4.x, 5.0, 5.24: a Qwen2ForCausalLM inside
    ("language_model.lm_head.", "lm_head."),  # Qwen2-Audio, every version
    # transformers' own module names since 4.52, written where save_pretrained's renaming back was skipped
    # (Trainer/DeepSpeed saves of Qwen2-VL/2.5-VL); the names transformers 5 loads into without renaming
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
    ("model.audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("language_model.", "model."),  # Qwen2VLModel (no LM head) saved alone by 5.x
    # LlamaModel / Qwen2Model (no LM head) saved alone: without the base_model_prefix
    ("embed_tokens.", "model.embed_tokens."),
    ("layers.", "model.layers."),
    ("norm.", "model.norm."),
)


# Mixtral's MoE block as transformers 4.x (and 5.x's save_pretrained) names it; transformers 5 calls it mlp, as Qwen's
MIXTRAL_BLOCK = (".block_sparse_moe.", ".mlp.")


def model_tensor_name(name: str) -> str:
    """The name llaunch's modules read the checkpoint tensor `name` by, whichever layout it was saved in."""
    name = name.replace(*MIXTRAL_BLOCK)
    for prefix, ours in TENSOR_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name


# The experts of an MoE layer: llaunch reads transformers 5's stacked tensors, <layer>.mlp.experts.gate_up_proj
# [E, 2I, H] (each expert's gate rows, then its up rows) and <layer>.mlp.experts.down_proj [E, H, I], which 5.x writes
# with save_pretrained(save_original_format=False) (and offloaded saves). 4.x, and 5.x by default, write one tensor per
# expert and projection: the loader stacks those. Per stacked tensor, its parts along dim 1 in each spelling.
EXPERT_PARTS = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),  # Qwen2-MoE / Qwen3-MoE, Mixtral
    "down_proj": (("down_proj",), ("w2",)),
}


def per_expert_names(stacked: str, expert: int) -> list[list[str]]:
    """The per-expert tensors holding expert `expert`'s part of the stacked tensor `stacked` (in our names), one list
    per spelling transformers has used, parts in the order they stack along dim 1; [] when `stacked` is no such name."""
    module, _, kind = stacked.rpartition(".")
    if not module.endswith(".experts") or kind not in EXPERT_PARTS:
        return []
    return [[f"{module}.{expert}.{part}.weight" for part in spelling] for spelling in EXPERT_PARTS[kind]]


def model_tensor_names(names: Iterable[str]) -> dict[str, str]:
    """{name llaunch's modules read: name in the checkpoint} for a checkpoint's tensor names."""
    out: dict[str, str] = {}
    for name in names:
        ours = model_tensor_name(name)
        if ours in out:
            raise CheckpointError(f"checkpoint tensors {out[ours]} and {name} are both {ours} "
                                  "(two layouts mixed in one checkpoint)")
        out[ours] = name
    return out


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint says about itself, in ModelConfig's field names."""

    family: Optional[str]  # config.json model_type / GGUF general.architecture
    arch: dict[str, Any] = field(default_factory=dict)
    dtype: Optional[str] = None  # as written (torch_dtype / dtype); None for GGUF
    eos_token_ids: list[int] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)  # features it uses that llaunch does not run
    sampling: dict[str, float] = field(default_factory=dict)  # generation_config.json's sampling defaults
    architectures: list[str] = field(default_factory=list)  # config.json's (empty for GGUF)
    labels: list[str] = field(default_factory=list)  # a score head's output names (id2label, in index order)
    pad_token_id: Optional[int] = None
    weight_quant: Optional[WeightQuant] = None  # config.json's quantization_config, parsed; None: not quantized

    @property
    def score_head(self) -> Optional[str]:
        """The architecture whose head scores sequences (Qwen2ForSequenceClassification, ...), or None."""
        return next((a for a in self.architectures if a.endswith(SCORE_HEADS)), None)

    @property
    def score_mlp(self) -> bool:
        """The score head is Qwen2ForRewardModel's MLP rather than a Linear."""
        return bool(self.score_head and self.score_head.endswith(REWARD_HEADS))


# The sampling values of generation_config.json a request inherits when it does not set them (as vLLM's
# --generation-config auto): the model's authors chose them for its chat use.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def is_gguf(path: Optional[str]) -> bool:
    return bool(path) and path.lower().endswith(".gguf")


def find_gguf(path: str) -> str:
    """`path` if it is a .gguf file, else the one .gguf file in the folder `path`."""
    if is_gguf(path):
        return path
    found = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(found) != 1:
        raise FileNotFoundError(f"expected one .gguf file in {path}, found {len(found)}")
    return found[0]


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise CheckpointError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e


def parse_hf_config(c: dict[str, Any], generation: Optional[dict[str, Any]] = None) -> Checkpoint:
    """A config.json dict (transformers 4.x `rope_theta`/`rope_scaling`/`torch_dtype` or 5.x
    `rope_parameters`/`dtype`), with generation_config.json's dict when there is one."""
    weight_quant = checkpoint_weight_quant(c)
    top, c = c, c.get("text_config", c)  # multimodal wrappers keep the language model's config inside
    family = c.get("model_type")
    if top.get("model_type") == "gemma3" and c is not top:  # Gemma3ForConditionalGeneration: its text model served
        family = c.get("model_type", "gemma3_text")
    vision = multimodal_fields(top)  # Qwen2-VL: its vision tower and image token ids (runtime/models/vision_config.py)
    if vision is not None:
        family = top["model_type"]
    c = with_family_defaults(family, c)
    # transformers 5 folds rope_theta/scaling in rope_parameters (Gemma 3's per layer type)
    rope_parameters, rope_local_base_freq, unsupported = split_rope_parameters(family, c)
    rope_scaling = c.get("rope_scaling")
    if rope_scaling is None:
        rope_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    mrope_section = (rope_scaling or rope_parameters).get("mrope_section") if vision is not None else None
    partial_rotary = c.get("partial_rotary_factor", (rope_scaling or rope_parameters).get("partial_rotary_factor", 1.0))
    if family == "phi3" and (rope_scaling or {}).get("type", (rope_scaling or {}).get("rope_type")) == "yarn":
        rope_scaling = {**rope_scaling, "rope_type": "longrope"}  # as Phi3Config reads it ("su" and "yarn")
        rope_scaling.pop("type", None)
    rope_scaling = rope.normalize(rope_scaling, c)  # None: plain RoPE
    heads = c.get("num_attention_heads")
    head_dim = c.get("head_dim")
    if head_dim is None and family == "qwen3":
        head_dim = 128  # Qwen3Config's default: not hidden_size / heads (Qwen3MoeConfig has none: hidden / heads)
    if family == "qwen2_moe":  # q/k/v bias as qkv_bias says (Qwen2MoeConfig's default: true), never on o
        attention_bias = c.get("qkv_bias", True)
    elif family == "phi3":  # transformers' Phi-3 has no attention bias, whatever config.json's attention_bias says
        attention_bias = False
    else:
        attention_bias = True if family in ("qwen2", "qwen2_vl", "qwen2_5_vl") else c.get("attention_bias", False)
    arch = {
        "hidden_size": c.get("hidden_size"),
        "intermediate_size": c.get("intermediate_size"),
        "num_hidden_layers": c.get("num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": c.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "vocab_size": c.get("vocab_size"),
        "max_position_embeddings": c.get("max_position_embeddings"),
        "rope_theta": c.get("rope_theta", rope_parameters.get("rope_theta", default_rope_theta(family))),
        "rope_local_base_freq": rope_local_base_freq,
        "rope_scaling": rope_scaling or None,
        "rms_norm_eps": c.get("rms_norm_eps"),
        "tie_word_embeddings": c.get("tie_word_embeddings", top.get("tie_word_embeddings", False)),  # Llama/Qwen2 default
        "attention_bias": attention_bias,
        "mrope_section": list(mrope_section) if mrope_section else None,
        "vision": vision,
        "audio": audio_fields(top),  # Qwen2-Audio: its audio encoder and audio token id (runtime/models/audio_config.py)
        **moe_fields(family, c),  # Qwen2-MoE, Qwen3-MoE, Mixtral (runtime/models/moe_config.py)
    }
    # sliding windows, Gemma's scale, caps and GeGLU, Phi-3's partial rotary (runtime/models/decoder_variants.py)
    variants, not_served = variant_fields(family, c, partial_rotary)
    arch.update(variants)
    unsupported += not_served
    eos = _eos_list(c.get("eos_token_id", top.get("eos_token_id")))
    if generation:  # generate() stops at these too: take the union
        eos += [t for t in _eos_list(generation.get("eos_token_id")) if t not in eos]
    dtype = c.get("torch_dtype", c.get("dtype", top.get("torch_dtype", top.get("dtype"))))
    unsupported += [f"{key}=true" for key in ("mlp_bias", "use_sliding_window") if c.get(key)]
    sampling = {k: float(generation[k]) for k in SAMPLING_KEYS
                if generation and isinstance(generation.get(k), (int, float)) and not isinstance(generation[k], bool)}
    architectures = [a for a in c.get("architectures") or [] if isinstance(a, str)]
    labels: list[str] = []
    if any(a.endswith(SCORE_HEADS) for a in architectures):
        id2label = c.get("id2label") or {}
        count = c.get("num_labels", len(id2label) or 2)  # transformers' PretrainedConfig default: 2 labels
        if any(a.endswith(REWARD_HEADS) for a in architectures):
            count, id2label = 1, {}  # one reward whatever id2label says (vLLM sets num_labels=1 too)
        labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count)]
        arch["num_labels"] = count
    pad = c.get("pad_token_id")
    return Checkpoint(family=family, arch={k: v for k, v in arch.items() if v is not None},
                      dtype=str(dtype) if dtype is not None else None, eos_token_ids=eos, unsupported=unsupported,
                      sampling=sampling, architectures=architectures, labels=labels,
                      pad_token_id=pad if isinstance(pad, int) and not isinstance(pad, bool) else None,
                      weight_quant=weight_quant)


def _from_hf_folder(folder: str) -> Checkpoint:
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{folder} has no config.json (a Hugging Face checkpoint folder is expected)")
    generation_path = os.path.join(folder, "generation_config.json")
    generation = _read_json(generation_path) if os.path.isfile(generation_path) else None
    return parse_hf_config(_read_json(config_path), generation)


def _float32(value: float) -> float:
    return float(f"{value:.7g}")  # GGUF stores float32: 1e-5 reads back as 9.9999997e-06


def _from_gguf(path: str) -> Checkpoint:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/struct.error/OSError on bad files
        raise CheckpointError(f"cannot read GGUF {path}: {e}") from e
    meta = {name: f.contents() for name, f in reader.fields.items()
            if not name.startswith("tokenizer.ggml.") or name.endswith("_token_id")}
    family = meta.get("general.architecture")
    tensors = {t.name for t in reader.tensors}

    def key(suffix: str):
        return meta.get(f"{family}.{suffix}")

    vocab = key("vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling_type = key("rope.scaling.type")
    arch = {
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": key("attention.head_count_kv") or key("attention.head_count"),
        "head_dim": key("attention.key_length"),
        "vocab_size": vocab,
        "max_position_embeddings": key("context_length"),
        "rope_theta": _float32(key("rope.freq_base")) if key("rope.freq_base") else None,
        "rope_scaling": rope.normalize(
            {"rope_type": scaling_type, "factor": key("rope.scaling.factor"),
             "original_max_position_embeddings": key("rope.scaling.original_context_length")}
            if scaling_type not in (None, "none") else None, {"max_position_embeddings": key("context_length")}),
        "rms_norm_eps": (_float32(key("attention.layer_norm_rms_epsilon"))
                         if key("attention.layer_norm_rms_epsilon") else None),
        "tie_word_embeddings": "output.weight" not in tensors,  # no LM head: it reuses the embedding
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    # llama3's rope scaling travels as a tensor of frequency factors, which the model does not apply
    unsupported = ["a rope_freqs tensor (llama3 rope scaling; convert the Hugging Face checkpoint instead)"] \
        if "rope_freqs.weight" in tensors else []
    if key("expert_count"):  # Mixtral's GGUF is a llama with ffn_*_exps tensors
        unsupported.append(f"{key('expert_count')} experts (MoE GGUF files are not read; serve the Hugging Face "
                           "checkpoint)")
    return Checkpoint(family=family, arch={k: v for k, v in arch.items() if v is not None},
                      eos_token_ids=_eos_list(meta.get("tokenizer.ggml.eos_token_id")), unsupported=unsupported)


@lru_cache(maxsize=8)
def read_checkpoint(path: str) -> Optional[Checkpoint]:
    """The checkpoint at `path` (a folder with config.json, or a .gguf file); None if it does not exist."""
    if not os.path.exists(path):
        return None
    return _from_gguf(path) if is_gguf(path) else _from_hf_folder(path)


def checkpoint_dtype(ckpt: Optional[Checkpoint]) -> Optional[DType]:
    if ckpt is None or ckpt.dtype is None:
        return None
    return DTYPE_NAMES.get(ckpt.dtype.removeprefix("torch."))


SAFETENSORS_HEADER_MAX = 100 << 20  # bytes of one file's JSON header; larger is not a safetensors file


def safetensors_names(folder: str) -> Optional[list[str]]:
    """The tensor names of a Hugging Face folder's weights, as saved (model_tensor_name maps them): its
    model.safetensors.index.json's, else every *.safetensors file's JSON header (8 bytes of length, then
    JSON), nothing loaded; None when it has no *.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        return list(_read_json(index).get("weight_map") or {})
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        return None
    names: list[str] = []
    for path in files:
        try:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if not 2 <= size <= SAFETENSORS_HEADER_MAX:
                    raise ValueError(f"a header of {size} bytes")
                header = json.loads(f.read(size))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read the safetensors header of {path}: {e}") from e
        names += [name for name in header if name != "__metadata__"]
    return names

"""Every tensor-name layout transformers has written for a served family loads (runtime/models/checkpoint.py's
TENSOR_PREFIXES): each fixture's checkpoint re-saved with its tensors named as a transformers version writes
them, loaded by llaunch, greedy-decodes the tokens transformers' generate gives on the fixture (its oracle);
a tensor missing from such a checkpoint is an error naming it.

What save_pretrained writes, observed with the fixtures' tiny models under transformers 4.52.4, 4.57.1, 5.0.0,
5.10.4, 5.17.0, 5.20.0 and 5.24.0 (decoder, towers, LM head):
- Llama, Qwen2, Qwen2-VL, Qwen2.5-VL, every version: model.*, visual.*, lm_head.* (transformers >= 4.52 names
  its modules model.language_model.*, model.visual.* and renames them back on save).
- Qwen2-VL/2.5-VL saved without that renaming (Trainer/DeepSpeed saves since 4.52, e.g. LlamaFactory #8338):
  model.language_model.*, model.visual.*, lm_head.* ("own names").
- Qwen2-Audio, 4.52.4, 4.57.1, 5.0.0, 5.24.0: language_model.model.*, language_model.lm_head.*, audio_tower.*,
  multi_modal_projector.*. 5.10.4, 5.17.0, 5.20.0: the decoder under language_model.model.model.* (two of
  5.x's save-time renamings applied one after the other; issue #35), the rest the same. Own names (5.x):
  model.language_model.*, lm_head.*, model.audio_tower.*, model.multi_modal_projector.*.
- A base model saved alone, without an LM head: LlamaModel / Qwen2Model embed_tokens.*, layers.*, norm.*
  (every version); Qwen2VLModel language_model.*, visual.* (5.x). Greedy-tested with tied embeddings only.
- MoE experts, observed under 5.24 (4.x writes the first layout too): one tensor per expert and projection,
  Qwen2-MoE / Qwen3-MoE mlp.experts.{e}.gate_proj / up_proj / down_proj.weight, Mixtral
  block_sparse_moe.experts.{e}.w1 / w3 / w2.weight and block_sparse_moe.gate.weight (save_pretrained's default:
  transformers 5 reverts its load-time conversion); stacked as transformers 5 holds them, mlp.experts.gate_up_proj
  [E, 2I, H] and mlp.experts.down_proj [E, H, I] (Mixtral's block renamed mlp), with save_original_format=False.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from llaunch.runtime.encoder.in_process import InProcessAudioEmbeds
from llaunch.runtime.http.audio_features import AudioFeatures
from llaunch.runtime.config import VisualConfig
from llaunch.runtime.http.images import ImageInputs
from llaunch.runtime.ipc.messages import NewSeq, PrefillChunk, SamplingParams, StepPlan
from llaunch.runtime.models.checkpoint import CheckpointError, model_tensor_name, per_expert_names, read_checkpoint
from llaunch.runtime.models.loader import build_audio_tower, build_model, build_vision_tower
from llaunch.runtime.encoder.in_process import InProcessEmbeds
from llaunch.runtime.worker.audio_rows import AudioRows
from llaunch.runtime.worker.image_rows import ImageRows
from llaunch.runtime.worker.runner import ModelRunner
from tests.fixtures.tiny_audio import AudioOracle, clip, write_tiny_qwen2_audio
from tests.fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from tests.fixtures.tiny_vl import VlOracle, image_png, write_tiny_qwen2_vl
from tests.fixtures.tiny_vl25 import Vl25Oracle, write_tiny_qwen2_5_vl

pytestmark = pytest.mark.slow  # seconds a test: `make test` runs it, `make test-fast` does not

CPU, F32 = torch.device("cpu"), torch.float32
MAX_NEW = 5


def renamed(*prefixes: tuple[str, str]) -> Callable[[str], str]:
    """A layout: our name → the layout's, by the first (our prefix, the layout's prefix) that matches."""
    def rename(name: str) -> str:
        return next((new + name[len(old):] for old, new in prefixes if name.startswith(old)), name)
    return rename


# The layouts a family is re-saved in, as renamings of our names (whatever layout the installed transformers
# writes the fixture in: the GPU host's 5.17 writes Qwen2-Audio's differently from CI's 5.24).
SAVED = renamed()  # Llama, Qwen2, Qwen2-VL/2.5-VL by every version
BASE_MODEL_ALONE = renamed(("model.", ""))
VL_OWN_NAMES = renamed(("model.", "model.language_model."), ("visual.", "model.visual."))
AUDIO_SAVED = renamed(("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))  # 4.x, 5.0, 5.24
AUDIO_5_17 = renamed(("model.", "language_model.model.model."), ("lm_head.", "language_model.lm_head."))
AUDIO_OWN_NAMES = renamed(("model.", "model.language_model."), ("audio_tower.", "model.audio_tower."),
                          ("multi_modal_projector.", "model.multi_modal_projector."))


def resave(src: Path, dst: Path, rename: Callable[[str], str], files: int = 1,
           drop: tuple[str, ...] = ()) -> Path:
    """`src`'s checkpoint folder copied to `dst` with its tensors renamed from ours (less those named in
    `drop`, by their new names), in `files` safetensors files with an index when more than one."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    tensors = {rename(model_tensor_name(n)): t for n, t in load_file(str(src / "model.safetensors")).items()}
    names = sorted(n for n in tensors if n not in drop)
    if files == 1:
        save_file({n: tensors[n] for n in names}, str(dst / "model.safetensors"), metadata={"format": "pt"})
        return dst
    weight_map = {n: f"model-{i % files + 1:05d}-of-{files:05d}.safetensors" for i, n in enumerate(names)}
    for file in set(weight_map.values()):
        save_file({n: tensors[n] for n in names if weight_map[n] == file}, str(dst / file), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def tensor_names(folder: Path) -> set[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    return set(load_file(str(folder / "model.safetensors")))


def greedy(cfg, rows, prompt: list[int], refs) -> list[int]:
    """llaunch's greedy tokens: the model `cfg` names (towers' embeddings from `rows`), prompt in one prefill."""
    model = build_model(cfg, CPU, F32)
    runner = ModelRunner(model, model.make_kv_cache(512, 2, 512), 1, CPU, images=rows)
    slots = list(range(1, len(prompt) + MAX_NEW + 1))
    new = [NewSeq(row=0, request_id="r", sampling=SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0),
                  prompt_ids=prompt, images=refs)]
    result = runner.execute(StepPlan(step=0, new=new, prefill=[
        PrefillChunk(row=0, token_ids=prompt, start=0, slots=slots[:len(prompt)], sample=True)]))
    tokens = list(result.token_ids)
    while len(tokens) < MAX_NEW:
        result = runner.execute(StepPlan(step=len(tokens), decode_rows=[0],
                                         decode_slots=[slots[len(prompt) + len(tokens) - 1]]))
        tokens += result.token_ids
    return tokens


@pytest.mark.parametrize("name,ours", [
    # Llama / Qwen2 / Qwen2-VL / Qwen2.5-VL as every version saves them: already ours
    ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("lm_head.weight", "lm_head.weight"), ("score.weight", "score.weight"),
    ("visual.blocks.0.attn.qkv.weight", "visual.blocks.0.attn.qkv.weight"),
    # Qwen2-VL / 2.5-VL under transformers' own module names
    ("model.language_model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"),
    ("model.visual.merger.ln_q.weight", "visual.merger.ln_q.weight"),
    # Qwen2-Audio: 4.x / 5.0 / 5.24, then 5.10-5.20, then 5.x's own names
    ("language_model.model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("language_model.lm_head.weight", "lm_head.weight"),
    ("audio_tower.layers.0.fc1.weight", "audio_tower.layers.0.fc1.weight"),
    ("language_model.model.model.norm.weight", "model.norm.weight"),
    ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("model.audio_tower.conv1.weight", "audio_tower.conv1.weight"),
    ("model.multi_modal_projector.linear.bias", "multi_modal_projector.linear.bias"),
    # base models saved alone: LlamaModel / Qwen2Model, Qwen2VLModel (5.x)
    ("embed_tokens.weight", "model.embed_tokens.weight"), ("layers.0.input_layernorm.weight",
                                                           "model.layers.0.input_layernorm.weight"),
    ("norm.weight", "model.norm.weight"), ("language_model.layers.0.self_attn.k_proj.bias",
                                           "model.layers.0.self_attn.k_proj.bias"),
    # Mixtral's MoE block as 4.x and 5.x's save_pretrained name it; transformers 5's own name
    ("model.layers.3.block_sparse_moe.experts.7.w2.weight", "model.layers.3.mlp.experts.7.w2.weight"),
    ("model.layers.3.block_sparse_moe.gate.weight", "model.layers.3.mlp.gate.weight"),
    ("model.layers.3.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.gate_up_proj"),
])
def test_every_layout_reads_as_our_names(name, ours):
    assert model_tensor_name(name) == ours


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def text(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # tied (as Qwen2-0.5B is): a base model saved alone loses nothing
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, tie_word_embeddings=True)
    prompt = AutoTokenizer.from_pretrained(path).encode("The sea at night is")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=F32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
    return path, prompt, out[0, len(prompt):].tolist()


def test_base_model_saved_alone(text, tmp_path):
    path, prompt, expected = text
    folder = resave(path, tmp_path / "alone", BASE_MODEL_ALONE)
    assert "embed_tokens.weight" in tensor_names(folder)
    assert greedy(model_config_from_folder(folder), None, prompt, []) == expected


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vl(request, tmp_path_factory):
    writer, oracle_class = {"qwen2_vl": (write_tiny_qwen2_vl, VlOracle),
                            "qwen2_5_vl": (write_tiny_qwen2_5_vl, Vl25Oracle)}[request.param]
    path = writer(tmp_path_factory.mktemp(request.param))
    oracle, png = oracle_class(path), image_png(90, 60, 0)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "-"}},
                                             {"type": "text", "text": "Describe."}]}]
    expected, prompt_len = oracle.greedy(messages, [png], MAX_NEW)
    return path, oracle.inputs(messages, [])["input_ids"], png, prompt_len, expected


@pytest.mark.parametrize("layout,files,names", [
    (SAVED, 1, ("model.embed_tokens.weight", "visual.patch_embed.proj.weight", "lm_head.weight")),
    (VL_OWN_NAMES, 2, ("model.language_model.embed_tokens.weight", "model.visual.patch_embed.proj.weight",
                       "lm_head.weight")),
], ids=["as-saved", "own-names-sharded"])
def test_vl_layout(vl, tmp_path, layout, files, names):
    path, rendered, png, prompt_len, expected = vl
    folder = resave(path, tmp_path / "resaved", layout, files)
    assert set(names) <= tensor_names(folder)
    cfg = replace(model_config_from_folder(folder), vision=read_checkpoint(str(folder)).arch["vision"])
    inputs = ImageInputs(cfg, VisualConfig())
    prompt, refs = inputs.splice(rendered, [inputs.process(png, "image")])
    assert len(prompt) == prompt_len
    rows = ImageRows(InProcessEmbeds(build_vision_tower(cfg, CPU, F32), 2**20))
    assert greedy(cfg, rows, prompt, refs) == expected


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    path = write_tiny_qwen2_audio(tmp_path_factory.mktemp("tiny-qwen2-audio"))
    oracle, wave = AudioOracle(path), clip(1.3, 0)
    messages = [{"role": "user", "content": [{"type": "input_audio"}, {"type": "text", "text": "What is said?"}]}]
    expected, prompt_len, _ = oracle.greedy(messages, [wave], MAX_NEW)
    return path, oracle.prompt_ids(messages), wave, prompt_len, expected


def audio_greedy(folder: Path, audio) -> list[int]:
    _, ids, wave, prompt_len, _ = audio
    cfg = replace(model_config_from_folder(folder), audio=read_checkpoint(str(folder)).arch["audio"])
    features = AudioFeatures(cfg.audio, cfg.vocab_size, str(folder))
    prompt, refs = features.splice(ids, [features.process(wave)])
    assert len(prompt) == prompt_len
    rows = AudioRows(InProcessAudioEmbeds(build_audio_tower(cfg, CPU, F32), 2**20))
    return greedy(cfg, rows, prompt, refs)


@pytest.mark.parametrize("layout,files,names", [
    (AUDIO_SAVED, 1, ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
                      "audio_tower.conv1.weight", "multi_modal_projector.linear.weight")),
    (AUDIO_5_17, 1, ("language_model.model.model.embed_tokens.weight", "language_model.lm_head.weight",
                     "audio_tower.conv1.weight", "multi_modal_projector.linear.weight")),
    (AUDIO_5_17, 2, ("language_model.model.model.layers.1.mlp.up_proj.weight",)),
    (AUDIO_OWN_NAMES, 1, ("model.language_model.embed_tokens.weight", "lm_head.weight",
                          "model.audio_tower.conv1.weight", "model.multi_modal_projector.linear.weight")),
], ids=["transformers-4.x-5.0-5.24", "transformers-5.17", "transformers-5.17-sharded", "own-names"])
def test_qwen2_audio_layout(audio, tmp_path, layout, files, names):
    path, *_, expected = audio
    folder = resave(path, tmp_path / "resaved", layout, files)
    assert set(names) <= tensor_names(folder)
    assert audio_greedy(folder, audio) == expected


def test_a_missing_tensor_is_an_error_naming_it(audio, tmp_path):
    folder = resave(audio[0], tmp_path / "resaved", AUDIO_5_17,
                    drop=("language_model.model.model.layers.1.mlp.up_proj.weight",))
    with pytest.raises(KeyError, match=r"has no tensor model\.layers\.1\.mlp\.up_proj\.weight in any layout"):
        audio_greedy(folder, audio)


def test_two_layouts_of_one_tensor_are_refused(text, tmp_path):
    folder = resave(text[0], tmp_path / "both", SAVED)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.language_model.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"are both model\.norm\.weight") as error:
        build_model(model_config_from_folder(folder), CPU, F32)
    assert "model.language_model.norm.weight" in str(error.value)


def test_per_expert_names_of_a_stacked_tensor():
    assert per_expert_names("model.layers.2.mlp.experts.gate_up_proj", 5) == [
        ["model.layers.2.mlp.experts.5.gate_proj.weight", "model.layers.2.mlp.experts.5.up_proj.weight"],
        ["model.layers.2.mlp.experts.5.w1.weight", "model.layers.2.mlp.experts.5.w3.weight"]]
    assert per_expert_names("model.layers.2.mlp.experts.down_proj", 0) == [
        ["model.layers.2.mlp.experts.0.down_proj.weight"], ["model.layers.2.mlp.experts.0.w2.weight"]]
    assert per_expert_names("model.layers.2.mlp.down_proj.weight", 0) == []


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "mixtral"])
def moe(request, tmp_path_factory):
    """(family, its per-expert checkpoint, prompt, transformers' greedy tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    prompt = AutoTokenizer.from_pretrained(path).encode("The sea at night is")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=F32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
    return request.param, path, prompt, out[0, len(prompt):].tolist()


@pytest.mark.parametrize("stacked,shard", [(False, None), (True, None), (True, "300KB")],
                         ids=["per-expert", "stacked", "stacked-sharded"])
def test_moe_expert_layouts(moe, tmp_path, stacked, shard):
    family, per_expert, prompt, expected = moe
    folder = per_expert if not stacked else \
        write_tiny_checkpoint(tmp_path / "stacked", family, stacked_experts=True, max_shard_size=shard)
    names = tensor_names(folder)
    block = "block_sparse_moe" if family == "mixtral" and not stacked else "mlp"
    assert (f"model.layers.1.{block}.experts.gate_up_proj" in names) == stacked
    assert (f"model.layers.1.{block}.gate.weight" in names)
    assert (shard is not None) == (folder / "model.safetensors.index.json").is_file()
    assert greedy(model_config_from_folder(folder), None, prompt, []) == expected


def test_a_missing_expert_is_an_error_naming_it(moe, tmp_path):
    family, path, prompt, _ = moe
    part = "w3" if family == "mixtral" else "up_proj"
    missing = f"model.layers.1.mlp.experts.3.{part}.weight"
    folder = resave(path, tmp_path / "resaved", SAVED, drop=(missing,))
    with pytest.raises(KeyError, match=rf"has no tensor {missing.replace('.', '[.]')} in any layout"):
        greedy(model_config_from_folder(folder), None, prompt, [])

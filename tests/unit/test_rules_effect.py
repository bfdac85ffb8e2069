"""keys_have_effect: every key of `llaunch --help` has an entry saying where it is read; each context is
read on one side and refused on the other; what the user set is told apart from what the profiles set."""
from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from functools import lru_cache

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from llaunch.launcher import config_changes, config_keys, derive, rules, rules_effect, store
from llaunch.launcher.rule_registry import get
from llaunch.runtime.config import Device, LlaunchConfig

BASE = ("model=tiny-llama", "device=cpu")
VL = ("model=qwen2-vl-7b", "model.load_format=dummy")
AUDIO = ("model=qwen2-audio-7b", "model.load_format=dummy")
CUDA = ("device=cuda", "dry_run=true")
SCORE = ("model.task=score", "model.num_labels=1")

# context → (overrides where it holds, overrides where it does not), on top of BASE
EXAMPLES = {
    "serving": ((), ("mode=pd_master",)),
    "http": ((), ("mode=config_server",)),
    "named": ((), ("mode=pd_master",)),
    "cuda_kernels": (CUDA, ()),
    "cuda_graphs_switch": (CUDA, ()),
    "cuda_graphs": (CUDA, ("model.enforce_eager=true",)),
    "gpu_memory": (CUDA, ()),
    "cpu_workers": ((), CUDA),
    "cpu_kv": ((), ("cache.max_total_tokens=4096",)),
    "dummy": ((), ("model.load_format=safetensors",)),
    "generates": ((), SCORE),
    "fp8_weights": (("model.quantization=fp8",), ()),
    "scores": (SCORE, ("model.task=generate",)),  # auto: num_labels on dummy weights makes a score model
    "yes_no": (("model.task=score", "model.score_head=yes_no"), ("model.score_head=linear",)),
    "embeds": (("model.task=embed",), ("model.task=generate",)),
    "speculates": (("spec=ngram",), ()),
    "ngram": (("spec=ngram",), ("spec=draft",)),
    "draft": (("spec=draft",), ("spec=ngram",)),
    "images": (VL, ()),
    "clips": (AUDIO, ()),
    "replicas": (("parallel=dp2",), ()),
    "affinity": (("router.dp_prefix_affinity=true",), ()),
    "chunked": ((), ("router.chunked_prefill=false",)),
    "not_decode": ((), ("mode=pd_decode",)),
    "waits": (("router.max_wait_tokens=6",), ("router.max_wait_tokens=0",)),
    "pd_role": (("mode=pd_prefill",), ()),
    "master_dialled": ((), ("mode=pd_decode", "mode.config_server_host=127.0.0.1")),
    "registry": (("mode=pd_master",), ("mode=normal",)),
    "registry_named": (("mode=pd_master", "mode.config_server_host=127.0.0.1"), ("mode=pd_master",)),
    "kv_receiver": (("mode=pd_decode",), ()),
    "metrics": (("server.metrics_port=9100",), ()),
    "rendezvous": (("parallel=tp2",), ()),
    "tensor_parallel": (("parallel=tp2",), ()),
    "nodes": (("parallel.nnodes=2",), ()),
    "shared_node": (("parallel=tp2",), ()),
    "shared_prefix": (("bench=prefix64x8",), ("bench=c1",)),
    "slo": (("bench=tune_smoke",), ("bench=c1",)),
    "untraced": (("bench=c1",), ("bench=c1", "bench.trace=/x.jsonl")),
}
# keys read everywhere that another rule refuses where they are not: rule, overrides that break it
OTHER_RULES = {
    "parallel.tpsp_mix": ("tpsp_mix_not_implemented", ("parallel.tpsp_mix=true",)),
    "cache.cpu_tokens": ("host_kv_tier_supported", ("mode=pd_master", "cache.cpu_tokens=64")),
    "cache.dp_fetch": ("dp_fetch_supported", ("cache.dp_fetch=true",)),
    "server.tgi_api": ("tgi_api_mode", ("mode=pd_master", "server.tgi_api=true")),
    "server.metrics_port": ("metrics_port_valid", ("mode=pd_master", "server.metrics_port=9100")),
}
# values the generic choice below would get wrong
VALUES = {"model.sampling_defaults": {"temperature": 0.5}, "model.rope_scaling": {"rope_type": "linear", "factor": 2.0},
          "model.vision": {"depth": 1}, "model.audio": {"d_model": 8}, "kernels.pdl_kernels": ["gemv"],
          "kernels.pdl_late": ["gemv"], "model.labels": ["good"], "parallel.node_addrs": ["a", "b"]}


@lru_cache(maxsize=None)
def composed(overrides: tuple[str, ...]) -> LlaunchConfig:
    store.register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(store.CONF_DIR), version_base="1.3"):
            return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))
    finally:
        GlobalHydra.instance().clear()


def merged(*groups: tuple[str, ...]) -> tuple[str, ...]:
    """Overrides in order, a later one of the same key replacing an earlier one."""
    out: dict[str, str] = {}
    for o in (o for g in groups for o in g):
        out[config_changes.override_key(o)] = o
    return tuple(out.values())


def _hint(cls, key: str):
    for part in key.split(".")[:-1]:
        cls = config_changes_inner(typing.get_type_hints(cls)[part])
    return typing.get_type_hints(cls)[key.split(".")[-1]]


def config_changes_inner(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union else tp


def another_value(key: str, current):
    """A value of the key's type other than `current`."""
    if key in VALUES:
        return VALUES[key]
    tp = config_changes_inner(_hint(LlaunchConfig, key))
    if isinstance(tp, type) and issubclass(tp, Enum):
        return next(m for m in tp if m != current)
    if tp is bool:
        return not current
    if tp is int:
        return (current or 0) + 2
    if tp is float:
        return (current or 1.0) / 2
    if tp is str:
        return "/x/" + key.rsplit(".", 1)[-1]
    if typing.get_origin(tp) is list:
        return [1] if typing.get_args(tp)[0] is int else ["x"]
    raise AssertionError(f"give {key} a value in VALUES")


def with_value(cfg, key: str, value):
    head, _, rest = key.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: with_value(getattr(cfg, head), rest, value)})


def config_of(overrides: tuple[str, ...]) -> LlaunchConfig:
    """BASE and `overrides`: composed from the profile choices (a composition takes ~0.1 s), then the
    keys set on the dataclasses."""
    overrides = merged(BASE, overrides)
    cfg = composed(tuple(config_changes.choice_overrides(overrides)))
    for o in overrides:
        if config_changes.sets_a_key(o):
            key, text = o.split("=", 1)
            tp = config_changes_inner(_hint(LlaunchConfig, key))
            value = yaml.safe_load(text)
            cfg = with_value(cfg, key, tp(value) if isinstance(tp, type) and issubclass(tp, Enum) else value)
    return cfg


def effect_violations(overrides: tuple[str, ...], key: str):
    cfg = config_of(overrides)
    value = another_value(key, get(cfg, key))
    return [v for v in rules_effect.keys_have_effect(derive.resolve(with_value(cfg, key, value)), {key: value})
            if key in v.keys]


def test_every_key_of_help_says_where_it_is_read():
    keys = {k.name for k in config_keys.all_keys()}
    assert keys - set(rules_effect.READ_WHERE) == set(), "add the new keys to launcher/rules_effect.py READ_WHERE"
    assert set(rules_effect.READ_WHERE) - keys == set(), "READ_WHERE names keys that do not exist"
    assert {c.name for c in rules_effect.CONTEXTS} == set(EXAMPLES)
    used = {c.name for contexts in rules_effect.READ_WHERE.values() for c in contexts}
    assert used == set(EXAMPLES), "a context no key uses"


CONDITIONAL = [(key, contexts) for key, contexts in rules_effect.READ_WHERE.items() if contexts]


@pytest.mark.parametrize("key,contexts", CONDITIONAL, ids=[k for k, _ in CONDITIONAL])
def test_a_key_is_read_in_its_contexts_and_refused_outside_each(key, contexts):
    on = merged(*(EXAMPLES[c.name][0] for c in contexts))
    assert effect_violations(on, key) == [], f"{key} refused where it is read ({on})"
    for ctx in contexts:
        off = merged(*(EXAMPLES[c.name][0] for c in contexts if c != ctx), EXAMPLES[ctx.name][1])
        [v] = effect_violations(off, key)
        assert v.message.startswith(f"{key}=") and "has no effect with" in v.message and "drop the key" in v.message
        assert all(k in v.message for k in v.keys), v.message


@pytest.mark.parametrize("key", sorted(OTHER_RULES))
def test_keys_read_everywhere_are_refused_by_their_own_rule_where_unread(key):
    rule, overrides = OTHER_RULES[key]
    assert rules_effect.READ_WHERE[key] == ()
    cfg = derive.resolve(config_of(overrides))
    assert any(key in v.keys for v in next(r.check for r in rules.RULES if r.name == rule)(cfg))


@pytest.fixture
def changes_of():
    """`changes_of(*overrides)`: the keys the user changed, as the launcher computes them."""
    def run(*overrides):
        return config_changes.changed_keys(composed(tuple(overrides)),
                                           composed(tuple(config_changes.choice_overrides(overrides))))
    return run


def test_what_the_user_set_is_told_from_what_the_profiles_set(changes_of):
    assert changes_of("mode=pd_decode", "model=qwen2-7b", "spec=ngram") == {}  # profiles only
    assert changes_of("spec.num_tokens=4") == {}  # the profile's value again: nothing changed
    assert changes_of("spec.num_tokens=3", "device=cpu") == {"spec.num_tokens": 3, "device": Device.cpu}
    assert changes_of("+model.sampling_defaults.min_p=0.1") == {
        "model.sampling_defaults": {**composed(()).model.sampling_defaults, "min_p": 0.1}}
    assert changes_of("bench=c1", "bench.num_prompts=7") == {"bench.num_prompts": 7}
    assert config_changes.choice_overrides(["model=qwen2", "+tuned=x", "hydra/sweeper=tune", "dry_run=true",
                                            "~model.tokenizer", "spec.num_tokens=3"]) == \
        ["model=qwen2", "+tuned=x", "hydra/sweeper=tune"]
    fallback = config_changes.overridden_keys(["model.sampling_defaults.top_p=0.5", "model=x", "log_level=DEBUG"],
                                              composed(()))
    assert set(fallback) == {"model.sampling_defaults", "log_level"}


def check(*overrides):
    cfg = derive.resolve(composed(merged(BASE, overrides)))
    changed = config_changes.changed_keys(composed(merged(BASE, overrides)),
                                          composed(merged(BASE, tuple(config_changes.choice_overrides(overrides)))))
    return [v for v in rules.check_all(cfg, changed) if v.rule == "keys_have_effect"]


def test_the_issues_cases_are_refused_at_once_each_naming_its_key():
    found = check("spec.num_tokens=3", "spec.ngram_max=5", "mode.kv_transport=nccl", "mode.pd_master_port=1234",
                  "router.dp_prefill_balance=true", "router.dp_prefix_affinity=true", "server.metrics_host=0.0.0.0",
                  "model.labels=[a,b]", "model.score_head=mlp", "visual.max_images_per_request=2",
                  "audio.max_clip_seconds=5")
    assert [v.keys[0] for v in found] == [
        "model.labels", "model.score_head", "mode.pd_master_port", "mode.kv_transport", "router.dp_prefill_balance",
        "router.dp_prefix_affinity", "server.metrics_host", "spec.num_tokens", "spec.ngram_max",
        "visual.max_images_per_request", "audio.max_clip_seconds"]
    [v] = check("spec.num_tokens=3")
    assert v.message.startswith("spec.num_tokens=3 has no effect with spec.method=none") and "spec=ngram" in v.message


def test_a_profiles_own_values_and_keys_in_context_pass():
    assert check("mode=pd_master", "model=qwen2-7b") == []  # the model profile's keys on a pd_master
    assert check("spec=ngram", "spec.num_tokens=3", "spec.ngram_max=5") == []
    assert check("parallel=dp2", "router.dp_prefill_balance=true") == []
    assert check("mode=pd_decode", "mode.kv_transport=nccl", "router.token_ratio=0.5") == [
        v for v in check("mode=pd_decode", "router.token_ratio=0.5")]  # token_ratio: a decode instance admits always
    [v] = check("mode=pd_decode", "router.token_ratio=0.5")
    assert v.keys == ("router.token_ratio", "mode.kind")
    [v] = check("mode=pd_decode", "router.max_wait_tokens=3")  # the value given, not the derived 0
    assert v.message.startswith("router.max_wait_tokens=3 has no effect with mode.kind=pd_decode")


def test_a_bench_jobs_own_keys_are_checked_in_the_sweep_process():
    from llaunch.launcher.bench_job import bench_refusals

    cfg = composed(("bench=c1", "bench.trace=/etc/hostname", "bench.request_rate=4"))
    [why] = bench_refusals(cfg, {"bench.request_rate": 4.0, "device": Device.cpu})  # only bench.* here
    assert why.startswith("bench.request_rate=4.0 has no effect with bench.trace=/etc/hostname")
    assert bench_refusals(composed(("bench=c1", "bench.repeats=0")), {"bench.repeats": 0}) == [
        "bench.repeats=0 must be >= 1"]

"""Each rule broken alone: it fires, names its keys in the message, and no other rule fires; a valid
config passes them all; a dry run skips the machine checks and lists what waits for model.path."""
from __future__ import annotations

import json
import socket

import pytest

from llaunch.launcher import derive, rules, rules_model
from llaunch.runtime.config import LoadFormat


@pytest.fixture
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def resolved(compose_config, tmp_path, free_port):
    """`resolved(*overrides)`: tiny-llama on cpu, on a free port, with a tokenizer folder that exists."""
    (tmp_path / "tokenizer").mkdir()

    def run(*overrides: str):
        base = ("model=tiny-llama", "device=cpu", f"server.port={free_port}", f"model.tokenizer={tmp_path}/tokenizer")
        return derive.resolve(compose_config(*base, *overrides))

    return run


def tiny_llama_folder(path, **overrides):
    """A config.json for the tiny-llama profile, written by transformers (optionally altered)."""
    from transformers import LlamaConfig

    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, vocab_size=49152, max_position_embeddings=512,
                rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2)
    LlamaConfig(**dims | overrides).save_pretrained(path)
    return path


VL = ("model=qwen2-vl-7b", "model.load_format=dummy", "dry_run=true")  # a model with visual servers
AU = ("model=qwen2-audio-7b", "model.load_format=dummy", "dry_run=true")  # with audio servers
# tiny-llama's dimensions as a Mixtral: 4 experts of 128 columns, top-2
MIXTRAL = ("model.family=mixtral", "model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=128")
RI = ("kernels.row_invariant=true", "model.dtype=bfloat16")  # row_invariant where it holds
# rule -> overrides that break it alone (after `resolved`'s base)
BREAKS = {
    "mem_fraction_in_range": [["cache.mem_fraction=1.5"], ["cache.mem_fraction=0"]],
    "batch_max_tokens_bounds": [["router.batch_max_tokens=100"], ["router.chunked_prefill_size=0"],
                                ["router.chunked_prefill=false", "router.batch_max_tokens=256"]],
    "kv_budget": [["cache.max_total_tokens=100"], ["cache.cpu_kv_gib=0"]],
    "max_running_requests_positive": [["router.max_running_requests=0"], ["router.max_wait_tokens=-1"]],
    "prefill_graph_tokens_nonnegative": [["model.prefill_graph_tokens=-64"]],
    "mixed_graph_tokens_nonnegative": [["model.mixed_graph_tokens=-1"]],
    "device_threads_nonnegative": [["device_threads=-1"]],
    "http_workers_positive": [["server.http_workers=0"]],
    "kernel_settings_valid": [["kernels.pdl_kernels=[gemv,softmax]"], ["kernels.gemv_shapes='3584x3584=3/4096/8'"]],
    "timeouts_positive": [["server.ready_timeout_s=-1"], ["bench=c1", "bench.timeout_s=-5"],
                          ["router.stall_timeout_s=-1"], ["server.request_timeout_s=-2"],
                          ["server.max_constraint_compile_s=0"]],
    "request_limits_positive": [["server.max_stop_strings=0"], ["router.max_waiting_requests=0"],
                                ["server.max_body_bytes=10"]],
    "bench_settings_valid": [["bench=c1", "bench.client_procs=2"], ["bench=c1", "bench.repeats=0"],
                             ["bench=c1", "bench.slo_tpot_ms=0"]],
    "weights_fit_memory": [["model=qwen2-72b", "model.load_format=dummy", "device=cpu"]],  # 271 GiB in float32
    "sampling_defaults_valid": [["model.sampling_defaults={temperature:-1}"], ["model.sampling_defaults={beams:2}"]],
    "api_key_source": [["server.api_key=k", "server.api_key_file=/etc/hostname"],
                       ["server.api_key_file=/no/such/key"], ["server.api_key_file=/dev/null"]],
    "family_supported": [["model.family=gemma"], ["model.family=olmoe"]],
    "model_variants_served": [["model.hidden_act=relu"], ["model.layer_types=[sliding_attention]"],
                              ["model.sliding_window=0"], ["model.attn_logit_softcapping=-1"],
                              ["model.partial_rotary_factor=0.5"]],
    "zmq_mode_fits_nodes": [["parallel=dp2", "parallel.nnodes=2", "parallel.master_port=29000",
                             "parallel.node_addrs=[10.0.0.1,10.0.0.2]", "parallel.zmq_mode=ipc"]],
    "cuda_mps_needs_gpus": [["parallel.cuda_mps=true"]],
    "graph_max_len_in_range": [["model.graph_max_len_in_batch=0"], ["model.graph_max_len_in_batch=100000"]],
    "tpsp_mix_not_implemented": [["parallel.tpsp_mix=true"]],
    "request_features_not_in_pd": [["mode=pd_decode", "server.token_healing=true"],
                                   ["mode=pd_prefill", "router.diverse_mode=true"]],
    "weights_need_path": [["model.load_format=safetensors"], ["model.load_format=auto", "model.path=/no/such/dir"]],
    "tokenizer_exists": [["model.tokenizer=/no/such/tokenizer"]],
    "model_described": [["model.hidden_size=null"], ["model.eos_token_ids=null"]],
    "context_within_model": [["model.max_model_len=1024"]],
    "parallel_sizes": [["parallel.dp=0"], ["parallel.node_rank=1"],
                       ["parallel.tp=2", "parallel.nnodes=3", "parallel.master_port=29500",
                        "parallel.node_addrs=[a,b,c]"]],
    "multinode_addresses": [["parallel.tp=2", "parallel.nnodes=2"]],
    "tp_splits_heads": [["parallel.tp=8"],
                        ["parallel.tp=2", "model.num_attention_heads=6", "model.num_key_value_heads=3"]],
    "gpus_available": [["device=cuda", "parallel.dp=512"]],
    "ports_in_range": [["server.port=70000"], ["parallel.dp=2", "parallel.master_port=65535"],
                       ["mode=pd_decode", "mode.kv_transfer_port=0"]],
    "pd_instance_is_one_replica": [["mode=pd_decode", "parallel=dp2"], ["mode=pd_prefill", "parallel=dp2"]],
    "prompt_logprobs_not_in_pd": [["server.return_all_prompt_logprobs=true", "mode=pd_prefill"]],
    "metrics_port_valid": [["server.metrics_port=0"], ["server.metrics_port=70000"],
                           ["mode=config_server", "mode.config_server_host=127.0.0.1", "server.metrics_port=9100"]],
    "tgi_api_mode": [["server.tgi_api=true", "mode=pd_prefill"]],
    "chat_template_readable": [["server.chat_template=/nonexistent/qwen3.jinja"], ["server.chat_template=pyproject.toml"]],
    "pd_addresses": [["mode=pd_decode", "mode.pd_master_host=''"],
                     ["mode=config_server", "mode.config_server_host=null"]],
    "score_needs_head": [["model.task=score"]],
    "score_labels_match": [["model.task=score", "model.num_labels=0"],
                           ["model.task=score", "model.num_labels=2", "model.labels=[good]"]],
    "score_not_in_pd_modes": [["model.task=score", "model.num_labels=1", "mode=pd_prefill"],
                              ["model.task=embed", "mode=pd_decode"]],
    "yes_no_tokens_known": [["model.score_head=yes_no", "model.score_token_ids=[3,3]"],
                            ["model.score_head=yes_no", "model.score_token_ids=[3,49152]"]],
    "embed_matryoshka_consistent": [["model.task=embed", "model.matryoshka=false", "model.matryoshka_dimensions=[16]"],
                                    ["model.task=embed", "model.matryoshka_dimensions=[16,65]"]],
    "diverse_mode_needs_prompt_cache": [["router.diverse_mode=true", "cache.prompt_cache=false"]],
    "host_kv_tier_supported": [["cache.cpu_tokens=-1"], ["cache.cpu_tokens=64", "cache.prompt_cache=false"],
                               ["cache.cpu_tokens=64", "mode=pd_prefill"]],
    "dp_affinity_slack_valid": [["router.dp_affinity_slack_tokens=-1"]],
    "dp_fetch_supported": [["cache.dp_fetch=true", "cache.cpu_tokens=64"],
                           ["cache.dp_fetch=true", "parallel=dp2"],
                           ["cache.dp_fetch=true", "parallel=dp2", "cache.cpu_tokens=64", "parallel.nnodes=2",
                            "parallel.zmq_mode=tcp", "parallel.node_addrs=[a,b]", "parallel.master_port=29500"]],
    "spec_settings_valid": [["spec=ngram", "spec.num_tokens=0"], ["spec=ngram", "spec.ngram_min=9"],
                            ["spec=ngram", "spec.max_batch=0"]],
    "spec_draft_model_usable": [["spec=draft"]],
    "visual_settings_valid": [[*VL, "visual.dp=0"], [*VL, "visual.batch_size=0"], [*VL, "visual.embed_cache_mib=0"],
                              [*AU, "audio.dp=0"], [*AU, "audio.batch_size=0"], [*AU, "audio.embed_cache_mib=0"]],
    "visual_devices_valid": [[*VL, "visual.devices=[0]"], ["device=cuda", *VL, "visual.devices=[0,1]"],
                             [*AU, "audio.devices=[0]"], ["device=cuda", *AU, "audio.devices=[0,1]"]],
    "encoder_group_matches_model": [["model=qwen2-audio-7b", "model.load_format=dummy", "visual.dp=2", "dry_run=true"],
                                    ["model=qwen2-audio-7b", "model.load_format=dummy", "visual.batch_size=4",
                                     "dry_run=true"],
                                    ["model=qwen2-audio-7b", "model.load_format=dummy", "visual.embed_cache_mib=64",
                                     "dry_run=true"],
                                    ["device=cuda", "model=qwen2-audio-7b", "model.load_format=dummy",
                                     "visual.devices=[0]", "dry_run=true"],
                                    ["model=qwen2-vl-7b", "model.load_format=dummy", "audio.dp=2", "dry_run=true"],
                                    ["visual.dp=2"], ["audio.batch_size=4"]],  # a text model: no encoder server
    "visual_tp_valid": [["visual.tp=0"], ["model=qwen2-vl-7b", "model.load_format=dummy", "visual.tp=3", "dry_run=true"],
                        ["device=cuda", "model=qwen2-vl-7b", "model.load_format=dummy", "visual.tp=2", "dry_run=true"],
                        ["device=cuda", "model=qwen2-vl-7b", "model.load_format=dummy", "visual.tp=2",
                         "visual.devices=[1,1]", "dry_run=true"],
                        ["model=qwen2-audio-7b", "model.load_format=dummy", "visual.tp=2", "dry_run=true"],
                        # 16 heads split 8 ways, but not Qwen2.5-VL's 3420 MLP features (its intermediate_size)
                        ["model=qwen2.5-vl-7b", "model.load_format=dummy", "visual.tp=8", "dry_run=true"],
                        ["visual.tp=2"]],
    "audio_limits_valid": [["audio.max_clip_seconds=31"], ["audio.max_clip_bytes=0"],
                           ["audio.max_clips_per_request=0"]],
    "visual_deployment_supported": [["model=qwen2-vl-7b", "model.load_format=dummy", "mode=pd_prefill", "dry_run=true"]],
    "spec_where_rows_decode": [["spec=ngram", "mode=pd_decode"], ["spec=ngram", "server.return_all_prompt_logprobs=true"],
                               ["spec=ngram", "model.task=score", "model.num_labels=1"]],
    "token_healing_without_all_prompt_logprobs": [["server.token_healing=true", "server.return_all_prompt_logprobs=true"]],
    "kv_scales_need_fp8": [["cache.kv_scales=/etc/hostname"],
                           ["cache.kv_dtype=fp8_e4m3", "cache.kv_scales=/etc/hostname", "cache.kv_calibration=/x.json"]],
    "kv_scales_file_exists": [["cache.kv_dtype=fp8_e4m3", "cache.kv_scales=/no/such/scales.json"]],
    "fp8_kv_not_in_pd": [["mode=pd_decode", "cache.kv_dtype=fp8_e4m3"]],
    "lm_head_one_format": [["model.quantization=fp8", "model.fp8_lm_head=true", "model.int8_lm_head=true"]],
    "moe_described": [["model.family=qwen3_moe"], ["model.num_experts=4"], [*MIXTRAL, "model.num_experts_per_tok=5"]],
    "mlp_splits_over_tp": [["parallel=tp2", "model.intermediate_size=127"],
                           [*MIXTRAL, "parallel=tp2", "model.moe_intermediate_size=127"],
                           [*MIXTRAL, "parallel=tp2", "parallel.ep=2", "model.num_experts=3"]],
    "expert_parallel_valid": [["parallel=tp2", "parallel.ep=2"], [*MIXTRAL, "parallel=tp2", "parallel.ep=4"]],
    "moe_quantization_supported": [[*MIXTRAL, "model.quantization=fp8"], [*MIXTRAL, "model.quantization=int8"]],
    "row_invariant_covers_model": [[*RI, "model.quantization=fp8"], [*RI, *MIXTRAL], [*RI, "parallel=tp2"],
                                   ["kernels.row_invariant=true"],  # on CPU the model runs in float32
                                   [*RI, "spec=ngram", "spec.num_tokens=16"]],  # a 17-token verify step
}


def test_a_valid_config_passes_every_rule(resolved):
    assert rules.check_all(resolved()) == []
    assert rules.check_all(resolved("model=tiny-qwen2", "parallel=tp2")) == []
    assert rules.check_all(resolved("parallel=dp2")) == []
    assert rules.check_all(resolved("mode=pd_prefill")) == []
    assert rules.check_all(resolved(*MIXTRAL, "parallel=tp2")) == []
    assert rules.check_all(resolved(*MIXTRAL, "parallel=tp2", "parallel.ep=2")) == []
    assert rules.check_all(resolved(*RI)) == []
    assert rules.check_all(resolved(*RI, "model.quantization=int8")) == []  # int8 rows: a row's kernel at any step
    assert rules.check_all(resolved(*RI, "spec=ngram", "spec.num_tokens=15")) == []  # 16 tokens: still covered


def test_every_rule_has_a_break_case():
    tested = set(BREAKS) | {"gguf_needs_gguf_path", "profile_matches_checkpoint", "checkpoint_features_supported",
                            "checkpoint_dtype_supported", "ports_distinct", "server_port_free",
                            "cuda_mps_daemon_installed",  # tests/unit/test_host_switches.py
                            "keys_have_effect",  # tests/unit/test_rules_effect.py
                            "checkpoint_path_local", "checkpoint_has_lm_head",  # tests/unit/test_checkpoint_rules.py
                            "generate_needs_lm_head", "score_head_supported",  # tests/unit/test_score_model.py
                            "metrics_port_free",  # tests/integration/test_tgi_api.py
                            "checkpoint_quantization_supported",  # tests/unit/test_quant_rules.py
                            "gguf_family_served", "rope_scaling_supported",  # tests/unit/test_model_families.py
                            "embed_pooling_served"}  # tests/unit/test_embeddings.py
    assert {r.name for r in rules.RULES} == tested


def assert_only(violations, rule):
    assert violations, f"{rule} did not fire"
    assert {v.rule for v in violations} == {rule}, [v.message for v in violations]
    for v in violations:
        for key in v.keys:
            assert key in v.message, (key, v.message)  # the message names every key it is about
    return violations


CASES = [(rule, overrides) for rule, cases in BREAKS.items() for overrides in cases]


@pytest.mark.parametrize("rule,overrides", CASES, ids=[f"{r}:{' '.join(o)}" for r, o in CASES])
def test_each_rule_fires_alone(resolved, rule, overrides):
    assert_only(rules.check_all(resolved(*overrides)), rule)


def test_messages_give_values_and_ranges(resolved):
    [v] = rules.check_all(resolved("cache.mem_fraction=1.5"))
    assert "cache.mem_fraction=1.5" in v.message and "(0, 1)" in v.message
    # dry runs: whether 7B float32 weights fit this host is another rule's business (weights_fit_memory)
    [v] = rules.check_all(resolved("model=qwen2-7b", "model.load_format=dummy", "parallel=tp8", "model.tokenizer=null",
                                   "dry_run=true"))
    assert v.rule == "tp_splits_heads" and "28" in v.message and "parallel.tp=8" in v.message
    assert "parallel.pad_heads=true" in v.message and "4 zero heads" in v.message
    assert rules.check_all(resolved("model=qwen2-7b", "model.load_format=dummy", "parallel=tp8",
                                    "parallel.pad_heads=true", "model.tokenizer=null", "dry_run=true")) == []
    [v] = rules.check_all(resolved("model=qwen2", "model.tokenizer=null"))
    assert v.rule == "weights_need_path" and "model.path" in v.message and "qwen2-7b" in v.message


def test_gguf_needs_a_gguf_path(resolved):
    import dataclasses

    cfg = resolved()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, load_format=LoadFormat.gguf))
    [v] = rules_model.gguf_needs_gguf_path(cfg)
    assert v.keys == ("model.load_format", "model.path") and "model.path=None" in v.message


def test_a_profile_that_describes_another_checkpoint(resolved, tmp_path):
    folder = tiny_llama_folder(tmp_path / "ckpt", num_key_value_heads=2)
    violations = assert_only(rules.check_all(resolved(f"model.path={folder}", "model.load_format=auto")),
                             "profile_matches_checkpoint")
    assert [v.keys for v in violations] == [("model.num_key_value_heads", "model.path")]
    assert "says 2" in violations[0].message
    same = tiny_llama_folder(tmp_path / "same")
    assert rules.check_all(resolved(f"model.path={same}", "model.load_format=auto")) == []


def test_checkpoint_features_and_dtype(resolved, tmp_path):
    folder = tiny_llama_folder(tmp_path / "mlp_bias", mlp_bias=True)
    [v] = assert_only(rules.check_all(resolved(f"model.path={folder}", "model.load_format=auto")),
                      "checkpoint_features_supported")
    assert "mlp_bias=true" in v.message
    folder = tiny_llama_folder(tmp_path / "fp8")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"dtype": "float8_e4m3fn"}))
    cfg = resolved(f"model.path={folder}", "model.load_format=auto", "model.dtype=auto", "device=cuda", "dry_run=true")
    [v] = assert_only(rules.check_all(cfg), "checkpoint_dtype_supported")
    assert "float8_e4m3fn" in v.message


def test_ports_must_be_distinct_and_free(resolved, free_port):
    assert_only(rules.check_all(resolved("mode=pd_master", f"mode.pd_master_port={free_port}")), "ports_distinct")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        [v] = assert_only(rules.check_all(resolved(f"server.port={port}")), "server_port_free")
        assert str(port) in v.message
        assert rules.check_all(resolved(f"server.port={port}", "dry_run=true")) == []  # plans for elsewhere
    assert rules.check_all(resolved("server.port=0")) == []  # any free port, chosen at launch


def test_dry_run_lists_what_waits_for_model_path(resolved):
    cfg = resolved("model=qwen2", "parallel=tp8", "mode=pd_decode", "dry_run=true", "model.tokenizer=null")
    assert rules.check_all(cfg) == []
    waiting = {p.rule: p for p in rules.pending(cfg)}
    assert {"tp_splits_heads", "context_within_model"} <= set(waiting)
    assert "model.num_attention_heads" in waiting["tp_splits_heads"].keys
    assert "model.path" in waiting["tp_splits_heads"].reason
    assert {"gpus_available", "server_port_free"} <= {p.rule for p in rules.pending(cfg) if "dry run" in p.reason}
    [w] = rules.warnings(cfg)
    assert w.rule == "weights_need_path"
    live = resolved("model=qwen2", "parallel=tp8", "mode=pd_decode", "model.tokenizer=null")
    assert [v.rule for v in rules.check_all(live)] == ["weights_need_path"]
    assert rules.warnings(live) == []


def test_dry_run_warns_about_a_missing_checkpoint(resolved):
    cfg = resolved("model=smollm2-135m", "model.path=/no/such/smollm2", "dry_run=true")
    assert rules.check_all(cfg) == []
    assert [w.rule for w in rules.warnings(cfg)] == ["weights_need_path"]


def test_server_port_rule_only_binds_on_node_0():
    import socket

    from llaunch.launcher import rules
    from llaunch.runtime.config import LlaunchConfig, ParallelConfig, ServerConfig

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        node0 = LlaunchConfig(server=ServerConfig(port=port), parallel=ParallelConfig(nnodes=2, node_rank=0))
        node1 = LlaunchConfig(server=ServerConfig(port=port), parallel=ParallelConfig(nnodes=2, node_rank=1))
        assert list(rules.server_port_free(node0))
        assert not list(rules.server_port_free(node1))


def test_a_config_server_does_not_bind_server_port(resolved):
    import socket as sock

    with sock.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert [v.rule for v in rules.check_all(resolved(f"server.port={taken}"))] == ["server_port_free"]
        assert rules.check_all(resolved("mode=config_server", f"server.port={taken}")) == []
        assert rules.check_all(resolved("mode=config_server", "server.port=60088")) == []  # its own port

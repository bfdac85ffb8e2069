"""The start-up rules of the encoder servers of multimodal models (the visual group; audio models: the
audio group, runtime/encoder_servers.py): their count, batch and GPUs, the group that matches the model,
and the deployments where their shared-memory embed cache reaches every worker."""
from __future__ import annotations

from llaunch.launcher.rule_registry import rule
from llaunch.runtime.config import AudioConfig, Device, Mode, VisualConfig
from llaunch.runtime.encoder_servers import multimodal

SERVER_KEYS = ("dp", "batch_size", "devices", "embed_cache_mib")  # in both groups, same meaning
WHAT = {"visual": "images", "audio": "clips"}


@rule()
def visual_settings_valid(cfg):
    for kind, g in (("visual", cfg.visual), ("audio", cfg.audio)):
        if g.dp < 1:
            yield (f"{kind}.dp",), f"{kind}.dp={g.dp}: give the number of {kind} server processes (>= 1)"
        if g.batch_size < 1:
            yield (f"{kind}.batch_size",), f"{kind}.batch_size={g.batch_size}: give the {WHAT[kind]} per encode (>= 1)"
        if g.embed_cache_mib < 1:
            yield (f"{kind}.embed_cache_mib",), (f"{kind}.embed_cache_mib={g.embed_cache_mib}: the embed cache holds "
                                                 "the embeddings every request reads; give at least 1 MiB")


@rule()
def visual_devices_valid(cfg):
    for kind, g, tp in (("visual", cfg.visual, cfg.visual.tp), ("audio", cfg.audio, 1)):
        if g.devices is None:
            continue
        if cfg.device == Device.cpu:
            yield (f"{kind}.devices", "device"), (f"{kind}.devices names GPUs, but device=cpu: leave {kind}.devices "
                                                  f"null (the {kind} servers run on the CPU)")
        elif len(g.devices) != g.dp * tp or min(g.devices, default=0) < 0:
            keys = (f"{kind}.devices", f"{kind}.dp") + (("visual.tp",) if kind == "visual" else ())
            per = "visual.dp × visual.tp of them, server by server" if kind == "visual" else "audio.dp of them"
            yield keys, (f"{kind}.devices={list(g.devices)} with " + ", ".join(f"{k}={v}" for k, v in
                         zip(keys[1:], (g.dp, tp))) + f": give one GPU index (>= 0) per {kind} process ({per})")


@rule()
def encoder_group_matches_model(cfg):
    """An audio model's servers read audio.*, a vision model's visual.*: the other group's keys would be ignored."""
    if cfg.model.audio and not cfg.model.vision:
        used, other, default = "audio", cfg.visual, VisualConfig()
    elif cfg.model.vision and not cfg.model.audio:
        used, other, default = "visual", cfg.audio, AudioConfig()
    else:
        if not cfg.model.vision and not cfg.model.audio:  # a text model runs no encoder server
            for group, values, default in (("visual", cfg.visual, VisualConfig()), ("audio", cfg.audio, AudioConfig())):
                for k in SERVER_KEYS:
                    if getattr(values, k) != getattr(default, k):
                        yield (f"{group}.{k}", "model"), (
                            f"{group}.{k} is set, but the model takes no images or audio (no model.vision or "
                            f"model.audio), so no encoder server runs: leave {group}.{k} at its default")
        return
    unused = "visual" if used == "audio" else "audio"
    model = "an audio model (model.audio)" if used == "audio" else "a vision model (model.vision)"
    for k in SERVER_KEYS:
        value = getattr(other, k)
        if value != getattr(default, k):
            shown = list(value) if k == "devices" else value
            yield (f"{unused}.{k}",), (f"{unused}.{k}={shown} with {model}: its encoder servers read {used}.*; "
                                       f"set {used}.{k}={shown} instead")


@rule()
def visual_tp_valid(cfg):
    """visual.tp splits the vision tower's heads and MLP over visual.tp processes, each on its own GPU."""
    v, p = cfg.visual, cfg.parallel
    if v.tp < 1:
        yield ("visual.tp",), f"visual.tp={v.tp}: give the processes of one visual server (>= 1)"
        return
    if v.tp == 1:
        return
    if not multimodal(cfg):  # no visual server runs: the setting would be silently ignored
        yield ("visual.tp", "model.vision"), (
            f"visual.tp={v.tp} with a text-only model (no model.vision): there is no vision tower to split; "
            "use visual.tp=1")
        return
    if cfg.model.audio:
        yield ("visual.tp", "model.audio", "audio.dp"), (
            f"visual.tp={v.tp} with an audio model (model.audio): the audio tower is not split over processes; "
            "use visual.tp=1 (and audio.dp for more audio servers)")
    elif cfg.model.vision:
        heads, e = cfg.model.vision["num_heads"], cfg.model.vision["embed_dim"]
        hidden = cfg.model.vision.get("intermediate_size") or int(e * float(cfg.model.vision.get("mlp_ratio", 4)))
        if heads % v.tp or hidden % v.tp:
            yield ("visual.tp",), (f"visual.tp={v.tp} does not divide the vision tower's {heads} attention heads "
                                   f"and {hidden} MLP features: give a divisor of both")
    if cfg.device == Device.cuda:
        per_node = max(p.tp * p.dp // max(p.nnodes, 1), 1)
        replicas = [v.devices[i * v.tp:(i + 1) * v.tp] for i in range(v.dp)] if v.devices else []
        if v.devices is None and v.tp > per_node:
            yield ("visual.tp", "visual.devices"), (
                f"visual.tp={v.tp} but the workers use {per_node} GPUs, which visual.devices=null shares out: a "
                "visual server's ranks need distinct GPUs; list visual.dp × visual.tp GPUs in visual.devices")
        elif any(len(set(r)) != len(r) for r in replicas):
            yield ("visual.tp", "visual.devices"), (
                f"visual.devices={list(v.devices)} gives one visual server (visual.tp={v.tp} consecutive entries) "
                "the same GPU twice: NCCL needs a distinct GPU per rank")


@rule()
def visual_deployment_supported(cfg):
    if not multimodal(cfg):
        return
    if cfg.parallel.nnodes > 1:
        yield ("parallel.nnodes",), (
            f"a multimodal model with parallel.nnodes={cfg.parallel.nnodes}: the visual servers' embed cache is "
            "shared memory on node 0, which other nodes' workers cannot read; serve it on one node")
    if cfg.mode.kind in (Mode.pd_prefill, Mode.pd_decode):
        yield ("mode.kind",), (
            f"a multimodal model with mode.kind={cfg.mode.kind.value}: images are served by mode.kind=normal "
            "instances only (prefill/decode disaggregation does not carry image embeddings yet)")


@rule()
def audio_limits_valid(cfg):
    a = cfg.audio
    if not 0 < a.max_clip_seconds <= 30:
        yield ("audio.max_clip_seconds",), (f"audio.max_clip_seconds={a.max_clip_seconds}: give a duration in (0, 30] "
                                            "(Qwen2-Audio's encoder reads at most 30 s of a clip)")
    if a.max_clip_bytes < 1:
        yield ("audio.max_clip_bytes",), f"audio.max_clip_bytes={a.max_clip_bytes}: give at least 1 byte"
    if a.max_clips_per_request < 1:
        yield ("audio.max_clips_per_request",), (f"audio.max_clips_per_request={a.max_clips_per_request}: give at "
                                                 "least 1 clip per request")

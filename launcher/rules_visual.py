"""The start-up rules of the visual servers (the visual group, multimodal models): their count, batch
and GPUs, and the deployments where their shared-memory embed cache reaches every worker."""
from __future__ import annotations

from llaunch.launcher.rule_registry import rule
from llaunch.runtime.config import Device, Mode


def multimodal(cfg) -> bool:
    return bool(cfg.model.vision or cfg.model.audio)  # Qwen2-Audio: the visual servers encode its clips


@rule()
def visual_settings_valid(cfg):
    v = cfg.visual
    if v.dp < 1:
        yield ("visual.dp",), f"visual.dp={v.dp}: give the number of visual server processes (>= 1)"
    if v.batch_size < 1:
        yield ("visual.batch_size",), f"visual.batch_size={v.batch_size}: give the images per encode (>= 1)"
    if v.embed_cache_mib < 1:
        yield ("visual.embed_cache_mib",), (f"visual.embed_cache_mib={v.embed_cache_mib}: the embed cache holds "
                                            "the embeddings every request reads; give at least 1 MiB")


@rule()
def visual_devices_valid(cfg):
    v = cfg.visual
    if v.devices is None:
        return
    if cfg.device == Device.cpu:
        yield ("visual.devices", "device"), ("visual.devices names GPUs, but device=cpu: leave visual.devices "
                                             "null (the visual servers run on the CPU)")
    elif len(v.devices) != v.dp * v.tp or min(v.devices, default=0) < 0:
        yield ("visual.devices", "visual.dp", "visual.tp"), (
            f"visual.devices={list(v.devices)} with visual.dp={v.dp}, visual.tp={v.tp}: give one GPU index (>= 0) "
            "per visual process (visual.dp × visual.tp of them, server by server)")


@rule()
def visual_tp_valid(cfg):
    """visual.tp splits the vision tower's heads and MLP over visual.tp processes, each on its own GPU."""
    v, p = cfg.visual, cfg.parallel
    if v.tp < 1:
        yield ("visual.tp",), f"visual.tp={v.tp}: give the processes of one visual server (>= 1)"
        return
    if v.tp == 1 or not multimodal(cfg):
        return
    if cfg.model.audio:
        yield ("visual.tp", "model.audio"), (f"visual.tp={v.tp} with an audio model (model.audio): the audio tower "
                                             "is not split over processes; use visual.tp=1 (and visual.dp for more)")
    elif cfg.model.vision:
        heads, e = cfg.model.vision["num_heads"], cfg.model.vision["embed_dim"]
        hidden = int(e * float(cfg.model.vision.get("mlp_ratio", 4)))
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

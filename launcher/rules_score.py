"""The start-up rules of score models (model.task=score, LightLLM's use_reward_model): the checkpoint
must carry the head the task needs, and the modes that split a request between instances do not score."""
from __future__ import annotations

from llaunch.launcher.rule_registry import rule
from llaunch.launcher.rules_model import serves
from llaunch.runtime.config import LoadFormat, Mode, ModelTask
from llaunch.runtime.models.checkpoint import read_checkpoint

# remote-code heads implemented here (runtime/models/decoder.py RewardHead); Qwen2ForProcessRewardModel
# pools every step's token, not one score per sequence: not served
SERVED_HEADS = ("Qwen2ForRewardModel",)
PD_MODES = (Mode.pd_prefill, Mode.pd_decode, Mode.pd_master)


def _checkpoint(cfg):
    m = cfg.model
    return read_checkpoint(m.path) if m.path and m.load_format != LoadFormat.dummy else None


@rule()
def score_needs_head(cfg):
    m = cfg.model
    if m.task != ModelTask.score or not serves(cfg):
        return
    ckpt = _checkpoint(cfg)
    if ckpt is not None and not ckpt.score_head:
        yield ("model.task", "model.path"), (
            f"model.task=score but model.path={m.path} has no score head (config.json architectures="
            f"{ckpt.architectures}): serve a *ForSequenceClassification checkpoint, or set model.task=generate")
    elif ckpt is None and m.num_labels is None:
        yield ("model.task", "model.num_labels"), (
            "model.task=score needs the head's size: set model.num_labels (dummy weights) or serve a "
            "*ForSequenceClassification checkpoint")


@rule()
def generate_needs_lm_head(cfg):
    ckpt = _checkpoint(cfg)
    if cfg.model.task == ModelTask.generate and serves(cfg) and ckpt is not None and ckpt.score_head:
        yield ("model.task", "model.path"), (
            f"model.task=generate but model.path={cfg.model.path} is a {ckpt.score_head}: it has a score head, "
            "no LM head to sample from; set model.task=score (or auto)")


@rule()
def score_head_supported(cfg):
    ckpt = _checkpoint(cfg)
    head = ckpt.score_head if ckpt is not None and cfg.model.task == ModelTask.score else None
    if head and head not in SERVED_HEADS and not head.endswith("ForSequenceClassification"):
        yield ("model.task", "model.path"), (
            f"model.path={cfg.model.path} is a {head}, whose head llaunch does not implement (it serves "
            f"*ForSequenceClassification and {', '.join(SERVED_HEADS)}); serve one of those")


@rule()
def score_labels_match(cfg):
    m = cfg.model
    if m.task != ModelTask.score:
        return
    if m.num_labels is not None and m.num_labels < 1:
        yield ("model.num_labels",), f"model.num_labels={m.num_labels}: a score head has at least one output"
    elif m.labels is not None and m.num_labels is not None and len(m.labels) != m.num_labels:
        yield ("model.labels", "model.num_labels"), (
            f"model.labels has {len(m.labels)} names for model.num_labels={m.num_labels} outputs: give one name "
            "per output, or leave model.labels unset")


@rule()
def score_not_in_pd_modes(cfg):
    if cfg.model.task == ModelTask.score and cfg.mode.kind in PD_MODES:
        yield ("model.task", "mode.kind"), (
            f"model.task=score with mode.kind={cfg.mode.kind.value}: scoring is one prefill with no decode, "
            "nothing to split between prefill and decode instances; serve it with mode=normal")

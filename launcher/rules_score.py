"""The start-up rules of models that prefill and return no tokens: score models (model.task=score, LightLLM's
use_reward_model; a yes/no reranker, model.score_head=yes_no) and embedding models (model.task=embed). The
checkpoint must carry the head the task needs, an embedding checkpoint must ask for pooling llaunch computes, and
the modes that split a request between instances serve neither."""
from __future__ import annotations

from llaunch.launcher.rule_registry import rule
from llaunch.launcher.rules_effect import shown
from llaunch.launcher.rules_model import serves
from llaunch.runtime.config import LoadFormat, Mode, ModelTask, ScoreHead
from llaunch.runtime.models.checkpoint import is_gguf, read_checkpoint
from llaunch.runtime.models.pooling_config import embedding_facts

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
    if m.score_head == ScoreHead.yes_no:  # the LM head's rows: a causal LM's checkpoint
        if ckpt is not None and ckpt.score_head:
            yield ("model.score_head", "model.path"), (
                f"model.score_head=yes_no reads two rows of an LM head, but model.path={m.path} is a "
                f"{ckpt.score_head} (a score head, no LM head): leave model.score_head unset to serve its own head")
        return
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
    task = cfg.model.task
    if task in (ModelTask.score, ModelTask.embed) and cfg.mode.kind in PD_MODES:
        what = "scoring" if task == ModelTask.score else "embedding"
        yield ("model.task", "mode.kind"), (
            f"model.task={task.value} with mode.kind={cfg.mode.kind.value}: {what} is one prefill with no decode, "
            "nothing to split between prefill and decode instances; serve it with mode=normal")


@rule()
def yes_no_tokens_known(cfg):
    m = cfg.model
    if m.task != ModelTask.score or m.score_head != ScoreHead.yes_no or not serves(cfg):
        return
    ids = m.score_token_ids
    if ids is None:
        yield ("model.score_token_ids", "model.tokenizer"), (
            f"model.score_head=yes_no needs the ids of its yes and no tokens, and the tokenizer "
            f"({m.tokenizer or m.path}) has no tokenizer.json entries 'yes' and 'no' to take them from; set "
            "model.score_token_ids=[YES_ID,NO_ID]")
    elif len(ids) != 2 or ids[0] == ids[1] or not all(0 <= t < (m.vocab_size or 2**62) for t in ids):
        yield ("model.score_token_ids",), (
            f"model.score_token_ids={shown(ids)}: give two different token ids, [yes, no], below model.vocab_size="
            f"{m.vocab_size}")


@rule()
def embed_pooling_served(cfg):
    m = cfg.model
    if m.task != ModelTask.embed or not serves(cfg) or m.load_format == LoadFormat.dummy or not m.path \
            or is_gguf(m.path):
        return
    facts = embedding_facts(m.path)
    if facts is None:
        return
    if m.pooling is None and facts.unserved_pooling:
        yield ("model.pooling", "model.path"), (
            f"model.path={m.path}: its sentence-transformers Pooling module asks for {facts.unserved_pooling}, "
            "which llaunch does not compute (it pools last, mean or cls); set model.pooling to serve it pooled "
            "that way instead, or serve another checkpoint")
    if facts.unserved_modules:
        yield ("model.task", "model.path"), (
            f"model.path={m.path}: its modules.json has {', '.join(facts.unserved_modules)}, which llaunch does "
            "not apply after pooling, so its embeddings would not be the model's; serve a checkpoint whose modules "
            "are Transformer, Pooling and Normalize")


@rule()
def embed_matryoshka_consistent(cfg):
    m = cfg.model
    if m.task != ModelTask.embed or not m.matryoshka_dimensions:
        return
    if m.matryoshka is False:
        yield ("model.matryoshka", "model.matryoshka_dimensions"), (
            f"model.matryoshka=false with model.matryoshka_dimensions={shown(m.matryoshka_dimensions)}: the sizes "
            "are served only for a Matryoshka-trained model; set model.matryoshka=true, or drop the sizes")
    bad = [d for d in m.matryoshka_dimensions if not 1 <= d <= (m.hidden_size or 2**62)]
    if bad:
        yield ("model.matryoshka_dimensions",), (
            f"model.matryoshka_dimensions={shown(m.matryoshka_dimensions)}: {shown(bad)} outside 1..model.hidden_size="
            f"{m.hidden_size}; an embedding is at most the hidden state's width")

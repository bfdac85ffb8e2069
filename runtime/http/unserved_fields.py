"""Fields the OpenAI, vLLM and LightLLM APIs define that llaunch cannot honour: set to anything but
their "off" value, each is a 400 that says why (never silently ignored). Fields accepted without
effect are listed where the request structs declare them (runtime/http/openai_protocol.py)."""
from __future__ import annotations

from typing import Any, Callable

from llaunch.runtime.web.errors import bad_request

# field → (is it asked for?, why it cannot be served)
_OPENAI: dict[str, tuple[Callable[[Any], bool], str]] = {
    "use_beam_search": (bool, "beam search is not implemented"),
    "length_penalty": (lambda v: v is not None and v != 1.0, "it weighs beam search's candidates; beam search "
                                                             "is not implemented"),
    "logits_processors": (bool, "the server runs no request-supplied code"),
    "cache_salt": (lambda v: v is not None, "the prompt cache is shared by every request; it cannot be salted "
                                            "per request"),
    "kv_transfer_params": (bool, "llaunch's prefill/decode disaggregation moves KV through its pd_master "
                                 "(mode=pd_master), not through request parameters"),
    "vllm_xargs": (bool, "no custom extensions are installed"),
    "guided_whitespace_pattern": (lambda v: v is not None, "xgrammar's JSON grammar takes no whitespace pattern"),
    "prompt_embeds": (lambda v: v is not None, "prompts are text or token ids; embeddings are not taken"),
    "audio": (lambda v: v is not None, "the served models output text only"),
    "modalities": (lambda v: bool(v) and any(m != "text" for m in v), "the served models output text only"),
    "web_search_options": (lambda v: v is not None, "the server searches nothing"),
    "moderation": (lambda v: v is not None, "no moderation model is served"),
    "mm_processor_kwargs": (bool, "the image processor's settings are the model's (visual.*)"),
    "media_io_kwargs": (bool, "media are decoded with the server's settings (visual.*, audio.*)"),
}
_CHAT_ONLY = {"token_healing": (bool, "a chat prompt ends with the template's assistant header, which is never healed "
                                      "(completions and /generate heal)")}


def refuse_unserved(req) -> None:
    """A 400 for the first field of an OpenAI-shaped request that asks for what is not served."""
    for name, (asked, why) in {**_OPENAI, **(_CHAT_ONLY if hasattr(req, "messages") else {})}.items():
        value = getattr(req, name, None)
        if value is not None and asked(value):
            raise bad_request(f"`{name}` is not supported: {why}.", param=name)
    if req.logit_bias is not None and not isinstance(req.logit_bias, dict):
        raise bad_request("`logit_bias` must map token ids to biases ({\"123\": -100}); a list (TGI's form, "
                          "which TGI itself ignores) names no tokens.", param="logit_bias")
    if getattr(req, "suffix", None):
        raise bad_request("`suffix` is not supported: the served models have no fill-in-the-middle format.",
                          param="suffix")


# LightLLM's /generate parameters that need what llaunch does not do
def refuse_unserved_lightllm(p) -> None:
    if p.exponential_decay_length_penalty not in (None, [1, 1.0]):
        raise bad_request("`parameters.exponential_decay_length_penalty` is not supported: the sampler applies no "
                          "length-dependent eos bias.", param="parameters.exponential_decay_length_penalty")
    for name in ("group_request_id", "move_kv_to_decode_node"):
        if getattr(p, name) is not None:
            raise bad_request(f"`parameters.{name}` is not supported: it is internal to LightLLM's pd_master; "
                              "llaunch's (mode=pd_master) pairs instances itself.", param=f"parameters.{name}")
    penalties = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    if (p.input_penalty is True and (penalties or p.repetition_penalty != 1.0)) or (
            p.input_penalty is False and p.repetition_penalty != 1.0):
        raise bad_request("`parameters.input_penalty` is not supported: llaunch's penalties follow vLLM (the "
                          "repetition penalty counts the prompt and the output, presence and frequency penalties the "
                          "output only); leave it unset.", param="parameters.input_penalty")

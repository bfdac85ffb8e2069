"""Prompt logprobs in each API's shape: OpenAI completions' `echo` + `logprobs` (the prompt's tokens
lead the legacy parallel lists, the first with a null logprob), vLLM's `prompt_logprobs` (null, then
{token id: {logprob, rank, decoded_token}} per token) and LightLLM's /generate `prompt_logprobs`
([token, {next token: logprob}] per token but the last) with `prompt_token_ids`."""
from __future__ import annotations

from typing import Optional

from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.ipc.messages import PromptLogprobs


def echo_logprobs(prompt_ids: list[int], lp: PromptLogprobs, top: int, tokenizer: PromptTokenizer) -> dict:
    """The legacy completions logprobs of the echoed prompt; text_offset counts from 0."""
    tokens, offsets, offset = [], [], 0
    for token_id in prompt_ids:
        text = tokenizer.token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    tops: list[Optional[dict]] = [None]
    for i in range(len(prompt_ids) - 1):
        ids = lp.top_ids[i][:top] if i < len(lp.top_ids) else []
        vals = lp.top_logprobs[i][:top] if i < len(lp.top_logprobs) else []
        tops.append({tokenizer.token_text(t): v for t, v in zip(ids, vals)})
    return {"tokens": tokens, "token_logprobs": [None, *lp.logprobs], "top_logprobs": tops, "text_offset": offsets}


def echo_text_length(prompt_ids: list[int], tokenizer: PromptTokenizer) -> int:
    """Where the output's text_offset starts after an echoed prompt (its tokens' texts)."""
    return sum(len(tokenizer.token_text(t)) for t in prompt_ids)


def vllm_prompt_logprobs(prompt_ids: list[int], lp: PromptLogprobs, top: int,
                         tokenizer: PromptTokenizer) -> list[Optional[dict]]:
    """vLLM's: each prompt token's entry holds the token itself and the `top` most likely ones."""
    out: list[Optional[dict]] = [None]
    for i, token_id in enumerate(prompt_ids[1:]):
        entry = {str(token_id): _vllm_entry(lp.logprobs[i], lp.ranks[i], token_id, tokenizer)}
        ids = lp.top_ids[i][:top] if i < len(lp.top_ids) else []
        vals = lp.top_logprobs[i][:top] if i < len(lp.top_logprobs) else []
        for rank, (t, v) in enumerate(zip(ids, vals), start=1):
            entry.setdefault(str(t), _vllm_entry(v, rank, t, tokenizer))
        out.append(entry)
    return out


def _vllm_entry(logprob: float, rank: int, token_id: int, tokenizer: PromptTokenizer) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.token_text(token_id)}


def lightllm_prompt_logprobs(prompt_ids: list[int], lp: PromptLogprobs) -> list[list]:
    """LightLLM's (return_all_prompt_logprobs): [token i, {token i+1: its logprob}] for each i."""
    return [[prompt_ids[i], {str(prompt_ids[i + 1]): lp.logprobs[i]}] for i in range(len(prompt_ids) - 1)]

"""A request as the router sees it: vLLM's single scheduling model, where `num_computed` (tokens
whose KV is cached) catches up with `num_tokens`; chunked prefill and decode are the same thing."""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Optional

from llaunch.runtime.ipc.messages import AddRequest, SamplingParams

if TYPE_CHECKING:
    from llaunch.runtime.cache.prefix_tree import Node


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    TRANSFER = "transfer"  # prefill/decode disaggregation: its prompt KV is being sent or received
    FINISHED = "finished"


class Request:
    __slots__ = ("id", "frontend", "prompt_ids", "sampling", "arrival_time", "status", "row", "slots",
                 "num_computed", "num_planned", "steps_in_flight", "output_ids", "finish_reason", "num_cached",
                 "prefix_node", "pd", "kv_ready", "scheduled_time", "images", "prefix_keys", "priority",
                 "pools_prompt", "lookup_ids")

    def __init__(self, msg: AddRequest, sampling: SamplingParams, pools_prompt: bool = False):
        self.id = msg.request_id
        self.frontend = msg.frontend
        self.prompt_ids = msg.prompt_ids
        self.sampling = sampling
        self.arrival_time = msg.arrival_time
        self.status = Status.WAITING
        self.row: Optional[int] = None
        self.slots: list[int] = []  # KV slots of tokens [0, num_computed) in position order
        self.num_computed = 0
        self.num_planned = 0  # output tokens planned: known ones plus those of steps in flight
        self.steps_in_flight = 0  # planned steps that use this request and have not returned
        self.output_ids: list[int] = []
        self.finish_reason: Optional[str] = None
        self.num_cached = 0  # leading tokens whose KV the prompt cache lent: slots[:num_cached] are its
        self.prefix_node: Optional[Node] = None  # where that prefix ends in the tree (locked while held)
        self.pd = msg.pd  # the pd_master's transfer id (and the decode instance's KV address on a prefill one)
        self.kv_ready = False  # decode instance: the prompt's KV but its last token arrived; waits for a row
        self.scheduled_time = 0.0  # when it got its row (wall clock, as the frontend stamps arrival)
        self.images = msg.images  # multimodal: handed to the worker with the request's row
        self.prefix_keys = None  # cache.dp_fetch: the prompt's token keys (runtime/cache/prefix_keys.py), hashed once
        self.priority = msg.priority  # vLLM's: lower values are admitted first
        self.pools_prompt = pools_prompt  # an embedding model's mean / CLS pooling reads every prompt position
        # what spec=ngram searches before the output: the prompt, then a predicted output (later, so its matches win)
        self.lookup_ids = msg.prompt_ids + msg.prediction_ids if msg.prediction_ids else msg.prompt_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def reads_whole_prompt(self) -> bool:
        """Every prompt position's output is read (prompt logprobs; an embedding's mean or CLS pooling), so the
        request computes its whole prompt: no cached prefix stands in for part of it."""
        return self.sampling.prompt_logprobs >= 0 or self.pools_prompt

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens

    @property
    def peak_tokens(self) -> int:
        """KV slots this request holds at its longest: prompt + every output token but the last."""
        return self.prompt_len + self.max_new_tokens - 1

    def __repr__(self) -> str:
        return f"Request({self.id}, {self.status.value}, row={self.row}, computed={self.num_computed}/{self.num_tokens})"

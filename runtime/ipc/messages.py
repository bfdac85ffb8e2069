"""Every message that crosses a process boundary, named by direction.

frontend ──AddRequest/AbortRequest/FlushCache/Profile──▶ router ──StepPlan/Profile──▶ worker ──StepResult/WorkerReady──▶ router
router ──RequestOpened/TokenBatch/RouterStats──▶ detokenizer ──TextBatch/MetricsSnapshot──▶ frontend
every process ──ProcessReady──▶ launcher

msgspec Structs (array_like, omit_defaults): compact on the wire, and each socket decodes exactly the
union it expects, so a stray message fails loudly. No pickle.
"""
from __future__ import annotations

from typing import Optional, Union

import msgspec


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class Constraint(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Structured output: what every sampled token must keep the text within (runtime/constrained/)."""

    kind: str  # json_schema | json_object | regex | grammar (EBNF) | structural_tag (JSON)
    spec: str = ""


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    seed: Optional[int] = None  # None: the router draws one, so every sample has a seed
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    stop: list[str] = []  # stop strings: handled by the detokenizer, not returned
    include_stop_str_in_output: bool = False  # but the one that ended the text is returned (vLLM's field; TGI's way)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = False  # added tokens stand apart by a space (a slow tokenizer's decode)
    stop_token_text: bool = True  # the text of the eos / stop token that ended the output is part of it
    logprobs: bool = False  # return the chosen token's logprob
    top_logprobs: int = 0  # and this many most likely alternatives
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one's probability
    min_tokens: int = 0  # eos and stop_token_ids cannot be sampled before this many tokens
    bias_ids: list[int] = []  # logit_bias: these tokens' logits get bias_values added
    bias_values: list[float] = []
    banned_ids: list[int] = []  # never sampled (bad words of one token)
    banned_sequences: list[list[int]] = []  # the last token of each is never sampled after the others
    allowed_ids: list[int] = []  # when set, only these tokens are sampled (LightLLM's allowed_token_ids)
    heal_ids: list[int] = []  # token healing: when set, the first token is sampled only from these
    heal_text: str = ""  # token healing: the backed-off text, which the detokenizer leaves out of the output
    constraint: Optional[Constraint] = None
    prompt_logprobs: int = -1  # -1: none; 0: each prompt token's logprob (and rank); k: plus the top k

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def masked(self) -> bool:
        """Some tokens are excluded at some steps: the sampled token is not the raw argmax."""
        return bool(self.constraint or self.banned_ids or self.banned_sequences or self.allowed_ids or self.heal_ids
                    or self.min_tokens or self.bias_ids or self.min_p > 0.0)


# ---- frontend → router -------------------------------------------------------------------------


class PdLink(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """A request the pd_master split: `id` names its KV transfer on both instances. A prefill
    instance sends the prompt's KV to `decode_kv`; a decode instance receives it (decode_kv None)."""

    id: str
    decode_kv: Optional[str] = None


class ImageRef(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """An image of a prompt (runtime/http/images.py): its tokens are prompt[offset : offset + tokens],
    each the id vocab_size + its content hash's low bits (so the prompt cache keys on the image)."""

    hash: str  # sha256 of the image's pixel values: the embed cache's key
    offset: int
    grid: list[int]  # (t, h, w) in patches, before the 2x2 merge
    pixels: bytes = b""  # float32 pixel values [t*h*w, C*T*P*P] (the image processor's)
    replica: int = 0  # the visual server (runtime/encoder/) whose embed cache holds its embeddings
    blocks: list[int] = []  # where: that cache's blocks, in order (runtime/cache/embed_shm.py)


class AddRequest(_Msg):
    request_id: str  # unique across frontends: "<frontend index>-<counter>"
    frontend: int  # which frontend worker gets the text back
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival_time: float  # time.time() at the frontend, for TTFT / e2e latency
    pd: Optional[PdLink] = None  # set on pd_prefill / pd_decode instances for the master's requests
    images: list[ImageRef] = []  # multimodal models: the prompt's images
    priority: int = 0  # vLLM's: the router admits lower values first, in arrival order within one
    # OpenAI's predicted output (a chat request's `prediction`), tokenized: text the answer is expected to repeat,
    # which spec=ngram's lookup searches as it searches the prompt
    prediction_ids: list[int] = []


class AbortRequest(_Msg):
    request_id: str


class FlushCache(_Msg):
    """Evict every prompt-cache entry no running request holds (POST /flush_cache)."""


class Profile(_Msg):
    """Start or stop every worker's torch.profiler between steps (POST /start_profile, /stop_profile; each
    writes its trace and kernel table under server.profile_dir). The router passes it on in step order."""

    start: bool
    num_steps: int = 0  # start: stop by itself after this many steps (0: at the next stop)
    activities: list[str] = []  # "CPU" and / or "GPU" ([]: both, GPU where the worker has one)
    record_shapes: bool = False
    with_stack: bool = False


RouterInbound = Union[AddRequest, AbortRequest, FlushCache, Profile]

# ---- router → worker ---------------------------------------------------------------------------


class NewSeq(_Msg):
    """A request the worker has not seen: its sampling state is set up in `row`."""

    row: int  # index into the worker's per-request tables (< router.max_running_requests)
    request_id: str
    sampling: SamplingParams
    prompt_ids: list[int]  # for repetition/presence penalties over the prompt
    cached_slots: list[int] = []  # KV slots of prompt tokens [0, len) reused from the prompt cache
    images: list[ImageRef] = []  # AddRequest.images


class PrefillChunk(_Msg):
    row: int
    token_ids: list[int]
    start: int  # position of token_ids[0]; tokens [0, start) are already in the KV cache
    slots: list[int]  # KV cache slots for these tokens, one each
    sample: bool  # last chunk of the prompt: sample the first output token


class KvMove(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Host KV tier (cache.cpu_tokens): copy K and V of every layer, gpu_slots[i] ↔ host_slots[i]."""

    to_host: bool  # True: demote (GPU pool → host pool); False: promote (host → GPU)
    gpu_slots: list[int]
    host_slots: list[int]
    replica: int = -1  # cache.dp_fetch: host_slots are in this dp replica's pool (same tp rank); -1: own


class VerifyChunk(_Msg):
    """Speculative decoding: a decode row feeds its last token and a proposal (token_ids[1:]); every
    position is sampled, and the worker keeps the longest agreeing prefix plus one token of its own."""

    row: int
    token_ids: list[int]  # the row's last sampled token, then the proposed tokens
    start: int  # position of token_ids[0]
    slots: list[int]  # one KV slot per token; the router frees those of rejected tokens


class StepPlan(_Msg):
    """One forward step. Decode rows feed the worker's own last sampled token (no round trip)."""

    step: int
    new: list[NewSeq] = []
    decode_rows: list[int] = []
    decode_slots: list[int] = []  # one new slot per decode row
    prefill: list[PrefillChunk] = []
    release_rows: list[int] = []  # requests that ended: forget their row state (before this step)
    verify: list[VerifyChunk] = []  # speculative decoding: rows verifying a proposal (runtime/router/spec_decode.py)
    kv_moves: list[KvMove] = []  # host-tier copies, applied in order before this step's forward


class Shutdown(_Msg):
    pass


# Prefill/decode disaggregation: KV of a prompt's tokens [0, n-1) moves between instances; the last
# prompt token is computed on the decode instance, which samples the first output token itself.


class SendKv(_Msg):
    """Prefill instance: send the KV in `slots` (computed by steps already returned) to `address`."""

    request_id: str
    pd_id: str
    slots: list[int]
    address: str


class ReceiveKv(_Msg):
    """Decode instance: write the KV arriving under `pd_id` into `slots`; its first `skip` tokens
    are a prefix this instance has cached already (written to scratch, not to the shared slots)."""

    request_id: str
    pd_id: str
    slots: list[int]
    skip: int = 0


class CancelKv(_Msg):
    """Decode instance: the request went away; stop writing into its slots, then report KvDone."""

    request_id: str


class PrepareConstraints(_Msg):
    """Compile these constraints now (the router holds their requests until every rank reports them
    ready, so no step waits for a grammar)."""

    constraints: list[Constraint]


WorkerInbound = Union[StepPlan, Shutdown, SendKv, ReceiveKv, CancelKv, PrepareConstraints, Profile]

# ---- worker → router ---------------------------------------------------------------------------


class PromptLogprobs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Logprobs of prompt tokens 1..n-1 (token 0 has no context), each under the model's distribution
    after the tokens before it; rides on the first output token's StepResult, TokenDelta, TextDelta."""

    logprobs: list[float]
    ranks: list[int]  # 1: the most likely token
    top_ids: list[list[int]] = []  # per token, where the request asked for a top k
    top_logprobs: list[list[float]] = []


class WorkerReady(_Msg):
    """A tp rank has loaded its shard, sized its KV cache and warmed up (graphs captured, kernels
    built): every rank sends one, and the router serves once all of its ranks have."""

    kv_slots: int  # KV capacity in tokens (smallest over ranks)
    max_running_requests: int
    tp_rank: int = 0


class StepResult(_Msg):
    """Sampled tokens, in plan order: decode rows first, then prefill chunks with sample=True."""

    step: int
    rows: list[int]
    token_ids: list[int]
    logprobs: list[float] = []  # chosen token's logprob per row (empty: nobody asked)
    top_ids: list[list[int]] = []  # per row; an empty list where not asked
    top_logprobs: list[list[float]] = []
    prompt_logprobs: list[Optional[PromptLogprobs]] = []  # per row: None where not asked (empty: nobody)
    scores: list[list[float]] = []  # a score model (model.task=score): each row's head outputs, no tokens
    forward_s: float = 0.0  # device time of the step, for the router's stats
    # Set only under router.step_trace (runtime/router/step_trace.py): when the worker began the step
    # (time.monotonic), the host time to enqueue it, and the device time from its first enqueued work
    # to its tokens (CUDA events), which together split a step's latency into host and device parts.
    started: float = 0.0
    launch_s: float = 0.0
    device_s: float = 0.0
    verified: list[list[int]] = []  # per StepPlan.verify chunk: its accepted proposal tokens, then one sampled


class KvDone(_Msg):
    """A SendKv or ReceiveKv finished (error None) or failed; after this the slots are the router's again."""

    request_id: str
    error: Optional[str] = None
    seconds: float = 0.0  # from the command to the last page acknowledged / written


class ConstraintsReady(_Msg):
    """One rank compiled these constraints (PrepareConstraints); `errors[i]` is None or why the i-th failed."""

    constraints: list[Constraint]
    errors: list[Optional[str]]


class ImagesReady(_Msg):
    """A visual server's answer to EncodeImages (runtime/ipc/encoder.py): the images' embeddings are in
    its embed cache, pinned until ReleaseImages, or `error` says why not."""

    request_id: str
    images: list[ImageRef]  # without pixels, with replica and blocks
    error: Optional[str] = None
    hits: int = 0  # of the request's images: found in the embed cache (or already being encoded)
    encoded: int = 0  # images encoded for this request


RouterResults = Union[WorkerReady, StepResult, KvDone, ConstraintsReady, ImagesReady]

# ---- router → detokenizer ----------------------------------------------------------------------


class RequestOpened(_Msg):
    request_id: str
    frontend: int
    prompt_len: int
    sampling: SamplingParams
    arrival_time: float


class TokenDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    token_ids: list[int]
    logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    # stop | length | abort | error | kv_sent (pd_prefill) | invalid (the router refused the request) |
    # overloaded (its wait queue is full) | stalled (the engine stopped stepping)
    finish_reason: Optional[str] = None
    kv_transfer_ms: float = 0.0  # pd_prefill: how long sending the KV took
    error: Optional[str] = None  # why, for invalid / overloaded / error / stalled
    cached_tokens: int = 0  # the first token's delta: prompt tokens the prefix cache served
    scores: list[float] = []  # a score model's head outputs for the prompt (its one, final delta)
    scheduled_time: float = 0.0  # the first token's delta: when the request got its row (time.time())
    prompt_logprobs: Optional[PromptLogprobs] = None  # the first token's delta, where asked


class TokenBatch(_Msg):
    deltas: list[TokenDelta]


class RouterStats(_Msg):
    time: float
    running: int
    waiting: int
    kv_used: int  # slots allocated, prompt-cache entries included
    kv_total: int
    dp_rank: int = 0
    kv_evictable: int = 0  # of kv_used: prompt-cache entries no request holds (free for admission)
    prefix_cache_tokens: int = 0  # of kv_used: slots the prompt cache holds
    prefix_cache_queries: int = 0  # since start: prompt tokens looked up in the prompt cache
    prefix_cache_hits: int = 0  # since start: of those, tokens found cached
    host_cache_hits: int = 0  # since start: of those, tokens found in the host KV tier (cache.cpu_tokens)
    host_cache_tokens: int = 0  # host-tier slots the prompt cache holds now
    host_cache_slots: int = 0  # the host tier's size (0: none)
    kv_promoted: int = 0  # since start: tokens copied host → GPU
    kv_demoted: int = 0  # since start: tokens copied GPU → host
    dp_fetched: int = 0  # since start: tokens copied from another replica's host pool (cache.dp_fetch)
    stalled: bool = False  # a step is overdue or a worker is gone (runtime/router/health.py)
    stalls: int = 0  # since start
    spec_proposed: int = 0  # since start: tokens speculative decoding proposed for verification
    spec_accepted: int = 0  # of those, tokens the model agreed with
    spec_verify_rows: int = 0  # since start: row-steps that verified a proposal
    spec_accepted_per_pos: list[int] = []  # since start: [i] = verifies that kept their proposal's i-th token
    spec_backoffs: int = 0  # since start: rows that stopped proposing for a while (their proposals kept failing)
    spec_chained: int = 0  # since start: verifies planned while the row's previous verify was out (spec.chain)
    spec_voided: int = 0  # of those, dropped: the verdict they assumed did not come
    mm_cache_queries: int = 0  # since start: images looked up in the visual servers' embed caches
    mm_cache_hits: int = 0  # of those, found there (not encoded again)
    images_encoded: int = 0  # since start: images the visual servers encoded for this replica


DetokenizerInbound = Union[RequestOpened, TokenBatch, RouterStats]

# ---- detokenizer → frontend --------------------------------------------------------------------


class TextDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    stopped_by_string: bool = False  # the frontend aborts the request at the router
    kv_transfer_ms: float = 0.0  # pd_prefill: how long sending the KV took
    error: Optional[str] = None  # TokenDelta.error
    cached_tokens: int = 0  # TokenDelta.cached_tokens
    scores: list[float] = []  # TokenDelta.scores
    prompt_logprobs: Optional[PromptLogprobs] = None  # TokenDelta.prompt_logprobs


class TextBatch(_Msg):
    deltas: list[TextDelta]


class MetricsSnapshot(_Msg):
    """Prometheus exposition text, rendered by the detokenizer (the one place that sees every
    request's timing); also the frontend's heartbeat for /health."""

    time: float
    text: str
    running: int = 0
    waiting: int = 0
    stalled_replicas: list[int] = []  # dp ranks whose router reports a stall: /health/ready fails
    # dp ranks whose router has not reported yet (its workers are still loading): /health/ready fails
    loading_replicas: list[int] = []


FrontendInbound = Union[TextBatch, MetricsSnapshot]

# ---- any process → launcher --------------------------------------------------------------------


class ProcessReady(_Msg):
    name: str
    pid: int
    info: dict[str, str] = {}


class ProcessStage(_Msg):
    """What a slow-starting process is doing now (loading weights, capturing graphs): the launcher shows it."""

    name: str
    stage: str


LauncherInbound = Union[ProcessReady, ProcessStage]

"""The Quart app: routes, API-key check, drain refusal, health and metrics. It receives its engine,
tokenizer and lifecycle, so tests serve it with a scripted engine and no other process."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from prometheus_client import CollectorRegistry, ProcessCollector
from quart import Quart, Response, request

from llaunch.runtime.config import Mode, RunConfig, UnknownFields
from llaunch.runtime.constrained.compile_pool import CompilePool
from llaunch.runtime.http.constraint_compiles import ConstraintCompiles, begin_request as begin_constraints
from llaunch.runtime.http.anthropic_api import AnthropicApi, anthropic_errors
from llaunch.runtime.http.audio import AudioInputs
from llaunch.runtime.http.images import ImageInputs
from llaunch.runtime.http.embeddings_api import EmbeddingsApi, EmbedModel, embed_model_refusal
from llaunch.runtime.http.engine_client import EngineClient, current_pd_link
from llaunch.runtime.web.errors import ApiError, draining, error_response, json_response, model_not_found
from llaunch.runtime.http.generate_api import GenerateApi
from llaunch.runtime.web.guards import gatekeeper, json_errors
from llaunch.runtime.web.lifecycle import Lifecycle
from llaunch.runtime.http.lightllm_ops import TokensApi, lightllm_server_info, token_load
from llaunch.runtime.http.openai_serving import OpenAIServing
from llaunch.runtime.http.openapi import openapi_document
from llaunch.runtime.http.profile_routes import profile_message
from llaunch.runtime.http.pd_instance import PrefillServing, link_from_headers
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.http.rerank_api import RerankApi
from llaunch.runtime.http.request_limits import RequestLimits
from llaunch.runtime.http.responses_api import ResponsesApi
from llaunch.runtime.http.score_api import GENERATION_PATHS, ScoreApi, ScoreHead, score_model_refusal
from llaunch.runtime.http.tgi_api import TgiApi, tgi_info
from llaunch.runtime.http.tokenize_api import TokenizeApi
from llaunch.runtime.web.unknown_fields import IGNORED_HEADER, begin_request, header_value, ignored_fields
from llaunch.runtime.metrics_exposition import exposition
from llaunch.runtime.models.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

_HEALTH_PATHS = ("/health", "/health/live", "/health/ready", "/healthz", "/liveness", "/readiness")  # LightLLM's too
_OPEN_PATHS = (*_HEALTH_PATHS, "/openapi.json")  # no API key needed
_DRAIN_EXEMPT = (*_HEALTH_PATHS, "/metrics")  # still answered while draining (ready then says 503)


@dataclass(frozen=True)
class FrontendSettings:
    limits: RequestLimits
    api_key: Optional[str] = None
    heartbeat_max_age_s: float = 3.0  # /health fails once the engine's MetricsSnapshot heartbeat is older
    max_body_bytes: int = 16 * 2**20
    request_timeout_s: Optional[float] = None
    score: Optional[ScoreHead] = None  # a score model (model.task=score): its head; None: a generating model
    embed: Optional[EmbedModel] = None  # an embedding model (model.task=embed); None: not one
    tgi_info: Optional[dict] = None  # server.tgi_api: /generate* speak TGI, GET /info answers this
    images: Optional[object] = None  # a multimodal model: ImageInputs (runtime/http/images.py), or AudioInputs (audio.py)
    warn_unknown_fields: bool = True  # server.unknown_fields=warn: served without them (runtime/web/unknown_fields.py)
    server_info: Optional[dict] = None  # LightLLM's GET /get_server_info (runtime/http/lightllm_ops.py)
    # structured output compiles in processes that load the tokenizer with this (picklable) factory, each
    # spec within max_constraint_compile_s (runtime/http/constraint_compiles.py); None: only the worker compiles
    grammar_tokenizer: Optional[Callable[[], Any]] = None
    max_constraint_compile_s: float = 30.0
    parse_probe_s: float = 2.0  # /health/ready fails when the request-parsing threads take longer to run a no-op
    profile_dir: Optional[str] = None  # server.profile_dir: POST /start_profile, /stop_profile (runtime/http/profile_routes.py)

    @staticmethod
    def from_run_config(cfg: RunConfig, tokenizer: PromptTokenizer, api_key: Optional[str] = None) -> "FrontendSettings":
        m = cfg.model
        max_len = m.max_model_len or m.max_position_embeddings
        if not max_len:
            raise ValueError("model.max_model_len is unset: the launcher derives it from the checkpoint")
        s = cfg.server
        limits = RequestLimits(served_name=m.name, max_model_len=max_len, vocab_size=m.vocab_size or tokenizer.vocab_size,
                               max_prompts=s.max_prompts_per_request, max_choices=s.max_choices_per_request,
                               max_stop_strings=s.max_stop_strings, max_stop_string_chars=s.max_stop_string_chars,
                               max_constraint_chars=s.max_constraint_chars, max_constraint_depth=s.max_constraint_depth,
                               max_chars_per_token=tokenizer.max_token_chars,
                               sampling_defaults=dict(m.sampling_defaults),
                               prompt_logprobs=cfg.mode.kind not in (Mode.pd_prefill, Mode.pd_decode),
                               token_healing_served=cfg.mode.kind not in (Mode.pd_prefill, Mode.pd_decode),
                               all_prompt_logprobs=s.return_all_prompt_logprobs,
                               token_healing=s.token_healing, ignore_model_name=s.tgi_api,
                               trust_request_chat_template=s.trust_request_chat_template,
                               reasoning_parser=s.reasoning_parser.value)
        return FrontendSettings(limits=limits, api_key=api_key, max_body_bytes=s.max_body_bytes,
                                warn_unknown_fields=s.unknown_fields is UnknownFields.warn,
                                server_info=lightllm_server_info(cfg),
                                grammar_tokenizer=functools.partial(load_tokenizer, m),
                                max_constraint_compile_s=s.max_constraint_compile_s,
                                request_timeout_s=s.request_timeout_s, score=ScoreHead.of(m), embed=EmbedModel.of(m),
                                tgi_info=tgi_info(cfg) if s.tgi_api else None, profile_dir=s.profile_dir,
                                images=ImageInputs(m, cfg.visual) if m.vision
                                else AudioInputs(m, cfg.audio) if m.audio else None)


def create_app(settings: FrontendSettings, engine: EngineClient, tokenizer: PromptTokenizer,
               lifecycle: Lifecycle, pd_role: Optional[str] = None) -> Quart:
    """`pd_role` "prefill" | "decode": requests the pd_master relays (its headers) are served as
    runtime/http/pd_instance.py says; others as usual."""
    app = Quart("llaunch.frontend")
    app.config.update(RESPONSE_TIMEOUT=None, MAX_CONTENT_LENGTH=settings.max_body_bytes)
    limits = settings.limits
    openai = OpenAIServing(engine, tokenizer, limits, lifecycle, settings.images)
    # /generate and /generate_stream: LightLLM's shapes, or TGI's (server.tgi_api)
    tgi = settings.tgi_info is not None
    native = TgiApi(engine, tokenizer, limits, lifecycle) if tgi else GenerateApi(
        engine, tokenizer, limits, lifecycle, settings.images if isinstance(settings.images, ImageInputs) else None)
    prefill = PrefillServing(engine, tokenizer, limits, lifecycle) if pd_role == "prefill" else None
    created = int(time.time())

    async def serve(route) -> Response:
        body = await request.get_data()
        link = link_from_headers(request.headers) if pd_role else None
        if link is None:
            return await route(body)
        if prefill is not None:
            return await prefill.handle(request.path, body, link)
        token = current_pd_link.set(link)  # decode: the engine requests of this one wait for its KV
        try:
            return await route(body)
        finally:
            current_pd_link.reset(token)

    gatekeeper(app, settings.api_key, lifecycle, _OPEN_PATHS, _DRAIN_EXEMPT)
    json_errors(app, log)
    grammars = None
    if settings.grammar_tokenizer is not None and engine is not None:
        grammars = CompilePool(settings.grammar_tokenizer, limits.vocab_size, settings.max_constraint_compile_s)
        engine.constraint_gate = ConstraintCompiles(grammars).gate

        @app.before_serving
        async def start_grammars() -> None:  # on the loop; the forkserver imports xgrammar meanwhile (~10 s)
            grammars.start()

        @app.after_serving
        async def stop_grammars() -> None:
            grammars.close()

    @app.before_request
    async def collect_unknown_fields() -> None:
        begin_request(settings.warn_unknown_fields)
        begin_constraints()

    @app.after_request
    async def name_ignored_fields(response: Response) -> Response:
        ignored = ignored_fields()
        if ignored:
            log.warning("%s %s: fields no API defines were ignored (server.unknown_fields=warn): %s",
                        request.method, request.path, header_value(ignored))
            response.headers[IGNORED_HEADER] = header_value(ignored)
        return response
    task = "score" if settings.score is not None else "embed" if settings.embed is not None else "generate"
    scoring = ScoreApi(engine, tokenizer, limits, lifecycle, settings.score, task)
    embedding, reranking = EmbeddingsApi(engine, tokenizer, limits, lifecycle, settings.embed, task), RerankApi(scoring)

    if task != "generate":
        @app.before_request
        async def refuse_generation() -> Optional[Response]:
            if request.path in GENERATION_PATHS:
                refusal = score_model_refusal if task == "score" else embed_model_refusal
                return error_response(refusal(request.path))
            return None

    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        return await embedding.create(await request.get_data())

    @app.post("/v1/rerank")
    @app.post("/rerank")
    @app.post("/v2/rerank")
    async def rerank() -> Response:
        return await reranking.rerank(request.path, await request.get_data())

    @app.post("/get_score")
    async def get_score() -> Response:
        return await scoring.get_score(await request.get_data())

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify() -> Response:
        return await scoring.classify(await request.get_data())

    @app.post("/v1/score")
    @app.post("/score")
    async def score() -> Response:
        return await scoring.score(await request.get_data())

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await serve(openai.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await serve(openai.chat)

    responses, anthropic = ResponsesApi(openai), AnthropicApi(openai)  # both served through the chat path
    anthropic_errors(app)  # /v1/messages* answer errors in Anthropic's shape

    @app.post("/v1/responses")
    async def create_response() -> Response:
        return await responses.create(await request.get_data())

    @app.post("/v1/messages")
    async def messages() -> Response:
        return await anthropic.messages(await request.get_data())

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Response:
        return await anthropic.count_tokens(await request.get_data())

    @app.post("/generate")
    async def generate() -> Response:
        return await serve(native.generate)

    @app.post("/generate_stream")
    async def generate_stream() -> Response:
        return await serve(native.generate_stream)

    if tgi:
        @app.post("/")
        async def tgi_compat() -> Response:  # where huggingface_hub's InferenceClient posts
            return await serve(native.compat)

        @app.get("/info")
        async def info() -> Response:
            return json_response(settings.tgi_info)

    card = {"id": limits.served_name, "object": "model", "created": created, "owned_by": "llaunch",
            "root": limits.served_name, "max_model_len": limits.max_model_len}

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [card]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        if model_id != limits.served_name:
            return error_response(model_not_found(model_id))
        return json_response(card)

    tokens = TokenizeApi(tokenizer, limits)

    @app.post("/tokenize")
    async def tokenize() -> Response:
        return await tokens.tokenize(await request.get_data())

    @app.post("/detokenize")
    async def detokenize() -> Response:
        return await tokens.detokenize(await request.get_data())

    @app.get("/health/live")
    async def live() -> Response:
        """Liveness: this process answers (a supervisor restarts it when it does not)."""
        return json_response({"status": "ok"})

    @app.get("/health")
    @app.get("/health/ready")
    async def ready() -> Response:
        """Readiness: new requests can be served: not draining, the engine's heartbeat is fresh, every
        replica's workers have loaded and warmed up, and at least one replica is not stalled
        (runtime/router/health.py)."""
        age = engine.heartbeat_age()
        stalled = engine.stalled_replicas
        if lifecycle.draining:
            return error_response(draining())
        if grammars is not None and not grammars.warm:
            return error_response(ApiError(503, "The grammar compilers are starting.", type="service_unavailable",
                                           code="loading"))
        try:  # the threads that parse requests run one more now, not after a backlog
            await asyncio.wait_for(asyncio.to_thread(int), settings.parse_probe_s)
        except asyncio.TimeoutError:
            return error_response(ApiError(503, f"Request parsing is backed up: its threads took over "
                                                f"{settings.parse_probe_s:g} s to start a task.",
                                           type="service_unavailable", code="frontend_busy"))
        if age > settings.heartbeat_max_age_s:
            return error_response(ApiError(503, f"No engine heartbeat for {age:.1f} s.", type="service_unavailable",
                                           code="engine_unavailable"))
        if engine.loading_replicas:
            return error_response(ApiError(503, "The model is loading: the workers of replica(s) "
                                                f"{', '.join(map(str, engine.loading_replicas))} have not reported "
                                                "ready.", type="service_unavailable", code="loading"))
        if len(stalled) == len(engine.outstanding):
            return error_response(ApiError(503, "The engine is stalled: a step is overdue or a worker is gone "
                                                "(router.stall_timeout_s).", type="service_unavailable",
                                           code="engine_stalled"))
        return json_response({"status": "ok", "running": engine.running, "stalled_replicas": stalled})

    # LightLLM's operations routes (runtime/http/lightllm_ops.py)
    @app.route("/liveness", methods=["GET", "POST"])
    async def lightllm_liveness() -> Response:
        return json_response({"status": "ok"})

    @app.route("/readiness", methods=["GET", "POST"])
    async def lightllm_readiness() -> Response:
        answer = await ready()
        return answer if answer.status_code != 200 else json_response({"status": "ok"})

    @app.get("/healthz")
    async def lightllm_healthz() -> Response:
        ok = (await ready()).status_code == 200
        return json_response({"message": "Ok" if ok else "Error"}, status=200 if ok else 503)

    @app.get("/token_load")
    async def lightllm_token_load() -> Response:
        snapshot = engine.metrics
        return json_response(token_load(snapshot.text if snapshot else None, len(engine.outstanding)))

    @app.route("/get_model_name", methods=["GET", "POST"])
    async def lightllm_model_name() -> Response:
        return json_response({"model_name": limits.served_name})

    @app.route("/get_server_info", methods=["GET", "POST"])
    async def lightllm_server_info_route() -> Response:
        return json_response(settings.server_info or {"model_name": limits.served_name,
                                                      "max_req_total_len": limits.max_model_len})

    token_counter = TokensApi(tokenizer, limits)

    @app.route("/tokens", methods=["GET", "POST"])
    async def lightllm_tokens() -> Response:
        return json_response(await token_counter.count(await request.get_data()))

    schema = openapi_document(limits, api_key=settings.api_key is not None, tgi=tgi,
                              warn_unknown_fields=settings.warn_unknown_fields)

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return json_response(schema)

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        """Every replica evicts the prompt-cache entries no running request holds (SGLang's admin route)."""
        await engine.flush_cache()
        return json_response({"status": "ok"})

    @app.post("/start_profile")
    async def start_profile() -> Response:
        """Every worker starts torch.profiler between steps (vLLM's and SGLang's route; server.profile_dir)."""
        await engine.profile(profile_message(await request.get_data(), True, settings.profile_dir))
        return json_response({"status": "ok", "profile_dir": settings.profile_dir})

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        """Every worker finishes its steps in flight, stops the profiler and writes its trace and kernel table."""
        await engine.profile(profile_message(await request.get_data(), False, settings.profile_dir))
        return json_response({"status": "ok", "profile_dir": settings.profile_dir})

    process = CollectorRegistry()
    ProcessCollector(registry=process)  # this frontend's CPU, memory, fds (vLLM's API server process_*)

    @app.get("/metrics")
    async def metrics() -> Response:
        snapshot = engine.metrics
        if snapshot is None:
            return error_response(ApiError(503, "No metrics from the engine yet.", type="service_unavailable",
                                           code="engine_unavailable"))
        body, content_type = exposition(snapshot.text, process, request.headers.get("Accept", ""))
        return Response(body, content_type=content_type)

    return app

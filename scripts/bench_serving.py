#!/usr/bin/env python
"""Serving benchmark: streaming /v1/completions with random token prompts, vLLM's benchmark_serving
definitions (benchmarks/benchmark_serving.py), reported as a table and a JSON file.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model smollm2-135m \\
        --num-prompts 64 --input-len 512 --output-len 128 --concurrency 8 --result-file out.json

Definitions (per successful request; times from sending the request):
  TTFT   time to the first streamed chunk that carries a choice
  ITL    gaps between consecutive such chunks (all requests pooled)
  TPOT   (latency - TTFT) / (output tokens - 1), for requests with more than one output token
  E2EL   latency: time to the last chunk that carries a choice
  output tokens: the stream's usage.completion_tokens (stream_options.include_usage), else the
  number of chunks with a choice.
Throughputs divide by the benchmark duration: first request sent to last response done, warm-up
requests excluded.

Prompt-cache workloads (the prompts are still random token ids):
  --shared-prefix-groups N --shared-prefix-len L   prompt i starts with system prompt i % N (L tokens),
                                                   then its own --input-len tokens
  --multi-turn K   every prompt opens a conversation of K turns: each next turn re-sends the history
                   (prompts and the server's outputs, from `return_token_ids`) plus --input-len new
                   tokens, after the previous answer is back; --num-prompts counts conversations
When the server exposes `<prefix>:prefix_cache_{queries,hits}_total` (llaunch, vLLM), the hit rate
over the measured run is reported too; when it exposes `<prefix>:spec_decode_*` (speculative
decoding), the proposals, acceptance rate and tokens per verify step. --copy-prompts: each prompt holds a
text twice, which the model continues by copying (n-gram speculation's case): `text` (the default) a passage of
this repository's docs or code (--tokenizer: the served model's tokenizer.json or its folder), `random` random
token ids (scripts/bench_spec.py).

Traffic-shaped workloads (scripts/bench_trace.py; single-turn, no shared prefix):
  --trace FILE.jsonl   replay a recorded trace: its arrival times (--request-rate is ignored), prompt
                       and output lengths; --num-prompts takes its first requests
  --lengths sharegpt   ShareGPT-like prompt and output lengths with means --input-len / --output-len
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import itertools
import json
import math
import os
import sys
import time
from dataclasses import asdict
from typing import Any, Optional, Sequence

try:
    import httpx
except ImportError:
    sys.exit("scripts/bench_serving.py runs in llaunch's environment: `make setup`, then "
             ".venv/bin/python scripts/bench_serving.py ...")

# the workload, stream timing and metrics live beside this script; run as a script or loaded by path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_workload import (CacheCounts, RequestOutput, StreamTimer, arrival_offsets,  # noqa: E402
                            compute_metrics, conversation_turns, fetch_metrics, prefix_cache_counts,
                            random_prompts)
from bench_trace import prompts_of_lengths, read_trace, sharegpt_lengths, trace_workload  # noqa: E402
from bench_spec import copy_prompts, spec_counts, spec_result, text_copy_prompts, tokenizer_of  # noqa: E402
from bench_table import print_table  # noqa: E402
import bench_images  # noqa: E402 (--images-per-request: chat completions with images)

# ---- the client ----------------------------------------------------------------------------------


async def send_request(client: "httpx.AsyncClient", args: argparse.Namespace, prompt: list[int],
                       max_tokens: Optional[int] = None) -> RequestOutput:
    max_tokens = args.output_len if max_tokens is None else max_tokens
    opening = None  # a chat stream's role-only first chunk: not a token
    if bench_images.is_chat(args):
        route, payload, opening = "/v1/chat/completions", bench_images.chat_payload(args, prompt, max_tokens), \
            bench_images.is_opening
    else:
        route = "/v1/completions"
        payload = {"model": args.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                   "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        if args.multi_turn > 1:
            payload["return_token_ids"] = True  # the next turn's history holds the answer's tokens
        if args.response_format is not None:
            payload["response_format"] = fresh_schema(args) if args.fresh_schemas else args.response_format
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timer = StreamTimer(len(prompt), time.perf_counter())
    try:
        async with client.stream("POST", route, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                return timer.finish(error=f"HTTP {resp.status_code}: {body[:300]}")
            async for line in resp.aiter_lines():
                if opening is None or not opening(line):
                    timer.on_line(line, time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return timer.finish(error=f"{type(e).__name__}: {e}")
    return timer.finish()


_schema_serial = itertools.count()


def fresh_schema(args: argparse.Namespace) -> dict[str, Any]:
    """--response-format with one more (optional) property whose name no earlier request used: the
    server has never compiled this schema (a cold compile on the request's path)."""
    rf = copy.deepcopy(args.response_format)
    schema = rf["json_schema"]["schema"]
    schema.setdefault("properties", {})[f"x{args.seed}_{os.getpid()}_{next(_schema_serial)}"] = {"type": "integer"}
    return rf


async def run_conversation(send, turns: list[list[int]]) -> list[RequestOutput]:
    """One turn after another; each prompt is the history so far plus the new turn's tokens."""
    history: list[int] = []
    outputs: list[RequestOutput] = []
    for i, turn in enumerate(turns):
        prompt = history + turn
        out = await send(prompt)
        outputs.append(out)
        if not out.success:
            outputs += [RequestOutput(prompt_len=0, error="an earlier turn of the conversation failed")
                        for _ in turns[i + 1 :]]
            break
        history = prompt + out.output_ids
    return outputs


async def run_arrivals(send, conversations: list, offsets: list[float],
                       out_lens: Optional[list[int]] = None) -> list[list[RequestOutput]]:
    """Start conversation i at `offsets[i]` seconds from now (generating out_lens[i] tokens per turn when
    given, else --output-len); their outputs, conversation by conversation."""
    start = time.perf_counter()
    tasks = []
    for i, (turns, offset) in enumerate(zip(conversations, offsets)):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        turn_send = send if out_lens is None else functools.partial(send, max_tokens=out_lens[i])
        tasks.append(asyncio.create_task(run_conversation(turn_send, turns)))
    return list(await asyncio.gather(*tasks))


# llaunch's counters reach /metrics up to a router stats period (0.25 s) plus a metrics snapshot
# (0.5 s) after the responses that moved them: read them that long after a run's last response
METRICS_SETTLE_S = 1.0


async def counters(client: "httpx.AsyncClient", args: argparse.Namespace) -> tuple:
    """(prefix cache, speculative decoding, images) counters from one /metrics read; each None when the
    server does not expose it."""
    text = await fetch_metrics(client, args.api_key)
    if text is None:
        return None, None, None
    return prefix_cache_counts(text), spec_counts(text), bench_images.image_counts(text)


def build_workload(args: argparse.Namespace) -> tuple[list, list[float], Optional[list[int]]]:
    """Conversations (each a list of turns' new tokens), send offsets, and per-conversation output
    lengths (None: --output-len for all)."""
    if args.trace or args.lengths == "sharegpt":
        if args.trace:
            in_lens, out_lens, offsets = trace_workload(read_trace(args.trace), args.num_prompts)
        else:
            in_lens, out_lens = sharegpt_lengths(args.num_prompts, args.input_len, args.output_len, args.seed,
                                                 args.max_model_len)
            offsets = arrival_offsets(args.num_prompts, args.request_rate, args.seed)
        prompts = prompts_of_lengths(in_lens, args.vocab_size, args.seed)
        return [[p] for p in prompts], offsets, out_lens
    if args.copy_prompts:  # a text seen twice, continued by copying it: n-gram speculation's case
        prompts = (copy_prompts(args.num_prompts, args.input_len, args.vocab_size, args.seed)
                   if args.copy_prompts == "random" else
                   text_copy_prompts(args.num_prompts, args.input_len, tokenizer_of(args.tokenizer), args.seed))
        return [[p] for p in prompts], arrival_offsets(args.num_prompts, args.request_rate, args.seed), None
    conversations = conversation_turns(args.num_prompts, args.input_len, args.vocab_size, args.seed,
                                       args.shared_prefix_groups, args.shared_prefix_len, args.multi_turn)
    return conversations, arrival_offsets(args.num_prompts, args.request_rate, args.seed), None


async def run_benchmark(args: argparse.Namespace, transport: Any = None) -> tuple[list[RequestOutput], float, CacheCounts]:
    """Outputs (conversation by conversation, turns in order), the duration, and the server's prefix
    cache (queries, hits) over the measured run when it reports them."""
    conversations, offsets, out_lens = build_workload(args)
    warmup = random_prompts(args.warmup, args.input_len, args.vocab_size, args.seed + 1)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.base_url, http1=True, http2=False, limits=limits,
                                 timeout=httpx.Timeout(args.timeout), transport=transport) as client:
        cap = asyncio.Semaphore(args.concurrency)

        async def capped(prompt: list[int], max_tokens: Optional[int] = None) -> RequestOutput:
            async with cap:
                return await send_request(client, args, prompt, max_tokens)

        if bench_images.is_chat(args):  # every request's images and clips, before any is sent
            bench_images.pregenerate(args, len(warmup) + sum(len(c) for c in conversations))
        warm = await asyncio.gather(*(capped(p) for p in warmup))
        if any(not o.success for o in warm):
            print(f"warm-up failed: {next(o.error for o in warm if not o.success)}", file=sys.stderr)
        await asyncio.sleep(METRICS_SETTLE_S)
        cache_before, args.spec_before, args.images_before = await counters(client, args)
        start = time.perf_counter()
        outputs = [o for conversation in await run_arrivals(capped, conversations, offsets, out_lens)
                   for o in conversation]
        duration = time.perf_counter() - start
        await asyncio.sleep(METRICS_SETTLE_S)
        cache_after, args.spec_after, args.images_after = await counters(client, args)
        cache = None if None in (cache_before, cache_after) else tuple(a - b for a, b in zip(cache_after, cache_before))
        return outputs, duration, cache


def _share_main(args: argparse.Namespace, conversations: list, offsets: list[float], out_lens: Optional[list[int]],
                concurrency: int, start_at: float) -> tuple[list[list[RequestOutput]], float]:
    """One client process's share: its conversations from wall time `start_at` (all processes start
    together); returns its outputs per conversation and the wall time its last one ended."""
    async def run() -> list[list[RequestOutput]]:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=args.base_url, http1=True, http2=False, limits=limits,
                                     timeout=httpx.Timeout(args.timeout)) as client:
            cap = asyncio.Semaphore(concurrency)

            async def capped(prompt: list[int], max_tokens: Optional[int] = None) -> RequestOutput:
                async with cap:
                    return await send_request(client, args, prompt, max_tokens)

            await asyncio.sleep(max(0.0, start_at - time.time()))
            return await run_arrivals(capped, conversations, offsets, out_lens)

    outputs = asyncio.run(run())
    return outputs, time.time()


def run_benchmark_procs(args: argparse.Namespace) -> tuple[list[RequestOutput], float, CacheCounts]:
    """run_benchmark over `args.client_procs` processes: at high concurrency one Python process
    cannot read every stream's events as they come (it would lag, and send new requests late).
    Conversation i goes to process i % N; the concurrency is split as evenly as it goes."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing

    n = args.client_procs
    conversations, offsets, out_lens = build_workload(args)

    async def around(measured):
        async with httpx.AsyncClient(base_url=args.base_url, timeout=httpx.Timeout(args.timeout)) as client:
            warm = await asyncio.gather(*(send_request(client, args, p) for p in
                                          random_prompts(args.warmup, args.input_len, args.vocab_size, args.seed + 1)))
            if any(not o.success for o in warm):
                print(f"warm-up failed: {next(o.error for o in warm if not o.success)}", file=sys.stderr)
            await asyncio.sleep(METRICS_SETTLE_S)
            before, args.spec_before, args.images_before = await counters(client, args)
            outputs, duration = await asyncio.get_running_loop().run_in_executor(None, measured)
            await asyncio.sleep(METRICS_SETTLE_S)
            after, args.spec_after, args.images_after = await counters(client, args)
            return outputs, duration, None if None in (before, after) else tuple(a - b for a, b in zip(after, before))

    def measured():
        start_at = time.time() + 1.0  # every process is up and waiting by then
        with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = [pool.submit(_share_main, args, conversations[k::n], offsets[k::n],
                                   None if out_lens is None else out_lens[k::n], args.concurrency // n + (k < args.concurrency % n), start_at) for k in range(n)]
            shares = [f.result() for f in futures]
        per_conversation: list = [None] * len(conversations)
        for k, (outs, _) in enumerate(shares):
            per_conversation[k::n] = outs
        duration = max(end for _, end in shares) - start_at
        return [o for conversation in per_conversation for o in conversation], duration

    return asyncio.run(around(measured))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True, help="the served model name (OpenAI `model` field)")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=1, help="most requests in flight at once")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals, req/s")
    ap.add_argument("--warmup", type=int, default=1, help="requests sent first and not counted")
    ap.add_argument("--vocab-size", type=int, default=32000, help="prompt ids are drawn from [100, this)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout, seconds")
    ap.add_argument("--api-key", default=os.environ.get("LLAUNCH_API_KEY"),
                    help="default: $LLAUNCH_API_KEY (keeps the secret off the command line)")
    ap.add_argument("--result-file", default=None, help="write the results as JSON here")
    ap.add_argument("--keep-text", action="store_true",
                    help="the result file keeps each request's generated text (greedy runs compared across servers)")
    ap.add_argument("--shared-prefix-groups", type=int, default=0,
                    help="prompts share one of this many system prompts (0: none)")
    ap.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of each shared system prompt")
    ap.add_argument("--client-procs", type=int, default=1,
                    help="client processes sharing the concurrency (one Python process saturates near 10k events/s)")
    ap.add_argument("--multi-turn", type=int, default=1,
                    help="turns per conversation; each re-sends the history plus --input-len new tokens")
    ap.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: a request must start within this")
    ap.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: and keep each token within this")
    ap.add_argument("--trace", default=None, help="JSONL trace to replay (scripts/bench_trace.py describes it)")
    ap.add_argument("--lengths", choices=("fixed", "sharegpt"), default="fixed",
                    help="fixed: every request --input-len/--output-len; sharegpt: drawn around those means")
    ap.add_argument("--response-format", default=None,
                    help="structured output: an OpenAI response_format object (JSON, or @FILE) sent with every request")
    ap.add_argument("--fresh-schemas", action="store_true",
                    help="give every request's json_schema a property no earlier request had (cold compiles)")
    ap.add_argument("--copy-prompts", nargs="?", const="text", choices=("text", "random"), default=None,
                    help="each prompt holds a text twice, which the model continues by copying: `text` (default) a "
                         "passage of this repository's docs or code, `random` random token ids")
    ap.add_argument("--tokenizer", default=None,
                    help="--copy-prompts text: the served model's tokenizer.json, or the folder holding it")
    ap.add_argument("--max-model-len", type=int, default=None, help="sharegpt lengths are cut to fit this")
    bench_images.add_args(ap)
    args = ap.parse_args(argv)
    if args.concurrency < 1 or args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        ap.error("--concurrency, --num-prompts, --input-len and --output-len must be >= 1")
    if not 1 <= args.client_procs <= args.concurrency:
        ap.error("--client-procs must be in [1, --concurrency]")
    if args.multi_turn < 1 or args.shared_prefix_groups < 0:
        ap.error("--multi-turn must be >= 1 and --shared-prefix-groups >= 0")
    if (args.shared_prefix_groups > 0) != (args.shared_prefix_len > 0):
        ap.error("--shared-prefix-groups and --shared-prefix-len go together (both > 0)")
    if (args.trace or args.lengths != "fixed") and (args.multi_turn > 1 or args.shared_prefix_groups):
        ap.error("--trace and --lengths sharegpt are single-turn workloads: no --multi-turn or --shared-prefix-*")
    if bench_images.is_chat(args) and (args.multi_turn > 1 or args.client_procs > 1 or args.trace):
        ap.error("--images-per-request / --audio-per-request: single-turn, one client process, no --trace")
    if args.copy_prompts == "text" and not args.tokenizer:
        ap.error("--copy-prompts text needs --tokenizer (the served model's tokenizer.json or its folder)")
    if args.response_format is not None:
        text = args.response_format
        if text.startswith("@"):
            with open(text[1:]) as f:
                text = f.read()
        args.response_format = json.loads(text)
    if args.fresh_schemas and (args.response_format or {}).get("type") != "json_schema":
        ap.error("--fresh-schemas needs a --response-format of type json_schema")
    return args


def main(argv: Optional[Sequence[str]] = None, transport: Any = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.client_procs > 1 and transport is None:
        outputs, duration, cache = run_benchmark_procs(args)
    else:
        outputs, duration, cache = asyncio.run(run_benchmark(args, transport))
    result = compute_metrics(outputs, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    result.update(spec_result(getattr(args, "spec_before", None), getattr(args, "spec_after", None)))
    result.update(bench_images.image_result(getattr(args, "images_before", None), getattr(args, "images_after", None),
                                            duration, "clips" if args.audio_per_request else "images"))
    if cache is not None:
        result["prefix_cache_queries"], result["prefix_cache_hits"] = cache[:2]
        result["prefix_cache_hit_rate"] = cache[1] / cache[0] if cache[0] else 0.0
        if len(cache) > 2:  # a host KV tier: hits per tier, tokens moved between them
            result["host_cache_hits"], result["kv_promoted_tokens"], result["kv_demoted_tokens"] = cache[2:5]
            result["dp_fetched_tokens"] = cache[5]  # cache.dp_fetch: copied from another replica's host tier
            result["gpu_cache_hits"] = cache[1] - cache[2]
    print_table(result, args)
    errors = [o.error for o in outputs if not o.success]
    if errors:
        print(f"{len(errors)} request(s) failed; first error: {errors[0]}", file=sys.stderr)
    expected = build_workload(args)[2] or [args.output_len] * len(outputs)
    short = sum(o.success and o.output_tokens != n for o, n in zip(outputs, expected))
    if short:
        print(f"warning: {short} request(s) did not return the tokens asked for (ignore_eos unsupported?)",
              file=sys.stderr)
    if args.multi_turn > 1 and any(o.success and o.output_tokens and not o.output_ids for o in outputs):
        print("warning: the server returned no token ids (return_token_ids): histories lack the answers",
              file=sys.stderr)
    if args.result_file:
        record = {**result, "args": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                                     for k, v in vars(args).items() if k != "api_key"},
                  "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "requests": [{k: v for k, v in asdict(o).items()
                                if k != "output_ids" and (k != "generated_text" or args.keep_text)}
                               for o in outputs]}
        with open(args.result_file, "w") as f:
            json.dump(record, f, indent=2)
    return result


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["completed"] else 1)

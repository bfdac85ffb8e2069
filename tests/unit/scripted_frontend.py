"""The frontend's scripted world for tests: a real Hypercorn server on a free 127.0.0.1 port around the
real app and EngineClient, and a scripted router/detokenizer (ScriptedEngine) behind it."""
from __future__ import annotations

import asyncio
import http.client
import threading
import time

import openai

from llaunch.runtime.http.app import FrontendSettings, create_app
from llaunch.runtime.http.engine_client import EngineClient
from llaunch.runtime.web.lifecycle import Lifecycle
from llaunch.runtime.http.process import listening_socket, serve_app
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.http.request_limits import RequestLimits
from llaunch.runtime.ipc.messages import (AbortRequest, AddRequest, MetricsSnapshot, TextBatch,
                                          TextDelta)

from unit.http_support import METRICS_TEXT, MODEL, REPLY, smollm2_grammar_tokenizer

LIMITS = RequestLimits(served_name=MODEL, max_model_len=128, vocab_size=49152)
# the reply to a prompt that says `toolcall`: two calls in the hermes format
TOOL_REPLY = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "London"}}\n</tool_call>')
# the reply to a prompt that says `thinking`: a thinking model's block, then the answer
THINK_REPLY = "<think>\nFoxes are quick.\n</think>\n\n" + REPLY


class ScriptedEngine:
    """Plays router + detokenizer: each AddRequest is answered with REPLY one token per TextDelta
    (cut at max_new_tokens), with scripted logprobs. Words in the prompt pick other behaviours:
    `toolcall` (TOOL_REPLY), `slow` (50 ms a token, long), `hang` (never answers), `stopword` (the detokenizer finds a stop
    string), `broken` (the engine fails the request), `thinking` (THINK_REPLY)."""

    def __init__(self, tok: PromptTokenizer):
        self.tok = tok
        self.client: EngineClient | None = None
        self.received: list[tuple[int, object]] = []
        self.heartbeat = True
        self.tasks: set[asyncio.Task] = set()

    async def post(self, replica: int, msg) -> None:
        self.received.append((replica, msg))
        if isinstance(msg, AddRequest):
            task = asyncio.ensure_future(self._answer(msg))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def added(self) -> list[AddRequest]:
        return [m for _, m in self.received if isinstance(m, AddRequest)]

    def aborted(self) -> list[str]:
        return [m.request_id for _, m in self.received if isinstance(m, AbortRequest)]

    async def _answer(self, req: AddRequest) -> None:
        prompt = self.tok.decode(req.prompt_ids)
        if "hang" in prompt:
            return
        reply = (TOOL_REPLY if "toolcall" in prompt else THINK_REPLY if "thinking" in prompt
                 else REPLY * (20 if "slow" in prompt else 1))
        reply_ids = self.tok.hf.encode(reply, add_special_tokens=False)
        ids = reply_ids[:req.sampling.max_new_tokens]
        s = req.sampling
        for k, token_id in enumerate(ids):
            await asyncio.sleep(0.05 if "slow" in prompt else 0.001)
            if req.request_id in self.aborted():
                return
            last = k == len(ids) - 1
            delta = TextDelta(request_id=req.request_id, text=self.tok.decode([token_id]), token_ids=[token_id],
                              prompt_tokens=len(req.prompt_ids), completion_tokens=k + 1)
            if s.logprobs:
                delta.logprobs = [-0.25 * (k + 1)]
                delta.top_ids = [[token_id + j for j in range(s.top_logprobs)]]
                delta.top_logprobs = [[-0.25 * (k + 1) - j for j in range(s.top_logprobs)]]
            if "stopword" in prompt and k == 2:
                delta.stopped_by_string = True  # the detokenizer cut the text at a stop string
                await self.client.on_message(TextBatch(deltas=[delta]))
                return
            if "broken" in prompt and k == 1:
                delta.finish_reason = "error"
            elif last:
                delta.finish_reason = "length" if len(reply_ids) > s.max_new_tokens else "stop"
            await self.client.on_message(TextBatch(deltas=[delta]))
            if delta.finish_reason:
                return

    async def beat(self) -> None:
        while True:
            if self.heartbeat:
                await self.client.on_message(MetricsSnapshot(time=time.time(), text=METRICS_TEXT))
            await asyncio.sleep(0.2)


class Server:
    """The app under Hypercorn in a thread with its own event loop."""

    def __init__(self, tok: PromptTokenizer, api_key: str | None = None, replicas: int = 2, **settings):
        """`settings`: FrontendSettings fields (limits included) other than the defaults here."""
        self.engine = ScriptedEngine(tok)
        sock = listening_socket("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.fd = sock.detach()
        self.settings = FrontendSettings(**{"limits": LIMITS, "api_key": api_key, "heartbeat_max_age_s": 1.0,
                                            "grammar_tokenizer": smollm2_grammar_tokenizer(), **settings})
        self.replicas = replicas
        self.tok = tok
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(10)
        self.wait_ready()

    def wait_ready(self, timeout: float = 180) -> None:
        """Until /health/ready says 200: the grammar compile processes have started (the first server
        of a test process starts their forkserver, which imports xgrammar: seconds)."""
        deadline = time.monotonic() + timeout
        while self.raw("GET", "/health/ready")[0] != 200:
            assert time.monotonic() < deadline, "the scripted frontend never became ready"
            time.sleep(0.1)

    def _run(self) -> None:
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self.lifecycle = Lifecycle()
        self.client = EngineClient(0, self.replicas, self.engine.post)
        self.engine.client = self.client
        app = create_app(self.settings, self.client, self.tok, self.lifecycle)
        app.before_serving(self._started)
        beat = asyncio.ensure_future(self.engine.beat())
        await serve_app(app, self.fd, self.lifecycle)
        beat.cancel()

    async def _started(self) -> None:
        self.started.set()

    def run(self, coro):
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(5)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.lifecycle.stop_now)
            self.thread.join(10)

    def openai(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=api_key, max_retries=0, timeout=10)

    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        return resp.status, resp.getheader("Content-Type"), data

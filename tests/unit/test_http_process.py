"""The frontend's real entry point as a subprocess: run config file, inherited listening fd, ZMQ to a
router double, ProcessReady to the launcher's control socket, SIGTERM drain, exit code 0."""
from __future__ import annotations

import http.client
import threading
import time

import openai
import pytest

from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.http.process import listening_socket
from llaunch.runtime.ipc.messages import AddRequest, MetricsSnapshot, TextBatch, TextDelta
from unit.http_support import METRICS_TEXT, MODEL, REPLY, reply_text, smollm2_gguf, smollm2_tokenizer, wait_for


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return smollm2_tokenizer()


class ZmqRouterDouble:
    """Router + detokenizer over real ZMQ sockets, in a thread: pulls AddRequest/AbortRequest, pushes a
    token of REPLY every 20 ms per running request, and a MetricsSnapshot heartbeat."""

    def __init__(self, tok: PromptTokenizer, requests_addr: str, text_addr: str):
        import zmq
        from llaunch.runtime.ipc.messages import RouterInbound
        from llaunch.runtime.ipc.sockets import Receiver, Sender
        self.tok = tok
        self.ctx = zmq.Context()
        self.requests = Receiver(self.ctx, requests_addr, RouterInbound)
        self.text = Sender(self.ctx, text_addr)
        self.received: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        reply = self.tok.hf.encode(REPLY * 5, add_special_tokens=False)
        running: dict[str, list] = {}  # request id -> [AddRequest, tokens sent]
        last_beat = 0.0
        while not self.stop.is_set():
            if time.monotonic() - last_beat > 0.2:
                self.text.send(MetricsSnapshot(time=time.time(), text=METRICS_TEXT))
                last_beat = time.monotonic()
            msg = self.requests.recv(timeout_ms=20)
            if msg is not None:
                self.received.append(msg)
                if isinstance(msg, AddRequest):
                    running[msg.request_id] = [msg, 0]
                else:
                    running.pop(msg.request_id, None)
            deltas = []
            for request_id, state in list(running.items()):
                req, sent = state
                token_id = reply[sent]
                state[1] = sent + 1
                done = state[1] == req.sampling.max_new_tokens
                deltas.append(TextDelta(request_id=request_id, text=self.tok.decode([token_id]), token_ids=[token_id],
                                        completion_tokens=state[1], finish_reason="length" if done else None))
                if done:
                    del running[request_id]
            if deltas:
                self.text.send(TextBatch(deltas=deltas))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.requests.close()
        self.text.close()
        self.ctx.term()


@pytest.mark.slow
def test_frontend_process_serves_over_zmq_and_drains_on_sigterm(tok, tmp_path):
    """The real entry point: run config file, inherited listening fd, ZMQ to a router double,
    ProcessReady to the launcher's control socket, SIGTERM drain, exit code 0."""
    import signal
    import subprocess
    import sys

    import msgspec
    import zmq

    from llaunch.runtime.config import ModelConfig, ProcessGraph, ProcessSpec, RunConfig
    from llaunch.runtime.ipc.messages import LauncherInbound
    from llaunch.runtime.ipc.sockets import Receiver

    ipc = f"ipc://{tmp_path}"
    spec = ProcessSpec(name="frontend.0", role="frontend", binds={"text": f"{ipc}/text"},
                       connects={"requests.0": f"{ipc}/requests.0"})
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    graph = ProcessGraph(processes=[spec], http_url=f"http://127.0.0.1:{port}", ipc_dir=str(tmp_path),
                         control=f"{ipc}/control")
    cfg = RunConfig(model=ModelConfig(name="smollm2-135m", path=smollm2_gguf(), max_model_len=128, vocab_size=49152),
                    run_dir=str(tmp_path), graph=graph)
    (tmp_path / "config.yaml").write_bytes(msgspec.yaml.encode(cfg))
    ctx = zmq.Context()
    control = Receiver(ctx, graph.control, LauncherInbound)
    router = ZmqRouterDouble(tok, spec.connects["requests.0"], spec.binds["text"])
    proc = subprocess.Popen([sys.executable, "-m", "llaunch.runtime.http.process", "--config",
                             str(tmp_path / "config.yaml"), "--name", "frontend.0", "--listen-fd", str(sock.fileno())],
                            pass_fds=[sock.fileno()])
    sock.close()  # the child holds the listening socket now
    try:
        ready = control.recv(timeout_ms=60_000)
        assert ready is not None and ready.name == "frontend.0" and ready.pid == proc.pid
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=10)
        def healthy() -> bool:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            return conn.getresponse().status == 200

        wait_for(healthy, timeout=180)  # the heartbeat comes through the detokenizer's socket; the grammar
        # compile processes load the tokenizer (a GGUF's: tens of seconds on a busy machine)
        stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=30, stream=True)
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIStatusError) as refused:
            wait_for(lambda: client.models.list() and False, timeout=5)  # 503 once the drain started
        assert refused.value.status_code == 503
        text = first.choices[0].text + "".join(c.choices[0].text for c in stream)
        assert text == reply_text(tok, 30, repeats=5)
        assert proc.wait(timeout=15) == 0
        assert [type(m).__name__ for m in router.received] == ["AddRequest"]
        assert router.received[0].prompt_ids == tok.hf.encode("Hello")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        router.close()
        control.close()
        ctx.term()

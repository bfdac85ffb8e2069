"""The router's scheduler and the worker's runner in one loop (pipeline depth 2, as the router plans):
what test_spec_decode.py and tests/gpu/test_spec_decode_gpu.py serve requests through."""
from collections import deque
from pathlib import Path
from typing import Optional

import torch

from llaunch.runtime.config import SpecConfig, SpecMethod
from llaunch.runtime.ipc.messages import AddRequest
from llaunch.runtime.router.request import Request
from llaunch.runtime.router.scheduler import Scheduler, SchedulerLimits
from llaunch.runtime.worker.drafter import Drafter, draft_kv_cache
from llaunch.runtime.worker.runner import ModelRunner
from llaunch.runtime.models.memory import spec_step_tokens

ROWS, SLOTS, MAX_LEN = 16, 2048, 160
EOS = 2
REPO = Path(__file__).resolve().parents[2]


def serve(model, requests: list, spec: bool, kv_slots: int = SLOTS, max_len: int = MAX_LEN,
          device: torch.device = torch.device("cpu"), cuda_graphs: bool = False, eos_ids: tuple = (EOS,),
          step_tokens: int = 4096, runners: Optional[list] = None, draft=None, padded_draft: bool = False,
          chain: bool = True, adaptive: bool = False, num_tokens: int = 4, draft_ahead: bool = False,
          before_requests=None):
    """Run (prompt ids, SamplingParams) requests through a Scheduler and a ModelRunner:
    ({request index: (tokens, finish reason)}, scheduler). Every KV slot must be back at the end.
    `step_tokens`: the token budget of a step (small: prompts prefill in chunks beside verify rows).
    `runners`: a list the ModelRunner is appended to (to look at its graphs). `draft`: a draft model
    (spec.method=draft) instead of n-gram proposals; `padded_draft`: its proposals run as the GPU's CUDA graphs
    do (runtime/worker/draft_graphs.py), else step by step on the rows that still propose. `chain`, `adaptive`,
    `num_tokens`: spec.chain, spec.adaptive, spec.num_tokens; `draft_ahead`: spec.draft_ahead, with its slots kept
    from the scheduler as the worker keeps them; `before_requests`: called with the runner before any step."""
    method = SpecMethod.draft if draft is not None else SpecMethod.ngram
    cfg = SpecConfig(method=method, num_tokens=num_tokens, max_batch=16, chain=chain, adaptive=adaptive) if spec else None
    sched = Scheduler(SchedulerLimits(kv_slots=kv_slots, max_running=ROWS, batch_max_tokens=step_tokens,
                                      chunked_prefill=True, chunked_prefill_size=step_tokens, max_wait_tokens=1, token_ratio=0.0,
                                      max_model_len=max_len, eos_ids=eos_ids, pipeline_depth=2, spec=cfg))
    # verify steps padded to buckets (CUDA graphs on a GPU) up to every row verifying 4 proposals, as a server's
    ahead = Drafter.ahead_slots(cfg.num_tokens, cfg.max_batch) if spec and draft is not None and draft_ahead else 0
    kv = model.make_kv_cache(kv_slots + ahead + 1, ROWS + 1, max_len)
    drafter = None
    if spec and draft is not None:
        drafter = Drafter(draft, draft_kv_cache(draft, kv), model.arch.vocab_size, device,
                          num_tokens=cfg.num_tokens if padded_draft or cuda_graphs else 0, max_batch=cfg.max_batch,
                          ahead=ahead > 0)
    runner = ModelRunner(model, kv, ROWS, device, cuda_graphs=cuda_graphs, eos_ids=eos_ids,
                         verify_tokens=spec_step_tokens(cfg, ROWS) if spec else 0, drafter=drafter)
    if runners is not None:
        runners.append(runner)
    if before_requests is not None:
        before_requests(runner)
    for i, (prompt, sp) in enumerate(requests):
        assert sched.add(Request(AddRequest(str(i), 0, prompt, sp, 0.0), sp)) is None
    out = {i: ([], None) for i in range(len(requests))}
    pending = deque()
    while sched.has_work() or pending:
        while len(pending) < 2:
            plan = sched.schedule()
            if plan is None:
                break
            pending.append(runner.launch(plan))
        for delta in sched.on_result(runner.finish(pending.popleft())):
            tokens, _ = out[int(delta.request_id)]
            out[int(delta.request_id)] = (tokens + delta.token_ids, delta.finish_reason)
    assert sched.kv.num_used == 0  # every slot back, rejected proposals included
    return out, sched

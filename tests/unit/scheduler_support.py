"""Builders shared by the scheduler tests: limits, requests, and a worker double that answers a plan."""
from llaunch.runtime.ipc.messages import AddRequest, SamplingParams, StepResult
from llaunch.runtime.router.request import Request
from llaunch.runtime.router.scheduler import Scheduler, SchedulerLimits

EOS = 2


def make(kv_slots=64, max_running=4, batch_max_tokens=16, chunked=True, chunk=8, max_wait=1, ratio=0.0,
         max_model_len=64, depth=1, prompt_cache=False, pd_role=None):
    return Scheduler(SchedulerLimits(kv_slots=kv_slots, max_running=max_running, batch_max_tokens=batch_max_tokens,
                                     chunked_prefill=chunked, chunked_prefill_size=chunk, max_wait_tokens=max_wait,
                                     token_ratio=ratio, max_model_len=max_model_len, eos_ids=(EOS,),
                                     pipeline_depth=depth, prompt_cache=prompt_cache, pd_role=pd_role))


def req(rid, prompt_len, max_new, pd=None, priority=0, **sp):
    msg = AddRequest(request_id=rid, frontend=0, prompt_ids=list(range(10, 10 + prompt_len)),
                     sampling=SamplingParams(max_new_tokens=max_new, **sp), arrival_time=0.0, pd=pd, priority=priority)
    return Request(msg, msg.sampling)


def answer(sched, plan, token=7):
    rows = list(plan.decode_rows) + [c.row for c in plan.prefill if c.sample]
    return sched.on_result(StepResult(step=plan.step, rows=rows, token_ids=[token] * len(rows)))

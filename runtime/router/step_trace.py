"""A per-step trace of what the router planned and when the tokens came back, for finding where a
workload's time goes (idle gaps, step sizes, decode batch over time). Off unless router.step_trace
names a file; one JSON line per step: step, sent and returned (time.monotonic), decode rows, prefill
tokens and chunks, verify chunks (speculative decoding) and their tokens, new requests, running and waiting counts, the worker's forward seconds; with the
worker's timings (`started`, `launch_s`, `device_s`) and, for a step that starts requests, how long
the oldest of them had waited since the frontend stamped it (`arrival_lag`), a prefill's time to first
token splits into frontend → router, router → worker, host enqueue, device and the way back."""
from __future__ import annotations

import json
import time
from typing import Optional

from llaunch.runtime.ipc.messages import StepPlan, StepResult

class StepTrace:
    def __init__(self, path: Optional[str]):
        self._file = open(path, "a", buffering=1) if path else None  # line-buffered: the router is killed, not closed
        self._open: dict[int, dict] = {}

    @property
    def enabled(self) -> bool:
        return self._file is not None

    @classmethod
    def for_replica(cls, path: Optional[str], dp_rank: int) -> "StepTrace":
        return cls(f"{path}.{dp_rank}" if path and dp_rank else path)

    def planned(self, plan: StepPlan, running: int, waiting: int, arrivals: tuple[float, ...] = ()) -> None:
        """`arrivals`: the frontend's time.time() stamps of the requests this step starts."""
        if self._file is None:
            return
        self._open[plan.step] = {"step": plan.step, "sent": time.monotonic(), "decode": len(plan.decode_rows),
                                 "prefill_tokens": sum(len(c.token_ids) for c in plan.prefill),
                                 "chunks": len(plan.prefill), "new": len(plan.new), "running": running,
                                 "waiting": waiting, "verify": len(plan.verify),
                                 "verify_tokens": sum(len(c.token_ids) for c in plan.verify)}
        if arrivals:
            self._open[plan.step]["arrival_lag"] = time.time() - min(arrivals)

    def returned(self, result: StepResult) -> None:
        if self._file is None:
            return
        rec = self._open.pop(result.step, None)
        if rec is not None:
            rec.update(returned=time.monotonic(), forward_s=result.forward_s)
            if result.started:
                rec.update(started=result.started, launch_s=result.launch_s, device_s=result.device_s)
            self._file.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()

"""POST /start_profile and /stop_profile: vLLM's routes (no body) and SGLang's (a JSON body), which start and
stop torch.profiler in every worker of every replica (runtime/worker/step_profiler.py); each rank writes its
trace and its kernel table under server.profile_dir. Without that key both routes answer 400."""
from __future__ import annotations

import json
from typing import Any, Optional

from llaunch.runtime.ipc.messages import Profile
from llaunch.runtime.web.errors import ApiError

ACTIVITIES = ("CPU", "GPU")
# SGLang's fields that are not served, and why
REFUSED = {
    "output_dir": "the traces go to server.profile_dir, set at launch (a client does not pick the server's paths)",
    "start_step": "a profile starts with the next step: send the start when the steps to profile are next",
    "profile_by_stage": "prefill and decode are not profiled apart: a mixed step holds both",
    "merge_profiles": "each rank writes its own trace",
    "profile_id": "each rank's files are numbered by the profile: worker-<dp>-<tp rank>-<n>",
    "profile_prefix": "each rank's files are named worker-<dp>-<tp rank>-<n>",
    "profile_stages": "prefill and decode are not profiled apart: a mixed step holds both",
}


def _fields(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        fields = json.loads(body)
    except ValueError as e:
        raise ApiError(400, f"The body is not JSON: {e}.") from None
    if fields is None:
        return {}
    if not isinstance(fields, dict):
        raise ApiError(400, "The body must be a JSON object (or empty).")
    return fields


def profile_message(body: bytes, start: bool, profile_dir: Optional[str]) -> Profile:
    """The Profile message a request asks for, or an ApiError (400) that says why not."""
    if profile_dir is None:
        raise ApiError(400, "Profiling is off: launch the server with server.profile_dir=DIR, where each worker "
                            "writes its torch.profiler trace and kernel table.")
    fields = _fields(body)
    if not start:
        if fields:
            raise ApiError(400, f"POST /stop_profile takes no fields, got {sorted(fields)}.", param=sorted(fields)[0])
        return Profile(start=False)
    for name in fields:
        if name in REFUSED:
            raise ApiError(400, f"`{name}` is not served: {REFUSED[name]}.", param=name)
        if name not in ("num_steps", "activities", "record_shapes", "with_stack"):
            raise ApiError(400, f"Unknown field `{name}`: /start_profile takes num_steps, activities, record_shapes "
                                "and with_stack.", param=name)
    num_steps = fields.get("num_steps")
    if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1):
        raise ApiError(400, f"`num_steps` must be a positive integer (or null: until /stop_profile), got "
                            f"{num_steps!r}.", param="num_steps")
    activities = fields.get("activities") or []
    if not isinstance(activities, list) or any(a not in ACTIVITIES for a in activities):
        raise ApiError(400, f"`activities` must be a list of {list(ACTIVITIES)} (torch.profiler's CPU and CUDA), got "
                            f"{activities!r}.", param="activities")
    flags = {}
    for name in ("record_shapes", "with_stack"):
        value = fields.get(name, False)
        if not isinstance(value, bool):
            raise ApiError(400, f"`{name}` must be true or false, got {value!r}.", param=name)
        flags[name] = value
    return Profile(start=True, num_steps=num_steps or 0, activities=list(dict.fromkeys(activities)), **flags)

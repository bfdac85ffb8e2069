"""A one-row step with the norms inside the GEMVs (DecoderLM's fused one-row path: o_proj and down_proj
add into the residual stream and sum its squares, qkv and gate_up normalize as they read it) against
the same step with the norm kernels, on tiny checkpoints, the GEMVs running under the interpreter."""
import pytest
import torch

from fixtures.forward_batches import SlotTables
from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from llaunch.runtime.models import build_model

PROMPT = [5, 17, 901, 33, 4, 250, 77, 12, 3000, 41, 8]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request, tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)
    return build_model(model_config_from_folder(folder), device=torch.device("cpu"), dtype=torch.float32)


def _steps(model, monkeypatch, norm_calls):
    """Logits of a prefill then four greedy one-token steps, and the norm kernels each step ran."""
    tables = SlotTables(model, seed=4)
    logits = [model.forward(tables.batch(prefill=[(1, PROMPT)]), tables.kv)]
    per_step = []
    for _ in range(4):
        before = len(norm_calls)
        logits.append(model.forward(tables.batch(decode=[(1, logits[-1][0].argmax().item())]), tables.kv))
        per_step.append(len(norm_calls) - before)
    return logits, per_step


def test_one_row_steps_equal_the_norm_kernels_path(ops, tiny, monkeypatch):
    from llaunch.kernels import dispatch, reference

    # one-row products take the Triton GEMV on CPU tensors too (the interpreter); the norms the
    # layers still call go to the reference, where they are counted
    monkeypatch.setattr(dispatch, "_one_row", lambda x: x.dim() == 2 and x.shape[0] == 1)
    norm_calls = []
    rmsnorm = reference.rmsnorm
    monkeypatch.setattr(reference, "rmsnorm", lambda *a, **kw: norm_calls.append(1) or rmsnorm(*a, **kw))
    runs = {}
    for in_gemv in (False, True):
        monkeypatch.setattr(dispatch, "_NORMS_IN_GEMV", in_gemv)
        runs[in_gemv] = _steps(tiny, monkeypatch, norm_calls)
    layers = tiny.arch.num_hidden_layers
    assert runs[False][1] == [2 * layers + 1] * 4
    assert runs[True][1] == [2] * 4  # the first layer's input norm and the final norm
    kernels_path, in_gemvs = runs[False][0], runs[True][0]
    for a, b in zip(kernels_path, in_gemvs):
        # float32: the two paths differ only in how Σh² is summed (float64 over the GEMV programs)
        tol = 1e-5 * max(1.0, a.abs().max().item())
        assert (a - b).abs().max().item() <= tol
        assert torch.equal(a.argmax(-1), b.argmax(-1))

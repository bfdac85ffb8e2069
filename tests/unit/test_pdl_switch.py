"""The PDL switch (kernels/pdl.py): modes and kernel subsets are validated, and nothing but a CUDA
tensor inside a graph capture (mode `graphs`) is ever launched with PDL."""
from types import SimpleNamespace

import pytest
import torch

from llaunch.kernels import pdl


def test_unknown_mode_and_kernel_are_refused_by_name():
    with pytest.raises(ValueError, match="'sometimes'"):
        pdl.set_mode("sometimes")
    with pytest.raises(ValueError, match="'softmax'"):
        pdl.set_kernels(["gemv", "softmax"])


def test_cpu_tensors_never_launch_with_pdl():
    before = pdl.set_mode("all")
    try:
        with pdl.for_graphs():
            assert not any(pdl.enabled(torch.zeros(1), k) for k in pdl.KERNELS)
    finally:
        pdl.set_mode(before)


@pytest.fixture
def hopper(monkeypatch):
    """A stand-in CUDA tensor on a Hopper GPU (enabled() reads is_cuda and the device only)."""
    monkeypatch.setattr(pdl, "hopper_or_later", lambda index: True)
    monkeypatch.setattr(pdl, "_INTERPRETED", False)
    return SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))


def test_graphs_mode_uses_pdl_only_inside_for_graphs_and_for_the_chosen_kernels(hopper):
    before_mode, before_kernels = pdl.set_mode("graphs"), pdl.set_kernels(["gemv", "rmsnorm"])
    try:
        assert not pdl.enabled(hopper, "gemv")  # an eager launch
        with pdl.for_graphs():
            assert pdl.enabled(hopper, "gemv") and pdl.enabled(hopper, "rmsnorm")
            assert not pdl.enabled(hopper, "rotary") and not pdl.enabled(hopper, "decode_attention")
            with pdl.for_graphs():  # nested (capture inside a warm-up block) stays on, and off after both
                assert pdl.enabled(hopper, "gemv")
            assert pdl.enabled(hopper, "gemv")
        assert not pdl.enabled(hopper, "gemv")
        pdl.set_mode("all")
        assert pdl.enabled(hopper, "gemv")
        pdl.set_mode("0")
        with pdl.for_graphs():
            assert not pdl.enabled(hopper, "gemv")
    finally:
        pdl.set_mode(before_mode), pdl.set_kernels(before_kernels)


def test_defaults_are_every_kernel_with_the_short_ones_late():
    assert set(pdl.DEFAULT_KERNELS) == set(pdl.KERNELS) and set(pdl.DEFAULT_LATE) == {"rotary", "decode_attention"}


@pytest.mark.parametrize("env, kernels, late", [
    ({}, set(pdl.KERNELS), {"rotary", "decode_attention"}),
    ({"LLAUNCH_PDL_KERNELS": "gemv,rmsnorm", "LLAUNCH_PDL_LATE": ""}, {"gemv", "rmsnorm"}, set()),
])
def test_the_process_starts_with_the_kernel_sets_of_its_environment(env, kernels, late):
    """What a worker gets at import: the defaults, or the variables' sets (2d98bb0 parsed both into
    empty sets, which switched PDL off everywhere without an error)."""
    import json
    import os
    import subprocess
    import sys

    code = "import json; from llaunch.kernels import pdl; print(json.dumps([sorted(pdl._kernels), sorted(pdl._late)]))"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLAUNCH_PDL")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [sorted(kernels), sorted(late)]


def test_late_trigger_is_chosen_per_kernel():
    """LLAUNCH_PDL_LATE: the kernels that let the next one launch only after their own wait."""
    before = pdl.set_late(["decode_attention"])
    try:
        assert pdl.flavor(True, "decode_attention") == pdl.LATE and pdl.flavor(True, "gemv") == pdl.EARLY
        assert pdl.flavor(False, "decode_attention") == pdl.flavor(False, "gemv") == 0
        with pytest.raises(ValueError, match="'softmax'"):
            pdl.set_late(["softmax"])
    finally:
        pdl.set_late(before)

"""The PDL settings (kernels/pdl.py through kernels/settings.py): modes and kernel subsets are
validated, and nothing but a CUDA tensor inside a graph capture (mode `graphs`) is ever launched
with PDL."""
from types import SimpleNamespace

import pytest
import torch

from llaunch.kernels import pdl, settings


def test_unknown_mode_and_kernel_are_refused_by_name(kernel_settings):
    with pytest.raises(ValueError, match="'sometimes'"):
        kernel_settings(pdl="sometimes")
    with pytest.raises(ValueError, match="'softmax'"):
        kernel_settings(pdl_kernels=["gemv", "softmax"])
    with pytest.raises(ValueError, match="'softmax'"):
        kernel_settings(pdl_late=["softmax"])
    assert settings.current.pdl == settings.Pdl.graphs  # a refused setting changes nothing


def test_cpu_tensors_never_launch_with_pdl(kernel_settings):
    kernel_settings(pdl="all")
    with pdl.for_graphs():
        assert not any(pdl.enabled(torch.zeros(1), k) for k in pdl.KERNELS)


@pytest.fixture
def hopper(monkeypatch):
    """A stand-in CUDA tensor on a Hopper GPU (enabled() reads is_cuda and the device only)."""
    monkeypatch.setattr(pdl, "hopper_or_later", lambda index: True)
    monkeypatch.setattr(pdl, "_INTERPRETED", False)
    return SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))


def test_graphs_mode_uses_pdl_only_inside_for_graphs_and_for_the_chosen_kernels(hopper, kernel_settings):
    kernel_settings(pdl="graphs", pdl_kernels=["gemv", "rmsnorm"])
    assert not pdl.enabled(hopper, "gemv")  # an eager launch
    with pdl.for_graphs():
        assert pdl.enabled(hopper, "gemv") and pdl.enabled(hopper, "rmsnorm")
        assert not pdl.enabled(hopper, "rotary") and not pdl.enabled(hopper, "decode_attention")
        with pdl.for_graphs():  # nested (capture inside a warm-up block) stays on, and off after both
            assert pdl.enabled(hopper, "gemv")
        assert pdl.enabled(hopper, "gemv")
    assert not pdl.enabled(hopper, "gemv")
    kernel_settings(pdl="all", pdl_kernels=["gemv"])
    assert pdl.enabled(hopper, "gemv")
    kernel_settings(pdl="off")
    with pdl.for_graphs():
        assert not pdl.enabled(hopper, "gemv")


def test_late_trigger_is_chosen_per_kernel(kernel_settings):
    """kernels.pdl_late: the kernels that let the next one launch only after their own wait."""
    kernel_settings(pdl_late=["decode_attention"])
    assert pdl.flavor(True, "decode_attention") == pdl.LATE and pdl.flavor(True, "gemv") == pdl.EARLY
    assert pdl.flavor(False, "decode_attention") == pdl.flavor(False, "gemv") == 0


def test_a_worker_applies_its_run_configs_kernel_settings(tmp_path):
    """What a worker process gets: the `kernels` group of its run's config.yaml, applied before it
    launches anything (runtime/worker/process.py), so config.yaml reproduces a run's kernels."""
    import json
    import subprocess
    import sys

    import msgspec

    from llaunch.runtime.config import RunConfig

    cfg = RunConfig(kernels=settings.KernelSettings(pdl="all", pdl_kernels=["gemv"], pdl_late=[], gemv="cublas"))
    path = tmp_path / "config.yaml"
    path.write_bytes(msgspec.yaml.encode(cfg))
    code = ("import json, msgspec\n"
            "from llaunch.kernels import settings\n"
            "from llaunch.runtime.config import RunConfig\n"
            f"cfg = msgspec.yaml.decode(open({str(path)!r}, 'rb').read(), type=RunConfig)\n"
            "settings.configure(cfg.kernels)\n"
            "a = settings.current\n"
            "print(json.dumps([a.pdl.value, sorted(a.pdl_kernels), sorted(a.pdl_late), a.triton_gemv]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == ["all", ["gemv"], [], False]

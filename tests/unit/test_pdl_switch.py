"""The PDL switch (kernels/pdl.py): modes and kernel subsets are validated, and nothing but a CUDA
tensor inside a graph capture (mode `graphs`) is ever launched with PDL."""
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


def test_launch_options_name_the_triton_keyword_only_when_on():
    assert pdl.launch_options(True) == {"launch_pdl": True}
    assert pdl.launch_options(False) == {}

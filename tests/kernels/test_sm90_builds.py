"""Every attention launch the GPU path makes fits an H200 (sm90): 227 KB of shared memory a program.
Compiled here for sm90 without a GPU (a subprocess without the interpreter), with the launch shapes
and dot precisions the wrappers pick per dtype and head size. A shape over the limit fails at its
first launch on the GPU (float32 with head_dim 128 needed 257 KB until the float32 shapes)."""
import pytest

SHARED_LIMIT = 232448  # bytes a program may use on sm90 (cudaDevAttrMaxSharedMemoryPerBlockOptin)

_COMPILE = r'''
import importlib, inspect, json, types
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
dec = importlib.import_module("llaunch.kernels.decode_attention")  # the package binds the ops' names
pre = importlib.import_module("llaunch.kernels.prefill_attention")

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def signature(fn, constexprs, elem):
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("req_to_slots_ptr",):
            sig[name] = "*i32"
        elif name in ("rows_ptr", "q_starts_ptr", "q_lens_ptr", "prefix_lens_ptr", "seq_lens_ptr"):
            sig[name] = "*i64"
        elif name in ("mid_o_ptr", "mid_lse_ptr"):
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*" + elem
        elif name == "qk_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


out = {}
target = GPUTarget("cuda", 90, 32)
for dtype, elem in TYPES.items():
    for dim in (64, 128):
        q = types.SimpleNamespace(is_cuda=True, dtype=dtype)
        block_m, block_n, warps, stages = pre._launch_shape(q, dim)
        constexprs = dict(GROUP=7, UPCAST=False, PRECISION=pre._precision(q), BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_D=dim)
        kernel = triton.compile(ASTSource(fn=pre._prefill_kernel, signature=signature(pre._prefill_kernel, constexprs, elem),
                                          constexprs=constexprs), target=target,
                                options={"num_warps": warps, "num_stages": stages})
        out[f"prefill {elem} dim {dim}"] = kernel.metadata.shared
        block_n, warps, stages = dec._launch_shape(q, dim)
        for direct in (False, True):
            constexprs = dict(GROUP=7, DIRECT=direct, UPCAST=False,
                              PRECISION="ieee" if dtype == torch.float32 else "tf32", PDL=1, PRE_WAIT=True, BLOCK_H=16,
                              BLOCK_N=block_n, BLOCK_D=dim)
            kernel = triton.compile(ASTSource(fn=dec._decode_split_kernel,
                                              signature=signature(dec._decode_split_kernel, constexprs, elem),
                                              constexprs=constexprs), target=target,
                                    options={"num_warps": warps, "num_stages": stages})
            out[f"decode {elem} dim {dim} {'one split' if direct else 'splits'}"] = kernel.metadata.shared
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def shared_bytes(sm90_compile):
    return sm90_compile(_COMPILE)


def test_every_attention_build_fits_sm90_shared_memory(shared_bytes):
    assert len(shared_bytes) == 18
    over = {name: size for name, size in shared_bytes.items() if size > SHARED_LIMIT}
    assert not over, f"over the {SHARED_LIMIT} bytes of shared memory a program may use on sm90: {over}"

"""Every attention launch the GPU path makes fits an H200 (sm90): 227 KB of shared memory a program.
Compiled here for sm90 without a GPU (a subprocess without the interpreter), with the launch shapes
and dot precisions the wrappers pick per dtype and head size. A shape over the limit fails at its
first launch on the GPU (float32 with head_dim 128 needed 257 KB until the float32 shapes)."""
import pytest

pytestmark = pytest.mark.slow  # compiles for sm90 in subprocesses: `make test` runs it, `make test-fast` does not

SHARED_LIMIT = 232448  # bytes a program may use on sm90 (cudaDevAttrMaxSharedMemoryPerBlockOptin)

_COMPILE = r'''
import importlib, inspect, json, types
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
dec = importlib.import_module("llaunch.kernels.decode_attention")
pre = importlib.import_module("llaunch.kernels.prefill_attention")

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def signature(fn, constexprs, elem):
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("k_cache_ptr", "v_cache_ptr") and constexprs.get("FP8_KV"):
            sig[name] = "*fp8e4nv"
        elif name in ("k_scale_ptr", "v_scale_ptr"):
            sig[name] = "*fp32"
        elif name in ("req_to_slots_ptr",):
            sig[name] = "*i32"
        elif name in ("rows_ptr", "q_starts_ptr", "q_lens_ptr", "prefix_lens_ptr", "seq_lens_ptr"):
            sig[name] = "*i64"
        elif name in ("mid_o_ptr", "mid_lse_ptr"):
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*" + elem
        elif name in ("qk_scale", "cap"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


out = {}
target = GPUTarget("cuda", 90, 32)
# the fp8 KV cache's builds (cache.kv_dtype=fp8_e4m3) with a bf16 model
# Gemma's head size 256 with its sliding window and soft-capping (the masks add no tiles: checked with them on)
for dtype, elem, fp8 in [(d, e, False) for d, e in TYPES.items()] + [(torch.bfloat16, "bf16", True)]:
    for dim in (64, 128, 256):
        masks = dict(WINDOW=dim == 256, SOFTCAP=dim == 256)
        q = types.SimpleNamespace(is_cuda=True, dtype=dtype)
        block_m, block_n, warps, stages = pre._launch_shape(q, dim)
        elem_name = elem + (" fp8 KV" if fp8 else "")
        constexprs = dict(GROUP=7, UPCAST=False, FP8_KV=fp8, FRESH=fp8, PRECISION=pre._precision(q),
                          DOT=triton.language.float32 if dtype == torch.float32 else triton.language.float16,
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=dim, **masks)
        kernel = triton.compile(ASTSource(fn=pre._prefill_kernel, signature=signature(pre._prefill_kernel, constexprs, elem),
                                          constexprs=constexprs), target=target,
                                options={"num_warps": warps, "num_stages": stages})
        out[f"prefill {elem_name} dim {dim}"] = kernel.metadata.shared
        for direct in (False, True):
            block_n, warps, stages = dec._launch_shape(q, dim, 1 if direct else 64)
            constexprs = dict(GROUP=7, DIRECT=direct, UPCAST=False, FP8_KV=fp8,
                              DOT=triton.language.float32 if dtype == torch.float32 else triton.language.float16,
                              PRECISION="ieee" if dtype == torch.float32 else "tf32", PDL=1, BLOCK_H=16,
                              BLOCK_N=block_n, BLOCK_D=dim, **masks)
            kernel = triton.compile(ASTSource(fn=dec._decode_split_kernel,
                                              signature=signature(dec._decode_split_kernel, constexprs, elem),
                                              constexprs=constexprs), target=target,
                                    options={"num_warps": warps, "num_stages": stages})
            out[f"decode {elem_name} dim {dim} {'one split' if direct else 'splits'}"] = kernel.metadata.shared
# prefill over an fp8 cache holding the chunk's own K/V too (no k_new: every block from the cache, as e4m3 products)
for dim in (64, 128, 256):
    q = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    block_m, block_n, warps, stages = pre._launch_shape(q, dim)
    constexprs = dict(GROUP=7, UPCAST=False, FP8_KV=True, FRESH=False, PRECISION="tf32", DOT=triton.language.float16,
                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=dim, WINDOW=dim == 256, SOFTCAP=dim == 256)
    sig = signature(pre._prefill_kernel, constexprs, "bf16")
    kernel = triton.compile(ASTSource(fn=pre._prefill_kernel, signature=sig, constexprs=constexprs), target=target,
                            options={"num_warps": warps, "num_stages": stages})
    out[f"prefill bf16 fp8 KV cached dim {dim}"] = kernel.metadata.shared
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def shared_bytes(sm90_compile):
    return sm90_compile(_COMPILE)


def test_every_attention_build_fits_sm90_shared_memory(shared_bytes):
    assert len(shared_bytes) == 39
    over = {name: size for name, size in shared_bytes.items() if size > SHARED_LIMIT}
    assert not over, f"over the {SHARED_LIMIT} bytes of shared memory a program may use on sm90: {over}"


_COMPILE_STAGED = r'''
import importlib, inspect, json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
staged = importlib.import_module("llaunch.kernels.gemv_staged")
gemv = importlib.import_module("llaunch.kernels.gemv")

fn = staged._gemv_staged_kernel
block_n, block_k, warps, stages = 16, 256, 4, 4  # the LM head's built-in shape
out = {}
# (input dtype, output dtype, gated): bf16 and float32 models, and the LM head's float32 logits from bf16
builds = [(e, e, g) for e in ("bf16", "fp32") for g in (False, True)] + [("bf16", "fp32", False)]
for elem, out_elem, gated in builds:
    bits = 16 if elem == "bf16" else 32
    for flavor in (0, 1, 2):
        constexprs = dict(HAS_BIAS=False, GATED=gated, PDL=flavor, X_ASM=staged._x_load_asm(bits, bool(flavor)),
                          INTERPRETED=False, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages)
        names = list(inspect.signature(fn.fn).parameters)
        sig = {n: "constexpr" if n in constexprs else f"tensordesc<{elem}[{block_n},{block_k}]>" if n == "w_desc"
               else f"*{out_elem}" if n == "out_ptr" else f"*{elem}" if n.endswith("_ptr") else "i32" for n in names}
        # what the launch specializes on: 16-byte aligned pointers, sizes divisible by 16
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n] == "i32" or sig[n][0] == "*"}
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        out[f"{elem}->{out_elem} gated={gated} pdl={flavor}"] = dict(shared=kernel.metadata.shared, ptx=kernel.asm["ptx"])
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def staged_builds(sm90_compile):
    return sm90_compile(_COMPILE_STAGED)


def test_staged_gemv_builds_fit_and_load_x_only_after_the_pdl_wait(staged_builds):
    """The TMA-staged GEMV (the LM head's kernel) for sm90, bf16 and float32, gated or not, the LM
    head's bf16 → float32 logits, without PDL
    and with both triggers: it fits in shared memory; under PDL its weight tiles are requested before
    the wait and every load of x (the previous kernel's output) waits itself, in the same asm block;
    without PDL nothing waits."""
    assert len(staged_builds) == 15
    for name, build in staged_builds.items():
        assert build["shared"] <= SHARED_LIMIT, name
        lines = build["ptx"].splitlines()
        x_loads = [line for line in lines if "ld.global.b16" in line or "ld.global.b32" in line]
        assert x_loads, name
        if name.endswith("pdl=0"):
            assert "griddepcontrol.wait" not in build["ptx"], name
            continue
        assert all("griddepcontrol.wait" in line for line in x_loads), name
        first_wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
        first_tma = next(i for i, line in enumerate(lines) if "cp.async.bulk.tensor" in line)
        assert first_tma < first_wait, f"{name}: no weight tile requested before the PDL wait"


_COMPILE_SPLIT = r'''
import importlib, inspect, json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
fp8 = importlib.import_module("llaunch.kernels.gemv_fp8")

fn = fp8._gemv_fp8_kernel
out = {}
for split in (1, 4):
    constexprs = dict(DYNAMIC=True, HAS_UB=False, HAS_BIAS=False, GATED=False, PDL=1, BLOCK_N=32, BLOCK_K=256,
                      STAGES=3, SPLIT=split, AMAX_BLOCK=4096, SWAP_AB=False, INTERPRETED=False)
    names = list(inspect.signature(fn.fn).parameters)
    types = {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "xs_ptr": "*fp32", "part_ptr": "*fp32", "count_ptr": "*i32",
             "scale_ub": "fp32"}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "*bf16" if n.endswith("_ptr") else "i32") for n in names}
    # the launcher's specialization (Qwen2-7B's ints, strides included, are multiples of 16)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n][0] == "*" or n in ("N", "K", "w_stride", "up_offset", "x_stride", "out_stride")}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    out[f"split={split}"] = dict(shared=kernel.metadata.shared, ptx=kernel.asm["ptx"])
print(json.dumps(out))
'''


def test_split_k_fp8_gemv_counts_arrivals_after_its_partials_and_reads_theirs_from_l2(sm90_compile):
    """The fp8 tensor-core GEMV with K split (kernels/gemv_fp8.py) for sm90: each program stores its partial sums,
    then one thread takes the tile's counter with an acquire-release atomic at GPU scope after a barrier (every
    thread's partial is stored before the arrival counts); the last program reads the partials past L1
    (ld.global.cg: another SM wrote them) and resets the counter. Unsplit, no atomics at all."""
    builds = sm90_compile(_COMPILE_SPLIT)
    assert builds["split=1"]["shared"] <= SHARED_LIMIT and "atom." not in builds["split=1"]["ptx"]
    lines = builds["split=4"]["ptx"].splitlines()
    assert builds["split=4"]["shared"] <= SHARED_LIMIT
    atoms = [i for i, line in enumerate(lines) if "atom." in line]
    assert [lines[i].split()[1] for i in atoms] == ["atom.global.gpu.acq_rel.add.u32", "atom.global.gpu.relaxed.exch.b32"]
    assert all(lines[i].lstrip().startswith("@%p") for i in atoms)  # predicated: one thread of the program
    partial_store = max(i for i, line in enumerate(lines[:atoms[0]]) if "st.global" in line)
    assert any("bar.sync" in line for line in lines[partial_store:atoms[0]])
    partial_loads = [i for i, line in enumerate(lines) if "ld.global.cg" in line]
    assert len(partial_loads) == 4 and min(partial_loads) > atoms[0]


_COMPILE_WORDS = r"""
import importlib, inspect, json, os, subprocess, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
gemv = importlib.import_module("llaunch.kernels.gemv")

fn = gemv._gemv_kernel
dump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
out = {}
# the e4m3 register kernel reading words (kernels.fp8_words, dynamic x) at the built-in shapes of Qwen2-7B's qkv
# (8/512/4), o_proj (16/512/8) and down_proj (32/1024/8), and with K split 2 and 4 ways; its gated gate‖up (8/512/4)
for block_n, block_k, warps, split, gated in ((8, 512, 4, 1, False), (8, 512, 4, 2, False), (16, 512, 8, 1, False),
                                              (16, 512, 8, 2, False), (32, 1024, 8, 1, False), (32, 1024, 8, 4, False),
                                              (8, 512, 4, 1, True)):
    constexprs = dict(HAS_SCALE=True, ACT=1, HAS_UB=False, HAS_BIAS=False, GATED=gated, PDL=1, BLOCK_N=block_n,
                      BLOCK_K=block_k, X_AHEAD=not gated, AMAX_BLOCK=1024, INTERPRETED=False, WORDS=True,
                      ROW_GRID=False, SPLIT=split)
    names = list(inspect.signature(fn.fn).parameters)
    types = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "xs_ptr": "*fp32", "b_ptr": "*bf16",
             "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", "scale_ub": "fp32"}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    # the launcher's specialization: Qwen2-7B's ints are multiples of 16 (the strides too: without them the weight
    # loads compile to 32-bit words, not 128-bit, and the registers differ: 8/512/4 40 instead of 64)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n][0] == "*" or n in ("N", "K", "w_stride", "up_offset", "x_stride", "out_stride")}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([dump, "--dump-resource-usage", cubin.name], capture_output=True, text=True).stdout
    line = next(l for l in usage.splitlines() if "REG:" in l)
    fields = dict(f.split(":") for f in line.split() if ":" in f and f.split(":")[0].isupper())
    out[f"{block_n}/{block_k}/{warps}/{split}" + ("/gated" if gated else "")] = dict(
        ptx=kernel.asm["ptx"], regs=int(fields["REG"]), local=int(fields["LOCAL"]), stack=int(fields["STACK"]))
print(json.dumps(out))
"""


def test_split_fp8_word_gemv_builds_keep_their_registers_and_count_arrivals_after_their_partials(sm90_compile):
    """The e4m3 register kernel reading words (kernels.fp8_words) for sm90 at Qwen2-7B's built-in shapes (gate‖up's
    too) and with K split (SPLIT with STAGES 0): no spills (no local memory or stack: a spill would put the weight
    tiles in flight through memory; gate‖up reads two rows an output), a split build within 8 registers a thread of
    the whole-K one (the programs an SM holds stay as gpu_calls.sh's candidates count them); split, one thread takes
    the tile's counter (acquire-release at GPU scope) after the program's partials are stored and the last program
    reads the shares past L1 (ld.global.cg); unsplit, no atomics."""
    builds = sm90_compile(_COMPILE_WORDS)
    assert len(builds) == 7
    for name, build in builds.items():
        assert build["local"] == 0 and build["stack"] == 0, (name, build["local"], build["stack"])
        split = int(name.split("/")[3])
        whole = builds["/".join(name.split("/")[:3]) + "/1" + ("/gated" if name.endswith("/gated") else "")]
        assert build["regs"] <= whole["regs"] + 8, (name, build["regs"], whole["regs"])
        lines = build["ptx"].splitlines()
        atoms = [i for i, line in enumerate(lines) if "atom." in line]
        if split == 1:
            assert not atoms, name
            continue
        assert [lines[i].split()[1] for i in atoms] == ["atom.global.gpu.acq_rel.add.u32",
                                                        "atom.global.gpu.relaxed.exch.b32"], name
        assert all(lines[i].lstrip().startswith("@%p") for i in atoms), name  # predicated: one thread of the program
        assert any("st.global" in line for line in lines[:atoms[0]]), name
        partial_loads = [i for i, line in enumerate(lines) if "ld.global.cg" in line]
        assert partial_loads and min(partial_loads) > atoms[0], name


_COMPILE_SWAP = r'''
import importlib, inspect, json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
fp8 = importlib.import_module("llaunch.kernels.gemv_fp8")

fn = fp8._gemv_fp8_kernel
out = {}
# scripts/gpu_calls.sh's candidates (BLOCK_N, BLOCK_K, STAGES, SPLIT, gated) and gate‖up's built-in tile of 32 rows
for block_n, block_k, stages, split, gated in ((64, 256, 3, 2, False), (64, 128, 4, 4, False), (64, 256, 3, 1, True),
                                               (32, 256, 3, 1, True)):
    constexprs = dict(DYNAMIC=True, HAS_UB=False, HAS_BIAS=False, GATED=gated, PDL=1, BLOCK_N=block_n,
                      BLOCK_K=block_k, STAGES=stages, SPLIT=split, AMAX_BLOCK=4096, SWAP_AB=True, INTERPRETED=False)
    names = list(inspect.signature(fn.fn).parameters)
    types = {"w_ptr": f"tensordesc<fp8e4nv[{block_n}, {block_k}]>", "s_ptr": "*fp32", "xs_ptr": "*fp32",
             "part_ptr": "*fp32", "count_ptr": "*i32", "scale_ub": "fp32"}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "*bf16" if n.endswith("_ptr") else "i32") for n in names}
    # the launcher's specialization (Qwen2-7B's ints, strides included, are multiples of 16)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n][0] == "*" or n in ("N", "K", "w_stride", "up_offset", "x_stride", "out_stride")}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages})
    out[f"{block_n}/{block_k}/{stages}/{split}{'/gated' if gated else ''}"] = dict(shared=kernel.metadata.shared,
                                                                                  ptx=kernel.asm["ptx"])
print(json.dumps(out))
'''


def test_swapped_fp8_gemv_builds_stream_weights_by_tma_into_fp8_warpgroup_mmas(sm90_compile):
    """kernels.fp8_swap_ab's GEMV for sm90: the weight tiles come by TMA and feed e4m3 × e4m3 warpgroup MMAs of 64
    weight rows by x's 16 columns, within an SM's shared memory; a tile of 32 rows builds too, to mma.sync on operands
    converted to f16 (as the unswapped kernel's dot of 16 x rows does: triton 3.9)."""
    builds = sm90_compile(_COMPILE_SWAP)
    assert len(builds) == 4
    for name, build in builds.items():
        assert build["shared"] <= SHARED_LIMIT, name
        ptx = build["ptx"]
        assert "cp.async.bulk.tensor" in ptx, name
        wgmma = "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3" in ptx
        assert wgmma == name.startswith("64/"), name


_COMPILE_SKINNY = r'''
import importlib, inspect, json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sk = importlib.import_module("llaunch.kernels.skinny_gemm")

fn = sk._skinny_kernel
out = {}
# the built-in shapes: Qwen2-7B's down_proj (K split 4 ways), gate‖up (gated, whole K), PDL as in the decode graphs;
# a small model's 16-row tiles (SmolLM2's down_proj, K split 2 ways, and gate‖up)
shapes = {"down": (64, False, 4), "gate_up": (32, True, 1), "lm_head": (64, False, 1), "small_down": (16, False, 2),
          "small_gate_up": (16, True, 1)}
for name, (block_n, gated, split) in shapes.items():
    constexprs = dict(HAS_BIAS=False, GATED=gated, PDL=1, BLOCK_N=block_n, BLOCK_K=128, STAGES=4, SPLIT=split,
                      INTERPRETED=False)
    names = list(inspect.signature(fn.fn).parameters)
    types = {"part_ptr": "*fp32", "count_ptr": "*i32"}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "*bf16" if n.endswith("_ptr") else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n][0] == "*" or n in ("N", "K", "x_stride", "w_stride", "out_stride", "up_offset")}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
    out[name] = dict(shared=kernel.metadata.shared, ptx=kernel.asm["ptx"])
print(json.dumps(out))
'''


def test_skinny_gemm_builds_fit_and_multiply_on_the_tensor_cores(sm90_compile):
    """The 2-16-row GEMM (kernels/skinny_gemm.py) for sm90 at its built-in shapes: it fits in shared memory, its
    products are MMA instructions (not FMAs on the CUDA cores), its weight tiles are staged by asynchronous copies
    (the loop pipeliner), and the split build counts its arrival after its partials as the fp8 GEMV's does."""
    builds = sm90_compile(_COMPILE_SKINNY)
    for name, build in builds.items():
        assert build["shared"] <= SHARED_LIMIT, name
        assert "mma" in build["ptx"] and "cp.async" in build["ptx"], name
        assert ("atom." in build["ptx"]) == (name in ("down", "small_down")), name
    lines = builds["down"]["ptx"].splitlines()
    atoms = [i for i, line in enumerate(lines) if "atom." in line]
    assert [lines[i].split()[1] for i in atoms] == ["atom.global.gpu.acq_rel.add.u32", "atom.global.gpu.relaxed.exch.b32"]
    partial_store = max(i for i, line in enumerate(lines[:atoms[0]]) if "st.global" in line)
    assert any("bar.sync" in line for line in lines[partial_store:atoms[0]])
    assert min(i for i, line in enumerate(lines) if "ld.global.cg" in line) > atoms[0]


_COMPILE_QUANTIZERS = r"""
import importlib, inspect, json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
gq = importlib.import_module("llaunch.kernels.fp8_gated_quant")
norm = importlib.import_module("llaunch.kernels.rmsnorm")
rows = importlib.import_module("llaunch.kernels.fp8_rows")


def build(fn, constexprs, types, warps):
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in constexprs else types.get(n, "*fp32" if n.endswith("_ptr") else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n] == "i32" or sig[n][0] == "*"}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]


block, tail = gq.row_blocks(18944)  # Qwen2-7B's intermediate width, one row a program of 32 warps as launched
out = {}
for own in (True, False):  # a row's own absmax scale, or one clipped to scale_ub
    name = "own scale" if own else "clipped scale"
    out["gated " + name] = build(gq._gated_quant_kernel, dict(
        SCALED=True, STATIC=False, HAS_UB=not own, ACT=0, DTYPE=0, BLOCK=block, TAIL=tail, ONE_PASS=True,
        INTERPRETED=False), {"y_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ub": "fp32"}, 32)
    # Qwen2-7B's hidden size in one block of 8 warps (rmsnorm's launch), the residual added
    out["norm " + name] = build(norm._rmsnorm_kernel, dict(
        HAS_RESIDUAL=True, PDL=0, BLOCK=4096, QUANT=True, STATIC=False, HAS_UB=not own, SUMS=False, INTERPRETED=False),
        {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "out_ptr": "*fp8e4nv",
         "eps": "fp32", "scale_ub": "fp32"}, 8)
    out["rows " + name] = build(rows._quantize_rows_kernel, dict(
        STATIC=False, HAS_UB=not own, BLOCK_K=rows.BLOCK_K, INTERPRETED=False),
        {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ub": "fp32"}, 4)
print(json.dumps(out))
"""


def test_activation_quantizers_divide_once_a_row_by_its_own_scale(sm90_compile):
    """The kernels that quantize activations to e4m3 by a row's own absmax scale (the fp8 MLP's gated quantize, the
    norm before q‖k‖v and gate‖up, quantize_rows) take the row's reciprocal once and a value's quotient by product
    and FMA (e4m3.quotient_rn): their sm90 builds have a row's two divisions (the scale, the reciprocal), where a scale
    clipped to scale_ub (quotients beyond ±448) keeps a division a value; all convert to e4m3 in pairs with saturation
    (kernels/fp8.to_fp8's clamp)."""
    builds = sm90_compile(_COMPILE_QUANTIZERS)
    # values a thread a row: the gated row's two blocks over 1,024 threads; 4,096 over 256; a 1,024-column tile over 128
    values = {"gated": (16384 + 4096) // 1024, "norm": 4096 // 256, "rows": 1024 // 128}
    for kernel, per_thread in values.items():
        own, clipped = builds[f"{kernel} own scale"], builds[f"{kernel} clipped scale"]
        assert own.count("div.rn.f32") == 2, kernel
        # a value's product, then its two FMAs (the remainder, the correction) and the select that keeps -0's sign
        assert own.count("fma.rn.f32") >= 2 * per_thread and own.count("selp.f32") >= per_thread, kernel
        # the conversion saturates for the clamp, which the dividing build keeps (min.xorsign.abs a value)
        assert "xorsign" not in own and "cvt.rn.satfinite.e4m3x2.f32" in own, kernel
        assert clipped.count("div.rn.f32") >= per_thread and "xorsign" in clipped, kernel

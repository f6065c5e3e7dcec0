"""Compile-only check of the TLX kernels (no GPU): `python -m jfa.tlx.compile_check [--quick]`.

Needs fbtriton (Triton with TLX; it ships ptxas). Compiles every configuration (head dims × dtypes × mask
kinds) of each TLX kernel of `jfa.tlx.backend` (the forward of `KERNELS`, the dQ, dK/dV and short-query
passes of `BWD_KERNELS`) for each architecture with triton.compile(ASTSource(...), target=GPUTarget("cuda", arch,
32)), then runs ptxas -v on the PTX and prints per configuration: the launch register count, the per-warpgroup
budgets set by setmaxnreg (producer / consumers), spill bytes and shared memory (which must fit the 227 KiB a
Hopper CTA can have). Exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import time

MAX_SHARED = 232_448  # bytes of shared memory one CTA may use on sm_90 (227 KiB)


def _signature(fn, constexprs: dict, descriptors: dict, pointers: dict, floats: tuple, aligned: tuple):
    """Argument types as the launcher specialises them: tensor descriptors and pointers by name (pointers
    16-byte aligned), the named float scalars, the rest int32 (`aligned` ones divisible by 16)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in descriptors:
            sig[name] = f"tensordesc<{descriptors[name]}>"
        elif name in pointers:
            sig[name] = f"*{pointers[name]}"
        else:
            sig[name] = "fp32" if name in floats else "i32"
        if sig[name].startswith("*") or name in aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def forward_kernel(dtype: str, d: int, causal: bool, window: bool, neg: bool):
    """(kernel name, constexprs, signature arguments, label) of a `fwd_ws_kernel` configuration."""
    from jfa.tlx.backend import CONFIGS

    cfg = CONFIGS[d]
    constexprs = dict(HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, Q_BUFFERS=cfg.q_buffers,
                      KV_BUFFERS=cfg.kv_buffers, NEG_SCALE=neg, HAS_WINDOW=window, CAUSAL=causal)
    descriptors = {"desc_q": f"{dtype}[{cfg.block_m // 2},{d}]", "desc_k": f"{dtype}[{cfg.block_n},{d}]",
                   "desc_v": f"{dtype}[{cfg.block_n},{d}]"}
    pointers = {"Out": dtype, "Lse": "fp32", "RowMax": "fp32", "RowSum": "fp32", **_INDEX_POINTERS}
    types = (descriptors, pointers, ("scale_log2", "scale_abs"), ("sq_h", "sk_h", "sv_h", "so_t", "so_h"))
    return "fwd_ws_kernel", constexprs, types, f"q_buf={cfg.q_buffers} kv_buf={cfg.kv_buffers}"


def backward_kernel(dtype: str, d: int, causal: bool, window: bool, neg: bool, dq_reduce: bool = False):
    """(kernel name, constexprs, signature arguments, label) of a `dkv_ws_kernel` configuration; `dq_reduce`:
    the variant that also adds dq into an fp32 array by TMA reduce."""
    from jfa.tlx.backend import BWD_BLOCK_M, BWD_BLOCK_N, BWD_BUFFERS

    constexprs = dict(HEAD_DIM=d, BLOCK_M=BWD_BLOCK_M, BLOCK_N=BWD_BLOCK_N, BUFFERS=BWD_BUFFERS, NEG_SCALE=neg,
                      HAS_WINDOW=window, CAUSAL=causal, DQ_REDUCE=dq_reduce)
    descriptors = {"desc_q": f"{dtype}[{BWD_BLOCK_M},{d}]", "desc_do": f"{dtype}[{BWD_BLOCK_M},{d}]",
                   "desc_k": f"{dtype}[{BWD_BLOCK_N // 2},{d}]", "desc_v": f"{dtype}[{BWD_BLOCK_N // 2},{d}]",
                   **{name: f"fp32[{2 * BWD_BLOCK_M}]" for name in ("desc_shift", "desc_scale", "desc_delta")}}
    if dq_reduce:
        descriptors["desc_dq"] = f"fp32[{BWD_BLOCK_M},{d // 2}]"
    else:
        constexprs["desc_dq"] = None
    pointers = {"DK": dtype, "DV": dtype, **_INDEX_POINTERS}
    types = (descriptors, pointers, ("scale_log2", "sm_scale"),
             ("sq_h", "sdo_h", "sk_h", "sv_h", "sdk_t", "sdk_h", "sdv_t", "sdv_h", "sdq_h"))
    return "dkv_ws_kernel", constexprs, types, f"buf={BWD_BUFFERS}" + (" dq_reduce" if dq_reduce else "")


def dq_kernel(dtype: str, d: int, causal: bool, window: bool, neg: bool):
    """(kernel name, constexprs, signature arguments, label) of a `dq_ws_kernel` configuration."""
    from jfa.tlx.backend import DQ_BLOCK_M, DQ_BLOCK_N, DQ_KV_BUFFERS, DQ_Q_BUFFERS

    constexprs = dict(HEAD_DIM=d, BLOCK_M=DQ_BLOCK_M, BLOCK_N=DQ_BLOCK_N, Q_BUFFERS=DQ_Q_BUFFERS,
                      KV_BUFFERS=DQ_KV_BUFFERS, NEG_SCALE=neg, HAS_WINDOW=window, CAUSAL=causal)
    descriptors = {"desc_q": f"{dtype}[{DQ_BLOCK_M // 2},{d}]", "desc_do": f"{dtype}[{DQ_BLOCK_M // 2},{d}]",
                   "desc_k": f"{dtype}[{DQ_BLOCK_N},{d}]", "desc_v": f"{dtype}[{DQ_BLOCK_N},{d}]"}
    pointers = {"Out": dtype, "DQ": dtype, "RowMax": "fp32", "RowSum": "fp32", "Delta": "fp32", **_INDEX_POINTERS}
    types = (descriptors, pointers, ("scale_log2", "sm_scale"),
             ("sq_h", "sdo_h", "sk_h", "sv_h", "so_t", "so_h", "sdq_t", "sdq_h"))
    return "dq_ws_kernel", constexprs, types, f"q_buf={DQ_Q_BUFFERS} kv_buf={DQ_KV_BUFFERS}"


def short_kernel(dtype: str, d: int, causal: bool, window: bool, neg: bool, dq_partial: bool = True):
    """(kernel name, constexprs, signature arguments, label) of a `short_ws_kernel` configuration."""
    from jfa.tlx.backend import SHORT_BLOCK_M, SHORT_BLOCK_N, SHORT_K_BUFFERS, SHORT_V_BUFFERS

    constexprs = dict(HEAD_DIM=d, BLOCK_M=SHORT_BLOCK_M, BLOCK_N=SHORT_BLOCK_N, K_BUFFERS=SHORT_K_BUFFERS,
                      V_BUFFERS=SHORT_V_BUFFERS, NEG_SCALE=neg, HAS_WINDOW=window, CAUSAL=causal, DQ_PARTIAL=dq_partial)
    descriptors = {"desc_q": f"{dtype}[{SHORT_BLOCK_M},{d}]", "desc_do": f"{dtype}[{SHORT_BLOCK_M},{d}]",
                   **{name: f"{dtype}[{SHORT_BLOCK_N},{d}]" for name in ("desc_k", "desc_v", "desc_dk", "desc_dv")},
                   **{name: f"fp32[{2 * SHORT_BLOCK_M}]" for name in ("desc_m", "desc_l")}}
    pointers = {"Out": dtype, "DQ": "fp32" if dq_partial else dtype, "DK": dtype, "DV": dtype, "lists": "i32",
                "list_starts": "i32", **_INDEX_POINTERS}
    types = (descriptors, pointers, ("scale_log2", "sm_scale"),
             ("sq_h", "sdo_h", "sk_h", "sv_h", "sdq_t", "sdq_h", "sdk_t", "sdk_h", "sdv_t", "sdv_h"))
    label = f"k_buf={SHORT_K_BUFFERS} v_buf={SHORT_V_BUFFERS}" + (" partial" if dq_partial else "")
    return "short_ws_kernel", constexprs, types, label


_INDEX_POINTERS = {name: "i32" for name in ("tiles", "q_offsets", "out_offsets", "kv_offsets")}


def variants(quick: bool):
    """(head dim, dtype, causal, window, negative scale) of every configuration to compile (of each kernel)."""
    from jfa.tlx.backend import CONFIGS

    for d in sorted(CONFIGS):
        for dtype in ("bf16", "fp16"):
            if quick:
                masks = [(True, True)] if dtype == "bf16" else []
            elif dtype == "bf16":
                masks = [(False, False), (True, False), (False, True), (True, True)]
            else:
                masks = [(False, False), (True, True)]
            for causal, window in masks:
                yield d, dtype, causal, window, False
    if not quick:
        yield max(CONFIGS), "bf16", False, False, True


def compile_all(quick: bool = False) -> bool:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from jfa.tlx.backend import BWD_KERNELS, KERNELS, NUM_WARPS

    ok = True
    for arch in sorted(KERNELS):
        ptxas = get_ptxas(arch).path
        print(f"sm_{arch}: {KERNELS[arch]}, {BWD_KERNELS[arch]}; triton {triton.__version__}, {ptxas}")
        for module, kernel_config in ((KERNELS[arch], forward_kernel), (BWD_KERNELS[arch], backward_kernel),
                                      (BWD_KERNELS[arch], functools.partial(backward_kernel, dq_reduce=True)),
                                      (BWD_KERNELS[arch], dq_kernel), (BWD_KERNELS[arch], short_kernel),
                                      (BWD_KERNELS[arch], functools.partial(short_kernel, dq_partial=False))):
            for d, dtype, causal, window, neg in variants(quick):
                name, constexprs, types, config = kernel_config(dtype, d, causal, window, neg)
                fn = getattr(importlib.import_module(module), name)
                label = f"{name} D{d} {dtype} causal={int(causal)} window={int(window)} neg_scale={int(neg)} {config}"
                sig, attrs = _signature(fn, constexprs, *types)
                start = time.perf_counter()
                try:
                    kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs),
                                            target=GPUTarget("cuda", arch, 32),
                                            options=dict(num_warps=NUM_WARPS, num_stages=1))
                except Exception as error:  # noqa: BLE001 - report every failure, go on with the rest
                    print(f"FAIL {label}: {type(error).__name__}: {str(error)[:2000]}")
                    ok = False
                    continue
                ok &= _report(kernel, label, arch, start)
    print("COMPILE PASS" if ok else "COMPILE FAIL")
    return ok


def _report(kernel, label: str, arch: int, start: float) -> bool:
    """ptxas -v of the compiled kernel (`jfa.triton.compiled.ptxas_stats`): prints its registers, register
    budgets, spills and shared memory; whether it fits (ptxas ran, shared memory within MAX_SHARED)."""
    from jfa.triton.compiled import ptxas_stats

    regs, spill, info = ptxas_stats(kernel, arch)
    ptx = kernel.asm["ptx"]
    budgets = sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
    shared = kernel.metadata.shared
    fits = shared <= MAX_SHARED and regs != "?"
    print(f"{'ok  ' if fits else 'FAIL'} {label:78s} regs {regs:>3s} "
          f"(setmaxnreg {'/'.join(map(str, budgets)) or '-'}) spill {spill:>4s} B "
          f"smem {shared:>6d} B{'' if shared <= MAX_SHARED else ' > ' + str(MAX_SHARED)}  "
          f"warps {kernel.metadata.num_warps}  ({time.perf_counter() - start:.1f}s)")
    if regs == "?":
        print("     ptxas:", info.strip()[:500])
    return fits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one configuration per head dim")
    args = parser.parse_args(argv)
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
        print("triton was imported with TRITON_INTERPRET=1: run the compile check in a fresh process without it")
        return 1
    os.environ.pop("TRITON_INTERPRET", None)  # kernels are decorated at import: compile, never interpret
    from jfa.tlx.backend import tlx_missing

    missing = tlx_missing()
    if missing:
        print(missing)
        return 1
    return 0 if compile_all(args.quick) else 1


if __name__ == "__main__":
    sys.exit(main())

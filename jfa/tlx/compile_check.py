"""Compile-only check of the TLX kernels (no GPU): `python -m jfa.tlx.compile_check [--quick]`.

Needs fbtriton (Triton with TLX; it ships ptxas). Compiles every kernel configuration of `jfa.tlx.backend`
(head dims × dtypes × mask kinds) for each architecture in `KERNELS` with triton.compile(ASTSource(...),
target=GPUTarget("cuda", arch, 32)), then runs ptxas -v on the PTX and prints per configuration: the
launch register count, the per-warpgroup budgets set by setmaxnreg (producer / consumers), spill bytes
and shared memory (which must fit the 227 KiB a Hopper CTA can have). Exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

MAX_SHARED = 232_448  # bytes of shared memory one CTA may use on sm_90 (227 KiB)


def _signature(fn, dtype: str, head_dim: int, cfg, constexprs: dict):
    """Argument types of `fwd_ws_kernel` as the launcher would specialise them (pointers 16-byte aligned)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name == "desc_q":
            sig[name] = f"tensordesc<{dtype}[{cfg.block_m // 2},{head_dim}]>"
        elif name in ("desc_k", "desc_v"):
            sig[name] = f"tensordesc<{dtype}[{cfg.block_n},{head_dim}]>"
        elif name == "Out":
            sig[name] = f"*{dtype}"
        elif name in ("Lse", "RowMax", "RowSum"):
            sig[name] = "*fp32"
        elif name in ("tiles", "q_offsets", "out_offsets", "kv_offsets"):
            sig[name] = "*i32"
        elif name in ("scale_log2", "scale_abs"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        if sig[name].startswith("*") or name in ("sq_h", "sk_h", "sv_h", "so_t", "so_h"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def variants(quick: bool):
    """(head dim, dtype, causal, window, negative scale) of every configuration to compile."""
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

    from jfa.tlx.backend import CONFIGS, KERNELS, NUM_WARPS

    ok = True
    tmp = tempfile.mkdtemp()
    for arch, module in sorted(KERNELS.items()):
        fn = importlib.import_module(module).fwd_ws_kernel
        ptxas = get_ptxas(arch).path
        print(f"sm_{arch}: {module}.fwd_ws_kernel, triton {triton.__version__}, {ptxas}")
        for d, dtype, causal, window, neg in variants(quick):
            cfg = CONFIGS[d]
            constexprs = dict(HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, Q_BUFFERS=cfg.q_buffers,
                              KV_BUFFERS=cfg.kv_buffers, NEG_SCALE=neg, HAS_WINDOW=window, CAUSAL=causal)
            label = (f"D{d} {dtype} causal={int(causal)} window={int(window)} neg_scale={int(neg)} "
                     f"q_buf={cfg.q_buffers} kv_buf={cfg.kv_buffers}")
            sig, attrs = _signature(fn, dtype, d, cfg, constexprs)
            start = time.perf_counter()
            try:
                kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                                        options=dict(num_warps=NUM_WARPS, num_stages=1))
            except Exception as error:  # noqa: BLE001 - report every failure, go on with the rest
                print(f"FAIL {label}: {type(error).__name__}: {str(error)[:2000]}")
                ok = False
                continue
            ptx = kernel.asm["ptx"]
            path = os.path.join(tmp, "k.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            info = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                                  capture_output=True, text=True).stderr
            regs = re.findall(r"Used (\d+) registers", info)
            spill = re.findall(r"(\d+) bytes spill stores", info)
            budgets = sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})
            shared = kernel.metadata.shared
            fits = shared <= MAX_SHARED
            ok &= fits and bool(regs)
            print(f"{'ok  ' if fits and regs else 'FAIL'} {label:62s} regs {regs[0] if regs else '?':>3s} "
                  f"(setmaxnreg {'/'.join(map(str, budgets)) or '-'}) spill {spill[0] if spill else '?':>4s} B "
                  f"smem {shared:>6d} B{'' if fits else ' > ' + str(MAX_SHARED)}  "
                  f"warps {kernel.metadata.num_warps}  ({time.perf_counter() - start:.1f}s)")
            if not regs:
                print("     ptxas:", info.strip()[:500])
    print("COMPILE PASS" if ok else "COMPILE FAIL")
    return ok


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

"""The Triton backend's kernels compiled for a GPU target without a GPU, and compared with another revision's:
`python -m jfa.triton.compiled --against REV`.

`variants` lists every kernel variant the backend launches on Hopper: each kernel at the shipped config of
every head-dim class (`jfa.triton.backend.gpu_config`) and its num_stages candidates, with and without
causal and window, bf16 (and fp16 at head dim 128), dq in the input dtype and as the fp32 broadcast_q
partial. `python -m jfa.triton.gpu_selftest --compile-only` compiles them and prints ptxas's registers
and spills, shared memory and SASS size (`Usage`).

Why compare TTGIR. A change meant to leave the kernels alone (a helper extracted, code moved between
modules) can be proven to on a CPU: if every variant's TTGIR (the Triton GPU dialect after the pipeliner,
before LLVM) is the same as the base revision's, the GPU runs the same program, its results and speed
included, and the H200's verification and benchmark figures of the base still hold. The comparison
ignores what carries no meaning: source locations, SSA value names, and the order of the constants the
compiler hoists to the top of a function. A variant that differs is named with its first differing line;
what it means (a slower loop, other bits) takes the GPU to say.

--against REV: REV's `jfa/` is exported (`git archive`) into a temporary folder, this module is copied into
it, and two processes compile the variants, one on REV's kernels and one on the working tree's, each with
its own tree's configs and kernel signatures (a parameter one side lacks is dropped from its constexprs).
Exit 0 when every variant compiled on both sides and is the same, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
HEAD_DIMS = ((128, 128), (64, 64), (80, 80), (96, 96), (192, 192), (256, 256), (128, 64), (8, 24))
_FP32_SCALARS = ("scale_log2", "scale_abs", "sm_scale")


@dataclass(frozen=True)
class Variant:
    label: str
    kernel: str  # attribute of jfa.triton.forward or jfa.triton.backward
    pointers: dict = field(hash=False)  # pointer argument -> element type ("bf16", "fp32", "i32", ...)
    constexprs: dict = field(hash=False)
    num_warps: int
    num_stages: int
    max_registers: int | None = None  # KernelConfig.max_registers: Triton's maxnreg


# The kernel each config role of `jfa.triton.backend.BackendConfig` launches.
ROLE_KERNELS = {"fwd": "_fwd_kernel", "packed_fwd": "_fwd_packed_kernel", "dq": "_dq_kernel", "dkv": "_dkv_kernel",
                "short_bwd": "_bwd_short_kernel", "packed_bwd": "_bwd_packed_kernel"}
_ROLE_LABELS = {"fwd": "fwd", "packed_fwd": "fwd_packed", "dq": "dq", "dkv": "dkv", "short_bwd": "bwd_short",
                "packed_bwd": "bwd_packed"}


def role_variants(role: str, kcfg, d: int, dv: int, dtype: str = "bf16", causal: bool = False,
                  window: bool = False, partial: bool = False, redo: bool = False) -> list[Variant]:
    """The variants of `role`'s kernel at config `kcfg` (one per num_stages) for head dims d/dv; `partial`: dq
    as broadcast_q's fp32 partial (the roles that write dq); `redo`: the packed forward's second launch."""
    from jfa.triton import backend

    block_d, block_dv = backend.padded_dim(d), backend.padded_dim(dv)
    kernel = ROLE_KERNELS[role]
    pointers = {n: dtype for n in ("Q", "K", "V", "Out", "DOut", "DK", "DV")}
    pointers.update({n: "fp32" for n in ("Lse", "RowMax", "RowSum", "Delta", "RowStats")})
    pointers.update({n: "i32" for n in ("tiles", "counter", "q_offsets", "out_offsets", "kv_offsets", "pack_seqs",
                                        "pack_shift")})
    label, extra = _ROLE_LABELS[role], {}
    if role in ("dq", "short_bwd", "packed_bwd"):
        pointers["DQ"] = "fp32" if partial else dtype
        label, extra = f"{label} partial={int(partial)}", dict(DQ_PARTIAL=partial)
    if redo:
        label = f"{label}_redo"
    tiles = (dict(BLOCK=kcfg.block_m, SLOTS=kcfg.block_m // backend.ts.PACK_ALIGN) if role.startswith("packed")
             else dict(BLOCK_M=kcfg.block_m, BLOCK_N=kcfg.block_n))
    # (getattr: the compared revision's backend may predate FLAG_PER_HEAD or PREFETCH_NEXT_HEAD; its kernels then
    # take no such constexpr.)
    constexprs = dict(HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_D=block_d, BLOCK_DV=block_dv, NEG_SCALE=False,
                      HAS_WINDOW=window, CAUSAL=causal, SCHEDULE=1, REDO=redo,
                      FLAG_PER_HEAD=getattr(backend, "FLAG_PER_HEAD", False),
                      PREFETCH=getattr(backend, "PREFETCH_NEXT_HEAD", False), INTERPRET=False, ROW_STATS=True,
                      **tiles, **extra)
    tag = f"D{d}/{dv} {dtype} causal={int(causal)} window={int(window)}"
    cap = "" if kcfg.max_registers is None else f" m{kcfg.max_registers}"
    return [Variant(f"{label} s{stages}{cap} {tag}", kernel, pointers, constexprs, kcfg.num_warps, stages,
                    kcfg.max_registers) for stages in kcfg.stages]


def variants(quick: bool = False, head_dims: list[tuple[int, int]] | None = None) -> list[Variant]:
    """Every kernel variant the backend launches on Hopper (the module docstring says which); `quick`: head
    dim 128, bf16, causal and window only; `head_dims`: only these (D, Dv) pairs."""
    from jfa.triton import backend

    out = []
    dims = head_dims or ([(128, 128)] if quick else list(HEAD_DIMS))
    masks = [(True, True)] if quick else [(False, False), (True, True)]
    dtypes = []
    for d, dv in dims:
        cfg = backend.gpu_config(max(backend.padded_dim(d), backend.padded_dim(dv)))
        for dt in (("bf16",) if quick or (d, dv) != (128, 128) else ("bf16", "fp16")):
            dtypes += [dt] if dt not in dtypes else []
            roles = [("fwd", False), ("packed_fwd", False), ("dkv", False)]
            for partial in (False, True):
                roles += [("dq", partial), ("packed_bwd", partial)]
                roles += [("short_bwd", partial)] if cfg.short_bwd else []
            for causal, window in masks:
                for role, partial in roles:
                    out += role_variants(role, getattr(cfg, role), d, dv, dt, causal, window, partial)
                out += role_variants("packed_fwd", cfg.packed_fwd, d, dv, dt, causal, window, redo=True)
    # one partial per sequence (Sources None), and a short-query pass's list of them (the tlx backend's)
    out += [Variant(f"dq_reduce unroll={unroll}{' sources' if listed else ''} {dt}", "_dq_reduce_kernel",
                    {"Part": "fp32", "DQ": dt, **({"Sources": "i32"} if listed else {})},
                    dict(BLOCK=backend.DQ_REDUCE_BLOCK, UNROLL=unroll, WIDE_ROWS=False, INTERPRET=False,
                         **({} if listed else {"Sources": None})), 4, 2)
            for unroll in sorted({backend.dq_reduce_unroll(n) for n in (1, 2, 32)}) for dt in dtypes
            for listed in (False, True)]
    out += [Variant(f"delta dv={dv} {dt}", "_delta_kernel", {"Out": dt, "DOut": dt, "Delta": "fp32"},
                    dict(HEAD_DIM_V=dv, BLOCK_DV=backend.padded_dim(dv), BLOCK=64), 4, 2)
            for dv in sorted({dv for _, dv in dims}) for dt in dtypes]
    out += [Variant(f"row_stats records={int(records)}", "_row_stats_kernel",
                    {n: "fp32" for n in ("RowMax", "RowSum", "Delta", "Stats", "Scale")},
                    dict(RECORDS=records, BLOCK=1024), 4, 2) for records in (True, False)]
    return out


def parse_head_dims(specs: list[str]) -> list[tuple[int, int]] | None:
    """'D' or 'D/DV' per spec as (D, Dv) pairs; None for no specs (every class)."""
    pairs = []
    for spec in specs:
        parts = spec.split("/")
        if len(parts) > 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--head-dims takes D or D/DV, got {spec!r}")
        pairs.append((int(parts[0]), int(parts[-1])))
    return pairs or None


def compile_variant(variant: Variant, arch: int = 90):
    """triton.compile of the variant for sm_<arch> (no GPU needed): pointers 16-byte aligned, the head-dim
    strides specialised to 1 and the others divisible by 16, as the backend's launches are."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jfa.triton import backward, forward

    fn = getattr(forward, variant.kernel, None) or getattr(backward, variant.kernel)
    signature, attrs = {}, {}
    constexprs = {name: value for name, value in variant.constexprs.items() if name in fn.arg_names}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.startswith("s") and name.endswith("_d"):  # unit head-dim stride, as specialised
            signature[name] = "constexpr"
            constexprs[name] = 1
        elif name in variant.pointers:
            signature[name] = "*" + variant.pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in _FP32_SCALARS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("s") and name[-2:] in ("_t", "_h"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=variant.num_warps, num_stages=variant.num_stages,
                                       maxnreg=variant.max_registers))


def _nvidia_tool(name: str, arch: int) -> str:
    """Path of ptxas or nvdisasm as triton itself uses them for sm_<arch> (newer tritons ship two ptxas binaries
    and pick by arch; nvdisasm sits beside them)."""
    import triton

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(arch).path
    except (ImportError, TypeError, AttributeError):
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return ptxas if name == "ptxas" else os.path.join(os.path.dirname(ptxas), name)


def ptxas_stats(kernel, arch: int = 90) -> tuple[str, str, str]:
    """(registers, spill-store bytes, ptxas -v's report) of a compiled kernel, by the ptxas that triton itself
    uses for sm_<arch> ("?" where ptxas printed none). Shared by this module and `jfa.tlx.compile_check`."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path = os.path.join(tmp, "k.ptx")
        with open(ptx_path, "w") as f:
            f.write(kernel.asm["ptx"])
        info = subprocess.run([_nvidia_tool("ptxas", arch), f"-arch=sm_{arch}a", "-v", ptx_path, "-o",
                               os.path.join(tmp, "k.cubin")], capture_output=True, text=True).stderr
    regs = re.findall(r"Used (\d+) registers", info)
    spill = re.findall(r"(\d+) bytes spill stores", info)
    return regs[0] if regs else "?", spill[0] if spill else "?", info


_SASS_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*)$")
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"\bBRA\b[^(]*\((\.L_x_\d+)\)")


def sass_size(listing: str) -> tuple[int, int]:
    """(instructions, instructions of the longest innermost loop) of an `nvdisasm -c` listing: a loop is the
    instructions from a label to a later branch back to it (that branch included), innermost when it holds no
    other loop; 0 where there is none."""
    labels, loops, count = {}, [], 0
    for line in listing.splitlines():
        label = _SASS_LABEL.match(line)
        if label:
            labels[label.group(1)] = count
        instruction = _SASS_INSTRUCTION.match(line)
        if instruction:
            branch = _SASS_BRANCH.search(instruction.group(1))
            if branch and labels.get(branch.group(1), count) < count:
                loops.append((labels[branch.group(1)], count + 1))
            count += 1
    innermost = [end - start for start, end in loops
                 if not any((s, e) != (start, end) and start <= s and e <= end for s, e in loops)]
    return count, max(innermost, default=0)


def sass_counts(kernel, arch: int = 90) -> tuple[str, str]:
    """`sass_size` of a compiled kernel (`nvdisasm -c` of its cubin, the nvdisasm beside triton's ptxas), as
    strings: ("?", "?") without nvdisasm. For the packed kernels the loop is the head loop, for the others the
    key-block loop. A static count: what a change adds to or removes from a loop's body, not its time."""
    tool = _nvidia_tool("nvdisasm", arch)
    if not os.path.exists(tool):
        return "?", "?"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        listing = subprocess.run([tool, "-c", cubin], capture_output=True, text=True).stdout
    count, loop = sass_size(listing)
    return (str(count), str(loop)) if count else ("?", "?")


class Usage(NamedTuple):
    """What a compiled variant uses (ptxas's registers and spill-store bytes, "?" where it printed none; shared
    memory) and its SASS size (`sass_counts`)."""

    regs: str
    spill: str
    smem: int
    sass: str
    loop: str

    def __str__(self) -> str:
        return (f"regs {self.regs:>3s} spill {self.spill:>5s} smem {self.smem:>6d} sass {self.sass:>5s} "
                f"loop {self.loop:>5s}")


def ptxas_usage(variant: Variant, arch: int = 90) -> Usage:
    """Registers, spill-store bytes, shared-memory bytes and SASS size of the variant compiled for sm_<arch>."""
    kernel = compile_variant(variant, arch)
    regs, spill, _ = ptxas_stats(kernel, arch)
    return Usage(regs, spill, kernel.metadata.shared, *sass_counts(kernel, arch))


_LOCATION = re.compile(r" loc\((#loc\d*|[^()]*(\([^()]*\))?[^()]*)\)")
_VALUE = re.compile(r"%[A-Za-z_0-9#]+")
_ALIAS = re.compile(r"^(#[A-Za-z_][A-Za-z_0-9]*) = (.*)$")


def normalized_ttgir(text: str) -> str:
    """TTGIR without source locations and SSA names, its attribute aliases (#blocked, #shared, #mma, ...)
    named by their sorted definitions (their numbering follows the order of first use), each run of
    consecutive constants sorted."""
    aliases, body = {}, []
    for line in text.splitlines():
        if line.startswith("#loc"):
            continue
        alias = _ALIAS.match(line)
        if alias:
            aliases[alias.group(1)] = alias.group(2)
        else:
            body.append(line)
    canonical = {name: f"#a{i}" for i, name in enumerate(sorted(aliases, key=lambda n: (aliases[n], n)))}
    use = re.compile("|".join(re.escape(name) + r"\b" for name in sorted(canonical, key=len, reverse=True)))

    def renamed(line: str) -> str:
        return use.sub(lambda m: canonical[m.group(0)], line) if canonical else line

    lines = sorted(f"{canonical[name]} = {renamed(value)}" for name, value in aliases.items())
    constants = []
    for line in body:
        line = renamed(_VALUE.sub("%v", _LOCATION.sub("", line)).rstrip())
        if line.lstrip().startswith("%v = arith.constant"):
            constants.append(line)
            continue
        lines += sorted(constants)
        constants = []
        lines.append(line)
    return "\n".join(lines + sorted(constants)) + "\n"


def first_difference(a: str, b: str) -> str:
    for number, (x, y) in enumerate(zip(a.splitlines(), b.splitlines(), strict=False), 1):
        if x != y:
            return f"line {number}: {x.strip()[:150]!r} against {y.strip()[:150]!r}"
    return f"one is a prefix of the other ({a.count(chr(10))} against {b.count(chr(10))} lines)"


def dump(folder: Path, quick: bool, head_dims, share: int = 0, shares: int = 1) -> None:
    """Writes the normalized TTGIR (or the compile error) of every shares-th variant from the share-th on to
    folder/index_<share>.json."""
    index = {}
    for variant in variants(quick, head_dims)[share::shares]:
        try:
            index[variant.label] = {"ttgir": normalized_ttgir(compile_variant(variant).asm["ttgir"])}
        except Exception as error:  # noqa: BLE001 - reported per variant
            index[variant.label] = {"error": f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"}
    (folder / f"index_{share}.json").write_text(json.dumps(index))


def compare(base: dict, mine: dict) -> tuple[list[str], bool]:
    """Report lines of two dumps and whether every variant compiled on both sides and is the same."""
    lines, same = [], True
    for label in dict.fromkeys([*sorted(mine), *sorted(base)]):
        a, b = base.get(label), mine.get(label)
        if a is None or b is None:
            lines.append(f"ONLY {'here' if a is None else 'in base'}: {label}")
            same = False
        elif "error" in a or "error" in b:
            lines.append(f"ERROR {label}: base {a.get('error', 'ok')}; here {b.get('error', 'ok')}")
            same = False
        elif a["ttgir"] != b["ttgir"]:
            lines.append(f"DIFFERS {label}: {first_difference(a['ttgir'], b['ttgir'])}")
            same = False
        else:
            lines.append(f"same    {label}")
    return lines, same


def _dump_tree(tree: Path, out: Path, args) -> dict:
    """Runs `dump` in args.jobs processes whose `jfa` is the one under `tree`; their variants, in order."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "jfa.triton.compiled", "--dump", str(out)]
    command += ["--quick"] if args.quick else []
    command += ["--head-dims", *args.head_dims] if args.head_dims else []
    workers = [subprocess.Popen([*command, "--share", f"{i}/{args.jobs}"], env=env, cwd=tree)
               for i in range(args.jobs)]
    if any(worker.wait() for worker in workers):
        raise RuntimeError(f"compiling the kernels of {tree} failed (see above)")
    index = {}
    for i in range(args.jobs):
        index.update(json.loads((out / f"index_{i}.json").read_text()))
    return index


def against(rev: str, args) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        base_tree, base_out, mine_out = Path(tmp, "base"), Path(tmp, "base_out"), Path(tmp, "mine_out")
        for folder in (base_tree, base_out, mine_out):
            folder.mkdir()
        archive = subprocess.run(["git", "archive", rev, "jfa"], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base_tree)], input=archive, check=True)
        shutil.copy(Path(__file__), base_tree / "jfa" / "triton" / "compiled.py")
        lines, same = compare(_dump_tree(base_tree, base_out, args), _dump_tree(REPO, mine_out, args))
    print("\n".join(lines))
    differing = sum(not line.startswith("same") for line in lines)
    print(f"{len(lines)} variants: {'all the same TTGIR as ' + rev if same else f'{differing} not the same as {rev}'}")
    return 0 if same else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REV", help="compare every variant's TTGIR with this git revision's")
    parser.add_argument("--quick", action="store_true", help="head dim 128, bf16, causal and window only")
    parser.add_argument("--head-dims", nargs="+", metavar="D[/DV]", help="only these head dims (e.g. 192 256/128)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes per side")
    parser.add_argument("--dump", type=Path, help=argparse.SUPPRESS)  # one side of --against
    parser.add_argument("--share", default="0/1", help=argparse.SUPPRESS)  # i/n: the variants a --dump compiles
    args = parser.parse_args(argv)
    try:
        head_dims = parse_head_dims(args.head_dims or [])
    except ValueError as error:
        parser.error(str(error))
    if args.dump:
        share, shares = (int(x) for x in args.share.split("/"))
        dump(args.dump, args.quick, head_dims, share, shares)
        return 0
    if not args.against:
        parser.error("--against REV is required")
    return against(args.against, args)


if __name__ == "__main__":
    sys.exit(main())

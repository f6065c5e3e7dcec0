"""jfa.triton.compiled: the kernel variants, TTGIR normalisation, the comparison, and two trees compiled for
sm_90 on this CPU (a kernel edited in one of them is found; the unedited copy is the same)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jfa.triton import compiled

REPO = Path(__file__).resolve().parents[1]

TTGIR = """#loc = loc("/src/forward.py":10:0)
module {
  tt.func public @k(%arg0: !tt.ptr<f32> loc("/src/forward.py":10:0)) {
    %c1_i32 = arith.constant 1 : i32 loc(#loc1)
    %cst = arith.constant dense<0.0> : tensor<64xf32> loc(#loc2)
    %0 = tt.load %arg0 : !tt.ptr<f32> loc(#loc3)
    %x_12 = arith.addi %c1_i32, %c1_i32 : i32 loc(callsite(#loc4 at #loc5))
    tt.return loc(#loc6)
  } loc(#loc)
} loc(#loc)
#loc1 = loc("/src/forward.py":11:4)
"""


def test_normalized_ttgir_ignores_locations_names_and_constant_order():
    one = "    %c1_i32 = arith.constant 1 : i32 loc(#loc1)\n"
    zeros = "    %cst = arith.constant dense<0.0> : tensor<64xf32> loc(#loc2)\n"
    reordered = TTGIR.replace(one + zeros, zeros.replace("%cst", "%cst_0") + one.replace("%c1_i32", "%c1"))
    assert reordered != TTGIR
    normal = compiled.normalized_ttgir(TTGIR)
    assert compiled.normalized_ttgir(reordered) == normal
    assert "loc" not in normal and "%c1_i32" not in normal and "%v = arith.addi %v, %v : i32" in normal
    edited = compiled.normalized_ttgir(TTGIR.replace("arith.addi", "arith.subi"))
    assert edited != normal
    assert "arith.addi" in compiled.first_difference(normal, edited)


def test_normalized_ttgir_names_attribute_aliases_by_their_definitions():
    """The compiler numbers #blocked, #blocked1, ... by first use: a renumbering is the same program."""
    layouts = ("#blocked = #ttg.blocked<{sizePerThread = [1, 8]}>\n"
               "#blocked1 = #ttg.blocked<{sizePerThread = [1, 4]}>\n"
               "  %0 = tt.load %a : tensor<64x!tt.ptr<f32>, #blocked1> loc(#loc1)\n"
               "  %1 = tt.load %b : tensor<64x!tt.ptr<f32>, #blocked> loc(#loc2)\n")
    swapped = layouts.replace("#blocked1", "#TMP").replace("#blocked", "#blocked1").replace("#TMP", "#blocked")
    assert compiled.normalized_ttgir(swapped) == compiled.normalized_ttgir(layouts)
    other = layouts.replace("%b : tensor<64x!tt.ptr<f32>, #blocked>", "%b : tensor<64x!tt.ptr<f32>, #blocked1>")
    assert compiled.normalized_ttgir(other) != compiled.normalized_ttgir(layouts)


def test_normalized_ttgir_keeps_the_order_of_other_operations():
    load = "    %0 = tt.load %arg0 : !tt.ptr<f32> loc(#loc3)\n"
    add = "    %x_12 = arith.addi %c1_i32, %c1_i32 : i32 loc(callsite(#loc4 at #loc5))\n"
    swapped = TTGIR.replace(load + add, add + load)
    assert compiled.normalized_ttgir(swapped) != compiled.normalized_ttgir(TTGIR)


def test_compare_names_every_kind_of_difference():
    base = {"a": {"ttgir": "x\ny\n"}, "b": {"ttgir": "x\n"}, "c": {"error": "CompilationError: boom"},
            "gone": {"ttgir": "x\n"}}
    mine = {"a": {"ttgir": "x\ny\n"}, "b": {"ttgir": "z\n"}, "c": {"ttgir": "x\n"}, "new": {"ttgir": "x\n"}}
    lines, same = compiled.compare(base, mine)
    assert not same
    assert lines == ["same    a", "DIFFERS b: line 1: 'x' against 'z'", "ERROR c: base CompilationError: boom; here ok",
                     "ONLY here: new", "ONLY in base: gone"]
    assert compiled.compare(base | {"b": mine["b"]}, base | {"b": mine["b"]}) == (
        ["same    a", "same    b", "ERROR c: base CompilationError: boom; here CompilationError: boom",
         "same    gone"], False)
    assert compiled.compare({"a": {"ttgir": "x"}}, {"a": {"ttgir": "x"}}) == (["same    a"], True)


def test_sass_size_counts_instructions_and_the_longest_innermost_loop():
    """`sass_size` on an nvdisasm-shaped listing: every instruction counted once; loops are a label up to a later
    branch back to it (forward branches and a branch to itself at the end make none); the longest loop holding
    no other is reported, so an outer loop around it is not."""
    def instructions(opcodes):
        return [f"        /*{i:04x}*/                   {op} ;" for i, op in enumerate(opcodes)]

    listing = "\n".join([
        *instructions(["S2R R0, SR_TID.X", "@P0 BRA `(.L_x_2)"]),  # forward branch: no loop
        ".L_x_0:", *instructions(["IMAD R1, R1, R2, RZ"]),  # outer loop: 1 + inner (5) + 2
        ".L_x_1:", *instructions(["FADD R3, R3, R4", "FMUL R3, R3, R4", "MUFU.EX2 R3, R3",
                                  "ISETP.NE.AND P1, PT, R3, RZ, PT", "@P1 BRA `(.L_x_1)"]),  # inner loop: 5
        *instructions(["IADD3 R5, R5, 0x1, RZ", "@P2 BRA `(.L_x_0)"]),
        ".L_x_3:", *instructions(["NOP", "BRA `(.L_x_3)"]),  # a second innermost loop, shorter: 2
        ".L_x_2:", *instructions(["EXIT", "BRA `(.L_x_4)"]), ".L_x_4:", *instructions(["BRA `(.L_x_4)"]),
    ])
    assert compiled.sass_size(listing) == (15, 5)
    assert compiled.sass_size("\n".join(instructions(["EXIT"]))) == (1, 0)


def test_variants_cover_every_kernel_once_per_configuration():
    from jfa.triton import backward, forward

    every = compiled.variants()
    labels = [v.label for v in every]
    assert len(labels) == len(set(labels))
    kernels = {name for module in (forward, backward) for name in dir(module)
               if name.startswith("_") and name.endswith("_kernel")}
    assert {v.kernel for v in every} == kernels
    quick = compiled.variants(quick=True)
    assert {v.kernel for v in quick} == kernels
    unmasked = ("_dq_reduce_kernel", "_delta_kernel", "_row_stats_kernel")  # elementwise: no mask, no tiles
    assert all("D128/128 bf16 causal=1 window=1" in v.label for v in quick if v.kernel not in unmasked)
    assert {v.label.split(" D")[1] for v in compiled.variants(head_dims=[(96, 96)]) if " D" in v.label} == {
        "96/96 bf16 causal=0 window=0", "96/96 bf16 causal=1 window=1"}


# Per variant of the packed kernels at the tiny row's head dim (bf16, D 128, unmasked; the forward's shipped 2
# stages): its label, whether it is the forward's redo launch, and the PTX line numbers of its prefetches, of its
# first matrix product (wgmma; the backward's 32-row blocks take mma.sync) and of the label opening its basic
# block. Compiled in a process of its own: the unit tests' TRITON_INTERPRET compiles nothing.
PACKED_PTX = """
import json
from jfa.triton import compiled
for v in compiled.variants(head_dims=[(128, 128)]):
    if (v.kernel == "_fwd_packed_kernel" and v.num_stages == 2 or v.kernel == "_bwd_packed_kernel"
            and "partial=0" in v.label) and "bf16 causal=0 window=0" in v.label:
        lines = compiled.compile_variant(v).asm["ptx"].splitlines()
        mma = next(i for i, line in enumerate(lines) if "wgmma.mma_async" in line or "mma.sync" in line)
        block = max(i for i, line in enumerate(lines[:mma]) if line.startswith("$L__BB"))
        print(json.dumps([v.label, v.constexprs.get("REDO", False),
                          [i for i, line in enumerate(lines) if "prefetch." in line], mma, block]))
"""


def test_packed_kernels_ask_l2_for_the_next_heads_rows():
    """Under stock triton the packed kernels' head loops prefetch the next head's rows (`prefetch_rows`): q, k
    and v in the forward, and those of the program's next tile's first head, q, dO and O in the backward, three
    predicated PTX prefetches each in the compiled sm_90 kernel (the forward six), in the basic block of the
    loop's first matrix product, before it; none in the forward's redo launch, and none at all under fbtriton
    (`PREFETCH_NEXT_HEAD`). A Triton that dropped the side-effecting inline assembly, or an edit that moved it
    out of the loop, fails here."""
    pytest.importorskip("triton.backends.nvidia")
    from jfa.triton.backend import PREFETCH_NEXT_HEAD

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", PACKED_PTX], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True).stdout
    variants = [json.loads(line) for line in out.splitlines()]
    assert sorted((label.split()[0], redo) for label, redo, *_ in variants) == [
        ("bwd_packed", False), ("fwd_packed", False), ("fwd_packed_redo", True)]
    for label, redo, prefetches, mma, block in variants:
        if redo or not PREFETCH_NEXT_HEAD:
            assert prefetches == [], label
        else:
            count = 6 if label.startswith("fwd") else 3
            assert len(prefetches) == count and block < prefetches[0] and prefetches[-1] < mma, (label, prefetches)


def _tree(tmp_path: Path, name: str) -> Path:
    tree = tmp_path / name
    shutil.copytree(REPO / "jfa", tree / "jfa", ignore=shutil.ignore_patterns("__pycache__"))
    return tree


def test_two_trees_compiled_for_sm90_same_and_edited(tmp_path):
    """The quick variants of the package and of a copy are the same; an edited copy (the online softmax's
    rescale factor) differs exactly in the kernels that inline it."""
    pytest.importorskip("triton.backends.nvidia")
    args = argparse.Namespace(quick=True, head_dims=None, jobs=2)
    mine = compiled._dump_tree(REPO, _outdir(tmp_path, "mine"), args)
    same_tree = _tree(tmp_path, "copy")
    lines, same = compiled.compare(compiled._dump_tree(same_tree, _outdir(tmp_path, "copy_out"), args), mine)
    assert same, "\n".join(lines)

    edited = _tree(tmp_path, "edited")
    softmax = edited / "jfa" / "softmax.py"
    text = softmax.read_text()
    assert text.count("alpha = tl.exp2(") == 1
    softmax.write_text(text.replace("alpha = tl.exp2(", "alpha = 0.5 * tl.exp2("))
    lines, same = compiled.compare(compiled._dump_tree(edited, _outdir(tmp_path, "edited_out"), args), mine)
    assert not same
    differing = {line.split(" s")[0] for line in lines if line.startswith("DIFFERS")}
    assert differing == {"DIFFERS fwd"}, "\n".join(lines)


def _outdir(tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    out.mkdir()
    return out


def test_against_a_revision_exits_by_the_verdict(tmp_path, monkeypatch, capsys):
    """`--against REV` on a repository of its own: 0 on the committed tree, 1 once a kernel is edited."""
    pytest.importorskip("triton.backends.nvidia")
    repo = _tree(tmp_path, "repo")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    for command in (["init", "-q"], ["add", "jfa"], ["commit", "-q", "-m", "base"]):
        subprocess.run(git + command, check=True)
    monkeypatch.setattr(compiled, "REPO", repo)
    assert compiled.main(["--against", "HEAD", "--quick", "--jobs", "2"]) == 0
    n_quick = len(compiled.variants(quick=True))
    assert capsys.readouterr().out.endswith(f"{n_quick} variants: all the same TTGIR as HEAD\n")
    packed = repo / "jfa" / "triton" / "forward.py"
    text = packed.read_text()
    assert text.count("l = chunked_row_sum(p, BLOCK, BLOCK, BLOCK // SLOTS)") == 1
    packed.write_text(text.replace("l = chunked_row_sum(", "l = 2.0 * chunked_row_sum("))
    assert compiled.main(["--against", "HEAD", "--quick", "--jobs", "2"]) == 1
    out = capsys.readouterr().out
    assert {line.split(" s")[0] for line in out.splitlines() if line.startswith("DIFFERS")} == {"DIFFERS fwd_packed"}
    # the redo launch's variants read l instead of summing it
    packed_variants = sum(v.kernel == "_fwd_packed_kernel" and not v.constexprs["REDO"]
                          for v in compiled.variants(quick=True))
    assert out.endswith(f"{n_quick} variants: {packed_variants} not the same as HEAD\n")

"""The invariants of DESIGN.md checked exactly (bitwise): every element written, no write outside the buffers a
call allocates, repeatable runs, deterministic dq, a second backward over a retained graph, offsets buffers
reused, padding insensitivity, batch invariance, sequence isolation (a NaN inside one sequence reaches no
other), inputs untouched."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from jfa.problem import Problem
from verify.context import CaseContext
from verify.guards import GuardedAllocations, allocation_bytes
from verify.runner import Outputs, is_device_fault, nan_filled_allocations, run, run_backwards
from verify.sub_batch import cat_rows, offsets_of, sequence_rows, sub_batch, tensor_rows


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns as integers of its width."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (so NaN == NaN and -0.0 != 0.0), compared on a's device (b is brought there: a parked
    run, `_parked`, is compared on the host)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(_bits(a), _bits(b.to(a.device)))


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    b = b.to(a.device)
    differ = ~((a == b) | (torch.isnan(a) & torch.isnan(b)))
    where = torch.nonzero(differ)
    if where.numel() == 0:
        return "bit patterns differ (signed zeros)"
    index = tuple(int(i) for i in where[0])
    return f"{int(differ.sum())} elements differ, first at {index}: {float(a[index])!r} vs {float(b[index])!r}"


def compare_sub_batch(ctx: CaseContext, whole: Outputs, part: Outputs, order, out_parts, kv_parts,
                      names=("out", "lse", "dq", "dk", "dv")) -> list[str]:
    """Bitwise comparison of each sequence's rows in `part` (a re-run on a sub-batch) with `whole`, for the
    tensors `names`; per tensor, the first sequence (in `order`) that differs is named.

    One gather and one comparison per tensor: a per-sequence loop costs a few device synchronisations per
    sequence, which on cases with thousands of sequences made this the slowest check of a premerge run."""
    problems = []
    for name, (parts, axis) in tensor_rows(ctx.problem, out_parts, kv_parts).items():
        if name not in names:
            continue
        whole_t, part_t = getattr(whole, name), getattr(part, name)
        old_rows = cat_rows(parts).to(whole_t.device)
        expected = whole_t.index_select(axis, old_rows)
        if bitwise_equal(expected, part_t):
            continue
        if expected.shape != part_t.shape or expected.dtype != part_t.dtype:
            problems.append(f"{name}: {tuple(part_t.shape)} {part_t.dtype} on the sub-batch, "
                            f"{tuple(expected.shape)} {expected.dtype} expected")
            continue
        row = int(_differing_rows(expected, part_t, axis)[0])
        lengths = torch.tensor([p.numel() for p in parts])
        i = int(torch.searchsorted(lengths.cumsum(0), row, right=True))
        start = int(lengths[:i].sum())
        a, c = (t.narrow(axis, start, int(lengths[i])) for t in (expected, part_t))
        problems.append(f"{name} of sequence {order[i]}: {first_difference(a, c)}")
    return problems


def _differing_rows(a: torch.Tensor, b: torch.Tensor, axis: int) -> torch.Tensor:
    """Indices along `axis` where the bit patterns of a and b differ (on a's device)."""
    differ = _bits(a) != _bits(b.to(a.device))
    return torch.nonzero(differ.movedim(axis, 0).flatten(1).any(1)).flatten()


def _differences(a: Outputs, b: Outputs, names) -> list[str]:
    return [f"{name}: {first_difference(getattr(a, name), getattr(b, name))}" for name in names
            if not bitwise_equal(getattr(a, name), getattr(b, name))]


def _unwritten(outputs: Outputs, ctx: CaseContext) -> list[str]:
    """Non-finite elements where the reference is finite (at the rows it covers: `CaseContext.graded`)."""
    found = []
    for name, whole in outputs.named().items():
        t = ctx.graded(name, whole)
        if t is None:
            continue
        ref = ctx.reference.tensors()[name][0].to(t.device)
        count = int((~torch.isfinite(t) & torch.isfinite(ref)).sum())
        if count:
            found.append(f"{name}: {count} elements not finite with fresh allocations NaN-filled")
    return found


# Invariants a backend may declare not applicable on a device (`invariance_waivers`), by group. "dq_order"
# waives none: it declares that without deterministic=True dq is added up in no fixed order (atomics, TMA
# reduce), so the padding and batch checks compare dq between deterministic=True runs instead (the contract
# promises a reproducible dq only there; out, lse, dk and dv are still compared in the default mode).
WAIVABLE = {"run_to_run": ("repeatable", "deterministic"), "retained_graph": ("backward_again",),
            "guarded_allocations": ("in_bounds",),
            "batch": ("padding", "batch_permuted", "batch_alone"), "dq_order": (), "isolation": ("isolation",),
            "isolation_grad": ("isolation_grad",)}


def check_all(fn, ctx: CaseContext, waived: dict[str, str] | None = None,
              base: Outputs | None = None, ordered_base: Outputs | None = None) -> dict[str, list[str] | str]:
    """Runs every invariant; returns {invariant: [problems]} (an empty list passes), or {invariant: reason}
    for the groups of WAIVABLE in `waived` (group -> why the backend does not promise them on this device).

    `base`: an earlier run of the case's own call with backward (the backward test's), compared with the
    runs made here; without it the first run is made here. `ordered_base` likewise, with deterministic=True
    (the backward test makes one for a backend declaring dq_order).

    An error a run raises goes on with a note of the invariants checked before it (the suite's record shows
    it): a case too large for the device runs out of memory in one of them."""
    waived = waived or {}
    findings: dict[str, list[str] | str] = {name: waived[group] for group, names in WAIVABLE.items()
                                            if group in waived for name in names}
    try:
        return _check_all(fn, ctx, waived, base, ordered_base, findings)
    except Exception as error:
        checked = [name for name, problems in findings.items() if not isinstance(problems, str)]
        error.__notes__ = [*getattr(error, "__notes__", []),
                           f"raised after the invariants {', '.join(checked) or '(none)'} had been checked"]
        raise


def _check_all(fn, ctx: CaseContext, waived: dict[str, str], base: Outputs | None, ordered_base: Outputs | None,
               findings: dict) -> dict[str, list[str] | str]:
    """check_all's runs, adding to `findings` as each invariant is checked."""
    inputs = ctx.inputs
    args = (inputs.q, inputs.k, inputs.v, inputs.q_offsets, inputs.kv_offsets, inputs.dout)
    before = _input_bytes(inputs)
    all_names = ("out", "lse", "dq", "dk", "dv")

    if base is None:
        base = run(fn, *args, inputs.kwargs, backward=True)
    base = _parked(base)
    if "run_to_run" not in waived:
        # dq may use atomics unless deterministic=True; everything else must repeat bitwise regardless.
        findings["repeatable"] = _differences(base, run(fn, *args, inputs.kwargs, backward=True),
                                              ("out", "lse", "dk", "dv"))
    # Three runs guard their buffers (`verify.guards`), each adding what it wrote outside them to `in_bounds`:
    # the written run, default mode; the retained graph's, deterministic=True with two backwards (a dq_order
    # backend's other kernel path among them); and the padding run.
    guarded = "guarded_allocations" not in waived
    # Compared with the reference, not with `base`: torch-based backends may pick other (deterministic)
    # library kernels in this mode.
    with nan_filled_allocations(), _guarded(ctx, guarded, findings):
        findings["written"] = _unwritten(run(fn, *args, inputs.kwargs, backward=True), ctx)
    retained = None
    if "retained_graph" not in waived:
        with _guarded(ctx, guarded, findings, "deterministic=True, two backwards over one graph: "):
            findings["backward_again"], retained = _backward_again(fn, args, inputs.kwargs)
    first = ordered_base
    if "run_to_run" not in waived:
        if first is None:
            first = run(fn, *args, inputs.kwargs, backward=True, deterministic=True)
        # The retained graph's first backward is a run of the call with deterministic=True like any other: it
        # serves as the second run here (one call of the op fewer per case), unless that backward raised.
        second = retained if retained is not None else run(fn, *args, inputs.kwargs, backward=True, deterministic=True)
        findings["deterministic"] = _differences(first, second, all_names)
    # Whole runs held at once bound the largest case this fits one GPU (offset_overflow's run holds 11 GB): only
    # `base` and, with dq_order, `first`'s dq are compared with later runs.
    retained = second = None
    if "batch" in waived:
        findings["offsets_reused"] = _rerun_in(_rotated_buffers(fn, inputs), fn, inputs, base)
        return _with_inputs_check(findings, inputs, before)

    # With dq_order declared, dq is compared between deterministic=True runs (`first` and the padded and
    # sub-batch runs made in that mode), the other tensors in the default mode as for every backend.
    unordered_dq = "dq_order" in waived
    names = tuple(n for n in all_names if n != "dq") if unordered_dq else all_names
    if unordered_dq:  # only first's dq is compared from here on
        if first is None:
            first = run(fn, *args, inputs.kwargs, backward=True, deterministic=True)
        first = dataclasses.replace(first, out=None, lse=None, dk=None, dv=None)
    else:
        first = None
    # Guarded: a kernel reading an offsets entry past the end runs one more sequence, whose rows it writes past
    # the outputs' ends (`CaseInputs.with_nan_tail`).
    with _guarded(ctx, guarded, findings, "NaN rows and offsets entries past the inputs' ends: "):
        findings["padding"] = _padding(fn, inputs, base, first, names)

    if "isolation" not in waived or "isolation_grad" not in waived:
        found = dict(zip(("isolation", "isolation_grad"), _isolation(fn, ctx, base, names), strict=True))
        findings.update({group: problems for group, problems in found.items() if group not in waived})

    findings["batch_permuted"], findings["batch_alone"], findings["offsets_reused"] = [], [], []
    if ctx.problem.batch > 1:
        order = torch.randperm(ctx.problem.batch, generator=torch.Generator().manual_seed(ctx.case.seed)).tolist()
        runs = [("batch_permuted", order)] + [("batch_alone", [b]) for b in _alone_samples(ctx.problem)]
        # broadcast_q's dq is the batch's sum: not compared between batches
        dq_first = None if ctx.problem.broadcast_q else first
        for name, sub_order in runs:
            problems, offsets_buffers = _sub_batch_problems(fn, ctx, base, dq_first, sub_order, names)
            findings[name] += problems
            if name == "batch_permuted":
                # Its offsets buffers served a checked call of the case's size: now the case's own, in place.
                findings["offsets_reused"] = _rerun_in(offsets_buffers, fn, inputs, base)

    return _with_inputs_check(findings, inputs, before)


# The runs a device holds at once here, in units of one run's outputs (out, lse, dq, dk, dv): the inputs (q, k, v and
# dout, about one), `base`, two more (`deterministic` compares `first` with the retained graph's backward while `base`
# waits) and a run's temporaries (tlx's fp32 dq: half of one), with the case's context and allocator slack about
# six. offset_overflow:200 (16.4 GiB a run) ran out of an H100's 79 GiB on 2026-12-06 (70 GiB held, 8.2 GiB asked).
RUNS_HELD = 6


def _device_memory(device: torch.device) -> int | None:
    """The device memory this process can hold, in bytes: what is free plus what its allocator holds already (the
    runs RUNS_HELD counts are this process's); other processes on the device (a group's sanitizer shards, other
    workers) leave less. None for the host."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def _parked(outputs: Outputs) -> Outputs:
    """`outputs` moved to the host where RUNS_HELD runs of their size pass the device memory this process can hold
    (`_device_memory`), else as they are (the same object). Comparisons with it then take place on the host
    (`bitwise_equal`); the device holds one run fewer."""
    memory = _device_memory(outputs.out.device)
    run_bytes = sum(t.numel() * t.element_size() for t in outputs.named().values())
    if memory is None or RUNS_HELD * run_bytes <= memory:
        return outputs
    return Outputs(**{name: None if t is None else t.cpu() for name, t in vars(outputs).items()})


def _padding(fn, inputs, base: Outputs, first: Outputs | None, names) -> list[str]:
    """The case's call on copies of its inputs with NaN rows and offsets entries past their ends must give
    `base`'s `names` bitwise, and with `first` (dq_order) first's dq in deterministic mode. The copies are gone on
    return, before the runs that follow."""
    padded = inputs.with_nan_tail(7)
    args = (padded.q, padded.k, padded.v, padded.q_offsets, padded.kv_offsets, padded.dout)
    problems = _differences(base, run(fn, *args, padded.kwargs, backward=True), names)
    if first is not None:
        problems += _differences(first, run(fn, *args, padded.kwargs, backward=True, deterministic=True), ("dq",))
    return problems


def _not_the_backends_answer(error: RuntimeError) -> bool:
    """Whether an error raised in a run says nothing about the invariant being checked: a device fault (the suite
    replaces the process) or the device's memory running out (the case's size, not a backend refusing the
    guards or a retained graph). Such an error ends the invariants, and the record names those checked before it."""
    return is_device_fault(error) or isinstance(error, torch.OutOfMemoryError)


@contextlib.contextmanager
def _guarded(ctx: CaseContext, on: bool, findings: dict, label: str = ""):
    """The block under `verify.guards` when `on` (else as it is); afterwards each buffer it wrote outside of is
    added to findings["in_bounds"], prefixed with `label` (which run it was). A call that raises under the guards
    is told which waiver group says it cannot run there."""
    if not on:
        yield
        return
    guards = GuardedAllocations(ctx.inputs.q.device, ctx.case.seed)
    try:
        with guards:
            yield
    except RuntimeError as error:
        if _not_the_backends_answer(error):
            raise
        raise RuntimeError(f"the call raised under the suite's allocation guards (verify.guards; a backend "
                           f"that cannot run under a TorchDispatchMode, such as one compiled by torch.compile, "
                           f"declares the waiver group 'guarded_allocations'): {error}") from error
    findings.setdefault("in_bounds", []).extend(label + problem for problem in guards.stray_writes())


def _backward_again(fn, args, kwargs: dict) -> tuple[list[str], Outputs | None]:
    """Two backwards over one forward's retained graph (deterministic=True, so dq too) must give the same
    gradients bitwise. A backward that overwrites what its forward saved (its statistics turned in place into
    the form it needs, say) gives the second wrong ones, silently where a kernel writes them: autograd's
    version counters see only torch's in-place ops. A backward refusing the retained graph fails too.
    Returns the problems and the first backward's outputs (None where a backward raised)."""
    try:
        first, second = run_backwards(fn, *args, kwargs, backwards=2, deterministic=True)
    except RuntimeError as error:
        if _not_the_backends_answer(error):
            raise
        return [f"a second backward over the retained graph raised {type(error).__name__}: {str(error)[:300]}"], None
    return _differences(first, second, ("dq", "dk", "dv")), first


def _isolation(fn, ctx: CaseContext, base: Outputs, names) -> tuple[list[str], list[str]]:
    """The case's call with NaN in the first row of one sequence (the middle one of those with query and key
    rows) of q (unless broadcast_q: its q is every sequence's), k, v and dout, every head, one column: every
    other sequence's results must be bitwise those of `base`. A kernel that multiplies another sequence's rows
    by weight 0 (a key block read past its sequence's end and masked, a packed tile's other slots) turns 0·NaN
    into NaN there; the fuzzer's finite values never show it. The poisoned tensors are contiguous copies (the
    padding check's rule: the layout does not change bits). Returns the problems of the forward's tensors (out,
    lse: `isolation`) and of the gradients (dq, dk, dv: `isolation_grad`), waivable apart."""
    problem, inputs = ctx.problem, ctx.inputs
    poisonable = [b for b in range(problem.batch) if problem.q_lens[b] > 0 and problem.kv_lens[b] > 0]
    if problem.batch < 2 or not poisonable:
        return [], []
    b = poisonable[len(poisonable) // 2]
    generator = torch.Generator().manual_seed(ctx.case.seed)
    column = int(torch.randint(min(problem.head_dim, problem.head_dim_v), (1,), generator=generator))

    def poisoned(x: torch.Tensor, row: int) -> torch.Tensor:
        x = x.clone(memory_format=torch.contiguous_format)
        x[row, :, column] = float("nan")
        return x

    kv_row = int(problem.kv_offsets_host[b])
    q = inputs.q if problem.broadcast_q else poisoned(inputs.q, int(problem.q_offsets_host[b]))
    got = run(fn, q, poisoned(inputs.k, kv_row), poisoned(inputs.v, kv_row), inputs.q_offsets, inputs.kv_offsets,
              poisoned(inputs.dout, int(problem.out_offsets_host[b])), inputs.kwargs, backward=True)
    others = [i for i in range(problem.batch) if i != b]
    _, out_parts, kv_parts = sequence_rows(problem, others)
    rows = tensor_rows(problem, out_parts, kv_parts)
    others_only = Outputs(**{name: t.index_select(rows[name][1], cat_rows(rows[name][0]).to(t.device))
                             if name in rows else t for name, t in vars(got).items()})
    found = []
    for part in (("out", "lse"), ("dq", "dk", "dv")):
        problems = compare_sub_batch(ctx, base, others_only, others, out_parts, kv_parts,
                                     [n for n in names if n in part])
        found.append([f"NaN in sequence {b}'s first row changed {problem}" for problem in problems])
    return found[0], found[1]


def _sub_batch_problems(fn, ctx: CaseContext, base: Outputs, dq_first: Outputs | None, order,
                        names) -> tuple[list[str], tuple]:
    """The case's call on the sub-batch of its sequences `order`, compared with `base` (`names`) and, where
    `dq_first` is given (dq_order), in deterministic mode with dq_first's dq. Returns the problems and the
    sub-batch's offsets buffers. The sub-batch's inputs and runs die here, each run once compared: on
    offset_overflow:201 each is a whole case's size (15.6 GB of inputs, 16 GB a run), and a loop keeping one sub-batch's
    into the next one's run ran an H100 out of memory (2026-12-07, 70 GiB held)."""
    sub, out_parts, kv_parts = sub_batch(ctx.problem, ctx.inputs, order)
    args = (sub.q, sub.k, sub.v, sub.q_offsets, sub.kv_offsets, sub.dout)
    problems = compare_sub_batch(ctx, base, run(fn, *args, sub.kwargs, backward=True), order, out_parts, kv_parts,
                                 names)
    if dq_first is not None:
        problems += compare_sub_batch(ctx, dq_first, run(fn, *args, sub.kwargs, backward=True, deterministic=True),
                                      order, out_parts, kv_parts, ("dq",))
    return problems, (sub.q_offsets, sub.kv_offsets)


def _rerun_in(buffers, fn, inputs, base: Outputs) -> list[str]:
    """The case's call again, its offsets written in place into buffers (q's or None, kv's) that served
    another call of their size first, as a training loop reuses one buffer: a kernel that keeps host state by
    buffer (a tile schedule cached by tensor identity or address) runs the old lengths. Compared with `base`
    like a repeated run."""
    for target, offsets in zip(buffers, (inputs.q_offsets, inputs.kv_offsets), strict=True):
        if target is not None:
            target.copy_(offsets)
    again = run(fn, inputs.q, inputs.k, inputs.v, *buffers, inputs.dout, inputs.kwargs, backward=True)
    return _differences(base, again, ("out", "lse", "dk", "dv"))


def _rotated_buffers(fn, inputs) -> tuple:
    """Offsets buffers that served a call first, for backends that waive batch invariance (no checked
    sub-batch call to borrow them from): the case's rows with the sequence lengths rotated by one."""
    buffers = tuple(None if offsets is None else offsets_of(offsets.long().diff().roll(1))
                    for offsets in (inputs.q_offsets, inputs.kv_offsets))
    run(fn, inputs.q, inputs.k, inputs.v, *buffers, inputs.dout, inputs.kwargs, backward=True)
    return buffers


def _input_bytes(inputs) -> list[torch.Tensor]:
    """Host copies of the allocations behind q, k, v and dout: on the GPU they would take as much memory again as
    the inputs (15.6 GB for offset_overflow:201) beside the runs the invariants hold."""
    return [allocation_bytes(x).cpu() for x in (inputs.q, inputs.k, inputs.v, inputs.dout)]


def _with_inputs_check(findings: dict, inputs, before) -> dict:
    after = _input_bytes(inputs)
    findings["inputs_unchanged"] = [f"the allocation behind {name} was modified" for name, x, y in
                                    zip(("q", "k", "v", "dout"), before, after, strict=True) if not torch.equal(x, y)]
    return findings


def _alone_samples(problem: Problem) -> list[int]:
    """The sequences re-run alone per case: the longest, the median and the first and last with queries
    (the median catches arithmetic that depends on the batch's max length, which the longest alone does not
    change)."""
    with_rows = torch.nonzero(problem.q_lens > 0).flatten().tolist()
    if not with_rows:
        return []
    by_work = sorted(with_rows, key=lambda b: int(problem.q_lens[b]) * int(problem.kv_lens[b]))
    return sorted({by_work[-1], by_work[len(by_work) // 2], with_rows[0], with_rows[-1]})

"""One test of one backend on one case, as records: the library behind verify/test_numerics.py, also
called directly by the gate, bisect and the planted-bug tests."""

from __future__ import annotations

import dataclasses
import functools
import time

import torch

from jfa import backends
from verify.context import HostMemoryShortfall, case_context, case_plan
from verify.invariants import check_all
from verify.results import tensor_record
from verify.runner import BackendCrash, is_device_fault, run
from verify.stats import compare

TESTS = {"forward": ("out", "lse"), "backward": ("dq", "dk", "dv"), "invariants": ()}
# A backend declaring `dq_order` computes dq by another path when deterministic=True (the default mode adds it
# in no fixed order). The invariants compare that path's dq only with itself, so the backward test also grades
# it against the reference, as this record.
ORDERED_DQ = "dq (deterministic=True)"


@functools.cache
def backend_fn(spec: str):
    """(callable with jfa.attention's signature, availability check) for a backend name or module:function."""
    return backends.attention_fn(spec)


def _registered(spec: str, attribute: str):
    """An optional attribute of a registered backend; None for a backend named by module:function, which
    declares nothing (it is gated, promises every invariant and runs every case)."""
    return None if ":" in spec else getattr(backends.get(spec), attribute, None)


def kernel_config(spec: str, problem) -> dict | None:
    """The kernel configuration a registered backend reports for this problem, if it reports one."""
    describe = _registered(spec, "config")
    return describe(problem) if describe else None


def gating(spec: str) -> bool:
    """Whether the backend's failures fail the run: peers are measured for comparison, not gated."""
    return _registered(spec, "gating") is not False


def invariance_waivers(spec: str, device: torch.device) -> dict[str, str]:
    """The invariant groups (verify.invariants.WAIVABLE) a backend does not promise on this device, each with
    the reason."""
    waivers = _registered(spec, "invariance_waivers")
    return waivers(device) if waivers else {}


def verify_skip(spec: str, problem, device: torch.device) -> str | None:
    """Why a backend asks the suite not to run this case on this device (its cost there), or None."""
    skip = _registered(spec, "verify_skip")
    return skip(problem, device) if skip else None


def replay_command(spec: str, case_id: str) -> str:
    return f"pytest verify/ --jfa-backend '{spec}' --jfa-case '{case_id}'"


def check_case(spec: str, case_id: str, test: str, device: torch.device) -> list[dict]:
    """Runs `test` ("forward", "backward" or "invariants") and returns its records (status per tensor or
    invariant: pass, fail, skip with the reason, or crash). Raises BackendCrash after recording a device
    fault, so the caller can replace the process."""
    fn, _ = backend_fn(spec)
    start = time.perf_counter()
    plan = case_plan(case_id)
    common = dict(kind="result", backend=spec, case=case_id, family=plan.case.family, test=test,
                  replay=replay_command(spec, case_id))
    if plan.sample is not None:
        common["graded"] = plan.sample.describe()

    def not_run_here(reason: str) -> list[dict]:
        return [dict(common, config=kernel_config(spec, plan.problem), context_s=time.perf_counter() - start,
                     tensor="*", status="skip", message=f"not run here: {reason}")]

    too_costly = verify_skip(spec, plan.problem, device)
    if too_costly:  # decided before the case's values are drawn
        return not_run_here(too_costly)
    # context_s: building the case's inputs, reference and baseline, 0 when this process had them cached
    # (how often workers rebuild a case shows how well the scheduler keeps a case on one worker).
    start = time.perf_counter()
    try:
        ctx = case_context(case_id, device.type)
    except HostMemoryShortfall as shortfall:
        return not_run_here(str(shortfall))
    common.update(config=kernel_config(spec, ctx.problem), context_s=time.perf_counter() - start)
    waivers = invariance_waivers(spec, device)
    start = time.perf_counter()
    try:
        if test == "invariants":
            # Their last use: popped, so that a worker running several backends on a case holds one's runs at a time.
            findings = check_all(fn, ctx, waivers, ctx.backward_runs.pop(spec, None), ctx.ordered_runs.pop(spec, None))
        else:
            inputs = ctx.inputs
            args = (inputs.q, inputs.k, inputs.v, inputs.q_offsets, inputs.kv_offsets, inputs.dout, inputs.kwargs)
            outputs = run(fn, *args, backward=test == "backward")
            graded = [(name, name, getattr(outputs, name), common) for name in TESTS[test]]
            if test == "backward":
                ctx.backward_runs[spec] = outputs
            if test == "backward" and "dq_order" in waivers:
                ordered = ctx.ordered_runs[spec] = run(fn, *args, backward=True, deterministic=True)
                config = kernel_config(spec, dataclasses.replace(ctx.problem, deterministic=True))
                graded.append((ORDERED_DQ, "dq", ordered.dq, dict(common, config=config)))
    except NotImplementedError as error:
        return [dict(common, tensor="*", status="skip", message=f"unsupported: {error}")]
    except Exception as error:  # a valid input must not raise; a device fault ends the process
        status = "crash" if is_device_fault(error) else "fail"
        notes = "".join(f" ({note})" for note in getattr(error, "__notes__", ()))
        record = dict(common, tensor="*", status=status, message=f"{type(error).__name__}: {error}{notes}",
                      duration_s=time.perf_counter() - start)
        if status == "crash":
            raise BackendCrash(record) from error
        return [record]
    duration = time.perf_counter() - start
    if test == "invariants":
        return [dict(common, tensor=name, status="skip", message=f"not applicable: {problems}", duration_s=duration)
                if isinstance(problems, str) else
                dict(common, tensor=name, status="fail" if problems else "pass", checks={name: not problems},
                     message="; ".join(problems) or None, duration_s=duration)
                for name, problems in findings.items()]
    records = []
    for label, name, whole, context in graded:
        got = ctx.graded(name, whole)
        if got is None:
            records.append(dict(context, tensor=label, status="skip", duration_s=duration,
                                message=f"not graded: {name} is every sequence's sum, and the case is "
                                        f"{context['graded']}"))
            continue
        ref, bound, logit_bound = ctx.reference.tensors()[name]
        start = time.perf_counter()
        stats = compare(name, got, ref, bound, logit_bound, ctx.exact[name], ctx.row_offsets[name],
                        ctx.problem.dtype, getattr(ctx.baseline, name),
                        head_dim=max(ctx.problem.head_dim, ctx.problem.head_dim_v),
                        sequence_ids=None if ctx.sample is None else ctx.sample.order)
        records.append({**context, **tensor_record(stats), "tensor": label, "duration_s": duration,
                        "stats_s": time.perf_counter() - start})
    return records


def failure_message(records: list[dict]) -> str:
    """What failed, where and by how much, with the replay command."""
    lines = []
    for r in records:
        if r["status"] not in ("fail", "crash"):
            continue
        head = f"{r['backend']} on {r['case']} [{r['test']}] {r['tensor']}: "
        if r.get("checks") and r.get("stats"):
            s, w = r["stats"], r.get("worst") or {}
            failed = [name for name, ok in r["checks"].items() if not ok]
            lines.append(
                head + f"failed {', '.join(failed)}; bound ratio {s['bound_ratio']:.3g}, baseline ratio "
                f"{s['baseline_ratio'] if s['baseline_ratio'] is None else format(s['baseline_ratio'], '.3g')}, "
                f"max |err| {s['max_abs_err']:.3g}, non-finite {s['nonfinite']}, exact mismatches "
                f"{s['exact_mismatch']}/{s['exact_checked']}, bias {s['bias_mean']:+.3f} (p={s['bias_p']:.2g}); "
                f"worst at sequence {w.get('sequence')}, row {w.get('row')}, head {w.get('head')}, column "
                f"{w.get('column')}: got {w.get('value')!r}, reference {w.get('reference')!r}, bound {w.get('bound')!r}"
            )
        else:
            lines.append(head + (r.get("message") or r["status"]))
        if r.get("graded"):
            lines[-1] += f" ({r['graded']})"
    if lines:
        lines.append("replay: " + records[0]["replay"])
    return "\n".join(lines)

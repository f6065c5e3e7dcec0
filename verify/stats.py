"""Error statistics of one output tensor of one backend on one case, and the verdict on them.

Every tensor is viewed as [rows, heads, columns] (lse as [rows, heads, 1]) with `row_offsets` splitting the
rows into sequences, so errors are reported per sequence and head and the worst element is located as
(sequence, row in sequence, head, column).

Checks, each of which fails the tensor on its own:
- finite: no NaN/Inf where the reference is finite.
- exact: where the contract fixes a value (rows with no visible key: out 0, lse -inf, dq 0; keys no query
  sees: dk = dv = 0), the value is bitwise that.
- bound: max over elements of |err| / bound <= BOUND_LIMIT, the componentwise bound of reference.exact.
- baseline: per (sequence, head) block, max |err| <= BASELINE_FACTOR · (the bf16 model's max |err| in
  the block) + one ulp of the block's largest reference value + the block's largest logit-rounding bound
  (where fp32 logit rounding dominates — logits of ~1e4 and more — two correct kernels that sum the
  logits in different orders differ by up to that much, so the model's own error says nothing there)
  + FP32 allowance: (D + 2)·u32/u of the block's largest bound. A kernel's fp32 sums are ordered
  differently from the model's: D = rowsum(dO∘O) and dP = dO·Vᵀ, equal in exact arithmetic for a row with
  one visible key (dS = 0, so dq = dk = 0), differ by fp32 rounding of D-term sums, i.e. (D + 2)·u32
  relative to the magnitudes the bound is built from (bound / u), where the model happens to be exact.
- bias: not for lse, an fp32 result whose error is the hardware's approximate exp2/log2 (the bound's own
  scale), not a rounding mode.
- bias: the mean of the normalised signed error (err / bound), raw and towards the reference's sign, is
  not both significant (p < BIAS_P) and larger than BIAS_FLOOR + BIAS_FACTOR · the model's own.

Statistics the gate ratchets besides the bound, baseline and bias figures: rel_l2, the L2 norm of the error over
that of the reference, and max_ulp, the largest error in units of the dtype's spacing at the reference, both
over the elements at or above their own error bound (0 when there are none; max_ulp also leaves out those far
below the tensor's largest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from verify.limits import (  # the checks' thresholds
    BASELINE_FACTOR,
    BIAS_FACTOR,
    BIAS_FLOOR,
    BIAS_P,
    BOUND_LIMIT,
    ULP_BINS,
    ULP_MAGNITUDE_FLOOR,
)


def _max(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def as_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """[rows, heads, columns] view: lse [H, rows] becomes [rows, H, 1]."""
    return t.transpose(0, 1).unsqueeze(-1) if name == "lse" else t


def ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` values at |ref| (float64)."""
    info = torch.finfo(dtype)
    mantissa_bits = round(-math.log2(info.eps))
    exponent = torch.floor(torch.log2(ref.abs().clamp_min(info.smallest_normal)))
    return torch.exp2(exponent - mantissa_bits)


@dataclass
class TensorStats:
    tensor: str
    elements: int
    nonfinite: int
    exact_checked: int
    exact_mismatch: int
    max_abs_err: float
    rel_l2: float
    max_ulp: float
    ulp_histogram: list[int]  # counts per ULP_BINS interval, over the elements of the ulp statistic
    bound_ratio: float
    baseline_ratio: float | None
    bias_mean: float
    bias_magnitude_mean: float
    bias_p: float
    baseline_bias_mean: float | None
    baseline_bias_magnitude_mean: float | None
    worst: dict | None
    worst_baseline_block: dict | None
    per_sequence: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(self.checks.values())

    def failures(self) -> list[str]:
        return [name for name, ok in self.checks.items() if not ok]


def _segment_ids(row_offsets: torch.Tensor, rows: int, device) -> torch.Tensor:
    """Sequence index of every row (rows past the last offset, if any, get the last index)."""
    starts = row_offsets[1:-1].to(device)
    return torch.bucketize(torch.arange(rows, device=device), starts, right=True)


def _segment_max(values: torch.Tensor, seg: torch.Tensor, n_seg: int) -> torch.Tensor:
    """[rows, H] -> [n_seg, H] maxima (0 for empty segments)."""
    out = torch.zeros(n_seg, values.shape[1], dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, seg.view(-1, 1).expand_as(values), values, "amax", include_self=True)


def _bias(err_signed: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, use: torch.Tensor):
    """The mean normalised signed error, raw and towards the reference's sign, and the smaller p-value of the
    two one-sample t-tests against 0. scipy's ttest_1samp, but from float64 moments taken where the tensors
    are: a backward of a premerge case has tens of millions of elements (the statistics were 45% of the H200
    workers' time, and on the CPU this copy and scipy two thirds of a many-sequence case's statistics)."""
    # Student's t tail from scipy.special, imported here: scipy.stats.t.sf(x, df) is stdtr(df, -x), bit for
    # bit, but importing scipy.stats took 2.3 s in each worker's first test on the H200 machine (0.9 s on the
    # CPU), scipy.special 0.2 s; only a process that computes statistics pays it.
    from scipy.special import stdtr

    e = (err_signed[use] / bound[use]).double()
    count = e.numel()
    if count < 2:
        return 0.0, 0.0, 1.0
    means, p_values = [], []
    for sample in (e, e * torch.sign(ref[use]).double()):
        variance, mean = (float(x) for x in torch.var_mean(sample))
        means.append(mean)
        if bool((sample == sample[0]).all()):
            p_values.append(1.0)
        else:
            t_statistic = mean / math.sqrt(variance / count) if variance > 0 else math.copysign(math.inf, mean)
            p_values.append(float(2 * stdtr(count - 1, -abs(t_statistic))))
    return means[0], means[1], min(p_values)


def compare(
    name: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    bound: torch.Tensor,
    logit_bound: torch.Tensor,
    exact_mask: torch.Tensor,
    row_offsets: torch.Tensor,
    dtype: torch.dtype,
    baseline: torch.Tensor | None = None,
    head_dim: int = 0,
    sequence_ids: list[int] | None = None,
) -> TensorStats:
    """Statistics of `got` against the float64 `ref`; `exact_mask` marks elements the contract fixes.
    `sequence_ids`: the case's index of each sequence of `row_offsets`, where they are a sample of its
    sequences (`verify.graded`): locations and per-sequence figures then name those."""
    device = ref.device
    x = as_rows(got.detach().to(device, torch.float64), name)
    r = as_rows(ref, name)
    b = as_rows(bound.to(device, torch.float64), name)
    exact = as_rows(exact_mask.to(device), name).expand_as(r)
    u = torch.finfo(dtype).eps / 2
    finite_ref = torch.isfinite(r)
    finite_got = torch.isfinite(x)
    nonfinite = int((finite_ref & ~finite_got).sum())
    exact_mismatch = int((exact & (x != r)).sum())
    graded = finite_ref & ~exact
    diff = torch.where(graded & finite_got, x - r, 0.0)
    err = torch.where(graded & ~finite_got, math.inf, diff.abs())
    with torch.no_grad():
        ratio = torch.where(b > 0, err / b.clamp_min(1e-300), torch.where(err > 0, math.inf, 0.0))
    ratio = torch.where(graded, ratio, 0.0)
    elements = int(graded.sum())
    magnitude = torch.where(graded, r.abs(), 0.0)
    # The relative statistics' elements are those at or above their own error bound. Below it a result cancels to
    # about zero (dk and dq with identical V rows; every gradient of logits_below_min, whose bound is the fp32
    # rounding of logits near -5e4, 10^4 times the values): the bound allows an error larger than the value, so
    # the error relative to the value measures the rounding the bound allows, not the kernel's precision, and
    # follows the summation order of the logits and of the CPU's GEMM kernels. There, one correct kernel's
    # relative L2 error over all elements was 0.097 on one CPU and 4.6 on another (Intel and AMD, the same
    # code, inputs and MKL_CBWR; its bound ratio 0.0020 and 0.0023), past the gate's band, then 10x.
    conditioned = graded & (magnitude >= b)
    ref_norm = float(torch.linalg.vector_norm(torch.where(conditioned, r, 0.0)))
    conditioned_diff = torch.where(conditioned, diff, 0.0)
    rel_l2 = (float(torch.linalg.vector_norm(conditioned_diff)) / ref_norm if ref_norm > 0
              else _max(conditioned_diff.abs()))
    # The ulp statistic's elements: those, and not near zero against the tensor's largest (the ulps of a value
    # far below the largest say little; the L2 norm weighs them by their size already).
    big = conditioned & (magnitude >= ULP_MAGNITUDE_FLOOR * _max(magnitude)) & (magnitude > 0)
    ulp_errors = (err / ulp(r, dtype))[big]
    max_ulp = _max(ulp_errors)
    edges = torch.tensor(ULP_BINS, dtype=torch.float64, device=device)
    bins = torch.bucketize(ulp_errors, edges[1:-1], right=True)
    ulp_histogram = torch.bincount(bins, minlength=len(ULP_BINS) - 1).tolist()

    worst = None
    if elements:
        flat = int(torch.argmax(ratio))
        row, head, col = np.unravel_index(flat, tuple(ratio.shape))
        worst = _locate(row_offsets, int(row), int(head), int(col), name, sequence_ids)
        worst.update(value=float(x[row, head, col]), reference=float(r[row, head, col]),
                     bound=float(b[row, head, col]), ratio=float(ratio[row, head, col]))

    seg = _segment_ids(row_offsets, r.shape[0], device)
    n_seg = max(1, row_offsets.numel() - 1)
    block_err = _segment_max(err.amax(-1), seg, n_seg)
    seq_ratio = _segment_max(ratio.amax(-1), seg, n_seg)
    lengths = (row_offsets[1:] - row_offsets[:-1]).cpu()
    baseline_ratio = base_bias = base_bias_mag = worst_block = None
    if baseline is not None:
        xb = as_rows(baseline.detach().to(device, torch.float64), name)
        base_err = torch.where(graded, (xb - r).abs(), 0.0).nan_to_num(nan=math.inf)
        block_base = _segment_max(base_err.amax(-1), seg, n_seg)
        block_ref = _segment_max(magnitude.amax(-1), seg, n_seg)
        # logit_bound is [H, rows]: an upper bound of each row's (and head's) logit-rounding bound.
        block_logit = _segment_max(logit_bound.to(device, torch.float64).T, seg, n_seg)
        block_bound = _segment_max(torch.where(graded, b, 0.0).amax(-1), seg, n_seg)
        fp32_allowance = (head_dim + 2) * 2.0**-24 / u * block_bound
        allowed = BASELINE_FACTOR * block_base + 2 * u * block_ref + block_logit + fp32_allowance
        block_ratio = torch.where(allowed > 0, block_err / allowed.clamp_min(1e-300),
                                  torch.where(block_err > 0, math.inf, 0.0))
        baseline_ratio = _max(block_ratio)
        if block_ratio.numel():
            s, h = np.unravel_index(int(torch.argmax(block_ratio)), tuple(block_ratio.shape))
            worst_block = dict(sequence=_case_sequence(int(s), sequence_ids), head=int(h), err=float(block_err[s, h]),
                               baseline_err=float(block_base[s, h]), ratio=float(block_ratio[s, h]))
        base_signed = torch.where(graded & torch.isfinite(xb), xb - r, 0.0)
        base_bias, base_bias_mag, _ = _bias(base_signed, r, b, graded & (b > 0))
    bias_mean, bias_mag, bias_p = _bias(diff, r, b, graded & (b > 0) & finite_got)

    checks = {
        "finite": nonfinite == 0,
        "exact": exact_mismatch == 0,
        "bound": _max(ratio) <= BOUND_LIMIT,
        "baseline": baseline_ratio is None or baseline_ratio <= 1.0,
        "bias": name == "lse" or not (
            bias_p < BIAS_P and (
                abs(bias_mean) > BIAS_FLOOR + BIAS_FACTOR * abs(base_bias or 0.0)
                or abs(bias_mag) > BIAS_FLOOR + BIAS_FACTOR * abs(base_bias_mag or 0.0)
            )
        ),
    }
    return TensorStats(
        tensor=name, elements=elements, nonfinite=nonfinite, exact_checked=int(exact.sum()),
        exact_mismatch=exact_mismatch, max_abs_err=_max(err), rel_l2=rel_l2, max_ulp=max_ulp,
        ulp_histogram=ulp_histogram,
        bound_ratio=_max(ratio), baseline_ratio=baseline_ratio, bias_mean=bias_mean,
        bias_magnitude_mean=bias_mag, bias_p=bias_p, baseline_bias_mean=base_bias,
        baseline_bias_magnitude_mean=base_bias_mag, worst=worst, worst_baseline_block=worst_block,
        per_sequence=_per_sequence(lengths, block_err, seq_ratio, sequence_ids), checks=checks,
    )


def _case_sequence(index: int, sequence_ids: list[int] | None) -> int:
    """The case's index of the index-th sequence of the compared rows (they are all of the case's, or the
    sample `sequence_ids` names)."""
    return index if sequence_ids is None else sequence_ids[index]


def _locate(row_offsets: torch.Tensor, row: int, head: int, col: int, name: str,
            sequence_ids: list[int] | None = None) -> dict:
    offsets = row_offsets.cpu()
    seq = int(torch.searchsorted(offsets[1:], torch.tensor(row), right=True)) if offsets.numel() > 1 else 0
    return dict(sequence=_case_sequence(seq, sequence_ids), row=row - int(offsets[seq]),
                head=head, column=None if name == "lse" else col)


def _per_sequence(lengths: torch.Tensor, block_err: torch.Tensor, seq_ratio: torch.Tensor,
                  sequence_ids: list[int] | None = None, limit: int = 512) -> dict:
    """Per-sequence length, max error and max bound ratio (at most `limit` sequences, spread evenly), and the
    sequences' indices in the case where they are a sample of its sequences."""
    n = lengths.numel()
    pick = torch.arange(n) if n <= limit else torch.linspace(0, n - 1, limit).round().long()
    ids = {} if sequence_ids is None else {"sequence": [sequence_ids[i] for i in pick.tolist()]}
    return dict(
        **ids,
        length=lengths[pick].tolist(),
        max_err=block_err.amax(-1).cpu()[pick].tolist() if block_err.numel() else [],
        bound_ratio=seq_ratio.amax(-1).cpu()[pick].tolist() if seq_ratio.numel() else [],
    )

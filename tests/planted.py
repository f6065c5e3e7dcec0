"""Deliberately wrong kernels, each a bug that real varlen kernels shipped (see ../shared/FAILURES.md), and
the check of the verify suite that must catch it.

All are one tiled flash-attention emulator in PyTorch (online softmax over key blocks, the input dtype's
rounding of P and dS, fp32 accumulation), with one bug switched on. The clean emulator passes the suite;
each planted bug must fail its named check. They are registered as backends `planted-<bug>` and exposed
as module-level callables (`tests.planted:<bug>`) so the suite can also be pointed at them by spec.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass

import torch

import jfa
from jfa.mask import visible_torch
from jfa.problem import Problem
from verify.guards import allocation_bytes

BLOCK_N = 16


@dataclass(frozen=True)
class Bug:
    name: str
    description: str
    caught_by: str  # "<test>:<check>", e.g. "forward:bound" or "invariants:written"
    families: tuple[str, ...]  # case families where it shows
    op_level: bool = False  # planted around the op (it needs the caller's tensors), not inside the emulator

    @property
    def spec(self) -> str:
        """The backend spec the suite runs it as."""
        return f"tests.planted:{self.name}" if self.op_level else f"planted-{self.name}"


BUGS = (
    Bug("kv_mask_off_by_one", "key mask j <= kv_len at a sequence end: one key of the next sequence leaks in",
        "forward:bound", ("uniform:0", "gem_like:0")),
    Bug("missing_rescale", "online softmax: the accumulator is not rescaled when the running max grows",
        "forward:bound", ("uniform:0", "scaled:0")),
    Bug("lse_base2", "lse returned in base 2 instead of the natural log", "forward:bound", ("uniform:0",)),
    Bug("broadcast_dq_not_summed", "broadcast-Q dq keeps the last sequence's contribution instead of the sum",
        "backward:bound", ("broadcast_q:0", "broadcast_q:1")),
    Bug("unwritten_grad_rows", "dk/dv rows of keys no query sees are left as torch.empty",
        "invariants:written", ("causal_q_ne_kv:0", "window:0", "kv_empty_q_nonempty:0", "empty_middle:0")),
    Bug("neighbour_leak", "keys are masked per block only: the tail of the last key block reads the next sequence",
        "forward:bound", ("uniform:0", "gem_like:0")),
    Bug("masked_neighbour_rows", "a sequence's last key block reads on into the next sequence's rows and masks "
        "them (weight 0): right on finite values, but 0·NaN carries a NaN inside the next sequence across",
        "invariants:isolation", ("uniform:0", "gem_like:0")),
    Bug("p_not_renormalised", "online softmax: the row sum is not rescaled when the running max grows",
        "forward:bound", ("uniform:0", "scaled:0")),
    Bug("lse_fp32_recompute", "backward recomputes P = exp(S - lse) in fp32: for huge logits lse = m, so P sums to n",
        "backward:baseline", ("huge_equal:0", "huge_equal:1")),
    Bug("finite_max_init", "running max initialised to -5e4: rows whose logits are all below it come out 0",
        "forward:bound", ("logits_below_min:0", "logits_below_min:1")),
    Bug("causal_top_left_backward", "backward uses top-left causal alignment, forward bottom-right",
        "backward:bound", ("causal_q_ne_kv:0", "causal_q_ne_kv:1")),
    Bug("truncated_p", "P rounded toward zero (truncated) to the input dtype instead of to nearest",
        "forward:bias", ("uniform:0", "uniform:1")),
    Bug("empty_row_lse_zero", "rows with no visible key get lse 0 instead of -inf", "forward:exact",
        ("causal_q_ne_kv:0", "kv_empty_q_nonempty:0")),
    Bug("nondeterministic_dq", "dq summed over key blocks in a run-dependent order, even when deterministic=True",
        "invariants:deterministic", ("uniform:0", "gem_like:0")),
    Bug("ordered_dq_path", "a backend adding dq in no fixed order (dq_order) whose deterministic=True dq path, "
        "another kernel, drops each sequence's last key block", "backward:bound", ("uniform:0", "gem_like:0")),
    Bug("skipped_tile", "a persistent scheduler skips the last query tile: its output rows stay unwritten",
        "invariants:written", ("uniform:0", "gem_like:0")),
    Bug("gqa_head_map", "backward maps query head h to kv head h % Hkv instead of h // group", "backward:bound",
        ("gqa:0", "gqa:1", "gqa:2")),
    Bug("batch_dependent_blocks", "key block size chosen from max_kv_len: a sequence's rounding depends on its batch",
        "invariants:batch_alone", ("gem_like:0", "one_huge_many_tiny:0", "power_law:0")),
    Bug("dq_first_segment_only", "dq uses the first sequence's keys for every sequence (a zero batch stride)",
        "backward:bound", ("uniform:0", "gem_like:0")),
    Bug("saved_stats_overwritten", "the backward turns the row sums its forward saved into reciprocals in place "
        "(as a kernel writing them would: no version counter sees it): a second backward over a retained graph "
        "reads 1/l as l", "invariants:backward_again", ("uniform:0", "gem_like:0")),
    Bug("tail_block_overrun", "the last query block is stored whole: the rows of out past its end are written "
        "(into whatever memory follows)", "invariants:in_bounds", ("uniform:0", "gem_like:0")),
    Bug("offsets_cached_by_address", "host state kept per offsets buffer (keyed by its address): a buffer "
        "rewritten in place keeps the lengths of its first call", "invariants:offsets_reused",
        ("uniform:0", "gem_like:0"), op_level=True),
    Bug("phantom_tail_sequence", "a scheduler's tile past the last sequence reads the offsets entry after their "
        "end (the caller's buffer, as kernels given cu_seqlens read it) and runs as one more sequence: its rows of "
        "out are stored past the end", "invariants:in_bounds", ("uniform:0", "gem_like:0"), op_level=True),
)
BUG_NAMES = tuple(bug.name for bug in BUGS if not bug.op_level)


def _round(x: torch.Tensor, dtype: torch.dtype, truncate: bool = False) -> torch.Tensor:
    if not truncate:
        return x.to(dtype).float()
    # Round toward zero: drop the low mantissa bits of the fp32 value.
    drop = 23 - round(-math.log2(torch.finfo(dtype).eps))
    bits = x.contiguous().view(torch.int32) & ~((1 << drop) - 1)
    return bits.view(torch.float32).to(dtype).float()


def store_past_end(t: torch.Tensor, rows: int) -> None:
    """Zeros in the `rows` rows just past t's last one, as a kernel storing a whole last block writes them, as far
    as t's allocation holds them (a guarded one holds GUARD_BYTES more, `verify.guards`). Past its allocation a
    kernel writes into whatever memory follows, which an emulator cannot do safely: there it writes nothing."""
    storage = allocation_bytes(t)
    end = (t.storage_offset() + t.shape[0] * t.stride(0)) * t.element_size()
    storage[end:end + rows * t.stride(0) * t.element_size()] = 0


class Emulator:
    """A tiled flash kernel in PyTorch, per sequence; `bug` switches one planted bug on.

    It also offers kernel configurations as an autotuned kernel does (the protocol of verify/bisect.py):
    `configs()` lists them, `use_config(index)` forces one, `config(problem)` reports the one in use. Config
    TRUNCATING_CONFIG is planted bad: it truncates P, as the `truncated_p` bug does.
    """

    description = "tiled flash-attention emulator with a planted bug"
    CONFIGS = ({"BLOCK_N": 16, "p_rounding": "nearest"}, {"BLOCK_N": 32, "p_rounding": "nearest"},
               {"BLOCK_N": 32, "p_rounding": "truncate"}, {"BLOCK_N": 64, "p_rounding": "nearest"})
    TRUNCATING_CONFIG = 2

    def __init__(self, bug: str | None = None, block_n: int = BLOCK_N):
        assert bug is None or bug in BUG_NAMES, bug
        self.bug = bug
        self.name = f"planted-{bug}" if bug else "emulator"
        self.active = {"BLOCK_N": block_n, "p_rounding": "nearest"}

    def unavailable(self, device):
        return None

    def invariance_waivers(self, device) -> dict[str, str]:
        if self.bug == "ordered_dq_path":
            return {"dq_order": "planted: dq added in no fixed order unless deterministic=True"}
        return {}

    def configs(self) -> list[dict]:
        return [dict(c) for c in self.CONFIGS]

    @contextlib.contextmanager
    def use_config(self, index: int):
        previous, self.active = self.active, dict(self.CONFIGS[index])
        try:
            yield
        finally:
            self.active = previous

    def config(self, problem: Problem) -> dict:
        return dict(self.active, BLOCK_N=self._block_n(problem))

    # Per-sequence views --------------------------------------------------------------------------------
    def _sequences(self, problem: Problem):
        for b in range(problem.batch):
            q_len, kv_len = int(problem.q_lens[b]), int(problem.kv_lens[b])
            if q_len:
                yield b, q_len, kv_len

    def _block_n(self, problem: Problem) -> int:
        if self.bug == "batch_dependent_blocks" and problem.max_kv_len > 64:
            return 2 * self.active["BLOCK_N"]
        return self.active["BLOCK_N"]

    def _visible_len(self, kv_len: int) -> int:
        """How many keys of a sequence the (possibly buggy) mask lets through."""
        if self.bug == "kv_mask_off_by_one":
            return kv_len + 1
        if self.bug == "neighbour_leak":
            return self._whole_blocks(kv_len)
        return kv_len

    def _loaded_len(self, kv_len: int) -> int:
        """How many key rows from the sequence's start are read: whole key blocks where a bug reads past its end."""
        if self.bug == "masked_neighbour_rows":
            return self._whole_blocks(kv_len)
        return self._visible_len(kv_len)

    def _whole_blocks(self, kv_len: int) -> int:
        return -(-kv_len // self.active["BLOCK_N"]) * self.active["BLOCK_N"]

    def _keys(self, k, v, problem: Problem, b: int, kv_len: int, first_sequence: bool = False):
        """Key/value rows of sequence b (or of sequence 0, for dq_first_segment_only) as [Hq, L, D] fp32 over
        query heads, reading past the sequence's end where the mask lets keys through, and their rows."""
        start = int(problem.kv_offsets_host[0 if first_sequence else b])
        length = self._loaded_len(kv_len)
        rows = torch.arange(start, start + length, device=k.device).clamp(max=max(problem.kv_rows - 1, 0))
        heads = torch.arange(problem.q_heads, device=k.device) // problem.group_size
        if problem.kv_rows == 0:
            empty = k.new_zeros(problem.q_heads, 0, k.shape[-1]).float()
            return empty, v.new_zeros(problem.q_heads, 0, v.shape[-1]).float(), rows
        kb = k[rows].float().index_select(1, heads).transpose(0, 1)
        vb = v[rows].float().index_select(1, heads).transpose(0, 1)
        return kb, vb, rows

    def _mask(self, problem: Problem, q_len: int, kv_len: int, n_keys: int, device, top_left: bool = False):
        i = torch.arange(q_len, device=device).view(-1, 1)
        j = torch.arange(n_keys, device=device).view(1, -1)
        if top_left:  # causal j <= i, as if q_len == kv_len
            return visible_torch(i, j, q_len, q_len, problem.window, problem.causal) & (j < kv_len)
        return visible_torch(i, j, q_len, self._visible_len(kv_len), problem.window, problem.causal)

    # Forward ----------------------------------------------------------------------------------------------
    def forward(self, q, k, v, problem: Problem):
        dtype, device = q.dtype, q.device
        hq, rows = problem.q_heads, problem.out_rows
        alloc = torch.empty if self.bug == "skipped_tile" else torch.zeros
        out = alloc(rows, hq, problem.head_dim_v, dtype=dtype, device=device)
        lse = torch.full((hq, rows), -math.inf, dtype=torch.float32, device=device)
        stats = torch.zeros(2, hq, rows, dtype=torch.float32, device=device)
        sequences = list(self._sequences(problem))
        skipped = max(sequences, key=lambda s: s[1])[0] if sequences and self.bug == "skipped_tile" else None
        block_n = self._block_n(problem)
        for b, q_len, kv_len in sequences:
            q0 = int(problem.q_offsets_host[b])
            o0 = int(problem.out_offsets_host[b])
            qs = q[q0:q0 + q_len].float().transpose(0, 1)
            ks, vs, _ = self._keys(k, v, problem, b, kv_len)
            mask = self._mask(problem, q_len, kv_len, ks.shape[1], device)
            init = -5e4 if self.bug == "finite_max_init" else -math.inf
            m = torch.full((hq, q_len), init, device=device)
            l_sum = torch.zeros(hq, q_len, device=device)
            acc = torch.zeros(hq, q_len, problem.head_dim_v, device=device)
            for j0 in range(0, ks.shape[1], block_n):
                s = (qs @ ks[:, j0:j0 + block_n].transpose(1, 2)) * problem.sm_scale
                s = s.masked_fill(~mask[:, j0:j0 + block_n], -math.inf)
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
                alpha = torch.exp(m - m_safe)
                p = torch.exp(s - m_safe.unsqueeze(-1))
                l_sum = (l_sum if self.bug == "p_not_renormalised" else alpha * l_sum) + p.sum(-1)
                truncate = self.bug == "truncated_p" or self.active["p_rounding"] == "truncate"
                pv = _round(p, dtype, truncate=truncate) @ vs[:, j0:j0 + block_n]
                acc = (acc if self.bug == "missing_rescale" else alpha.unsqueeze(-1) * acc) + pv
                m = m_new
            o = torch.where(l_sum.unsqueeze(-1) > 0, acc / l_sum.clamp_min(1e-30).unsqueeze(-1), 0.0)
            row_lse = torch.where(l_sum > 0, m + torch.log(l_sum), -math.inf)
            if self.bug == "lse_base2":
                row_lse = row_lse / math.log(2)
            if self.bug == "empty_row_lse_zero":
                row_lse = torch.where(torch.isinf(row_lse), 0.0, row_lse)
            keep = q_len - (min(q_len, 16) if b == skipped else 0)
            out[o0:o0 + keep] = o.transpose(0, 1)[:keep].to(dtype)
            lse[:, o0:o0 + q_len] = row_lse
            stats[0, :, o0:o0 + q_len], stats[1, :, o0:o0 + q_len] = m, l_sum
        if self.bug == "tail_block_overrun":
            store_past_end(out, -rows % BLOCK_N)
        return out, lse, (stats,)

    # Backward ---------------------------------------------------------------------------------------------
    def backward(self, dout, q, k, v, out, lse, residuals, problem: Problem):
        (stats,) = residuals
        dtype, device = q.dtype, q.device
        dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=device)
        seen = torch.zeros(k.shape[0], dtype=torch.bool, device=device)
        scale = problem.sm_scale
        for b, q_len, kv_len in self._sequences(problem):
            q0, o0, k0 = (int(x[b]) for x in (problem.q_offsets_host, problem.out_offsets_host,
                                               problem.kv_offsets_host))
            qs = q[q0:q0 + q_len].float().transpose(0, 1)
            ks, vs, rows = self._keys(k, v, problem, b, kv_len)
            do = dout[o0:o0 + q_len].float().transpose(0, 1)
            o = out[o0:o0 + q_len].float().transpose(0, 1)
            m, l_sum = stats[0, :, o0:o0 + q_len], stats[1, :, o0:o0 + q_len]
            mask = self._mask(problem, q_len, kv_len, ks.shape[1], device,
                              top_left=self.bug == "causal_top_left_backward")
            s = ((qs @ ks.transpose(1, 2)) * scale).masked_fill(~mask, -math.inf)
            if self.bug == "lse_fp32_recompute":
                row_lse = (m + torch.log(l_sum)).unsqueeze(-1)
                p = torch.where(mask, torch.exp(s - torch.where(torch.isinf(row_lse), 0.0, row_lse)), 0.0)
            else:
                m_safe = torch.where(torch.isinf(m), 0.0, m).unsqueeze(-1)
                p = torch.where(mask, torch.exp(s - m_safe), 0.0) / l_sum.clamp_min(1e-30).unsqueeze(-1)
            delta = (do * _round(o, dtype)).sum(-1, keepdim=True)
            ds = _round(p * (do @ vs.transpose(1, 2) - delta), dtype)
            dq_keys = ks
            if self.bug == "dq_first_segment_only":
                dq_keys = self._keys(k, v, problem, b, kv_len, first_sequence=True)[0]
            dq_seq = self._dq(ds, dq_keys, problem)
            if problem.broadcast_q:
                if self.bug == "broadcast_dq_not_summed":
                    dq[q0:q0 + q_len] = dq_seq.transpose(0, 1)
                else:
                    dq[q0:q0 + q_len] += dq_seq.transpose(0, 1)
            else:
                dq[q0:q0 + q_len] = dq_seq.transpose(0, 1)
            dk_heads = ds.transpose(1, 2) @ qs
            dv_heads = _round(p, dtype).transpose(1, 2) @ do
            group = problem.group_size
            for h in range(problem.q_heads):
                kv_head = h % problem.kv_heads if self.bug == "gqa_head_map" else h // group
                valid = rows[: kv_len] if kv_len else rows[:0]
                dk[valid, kv_head] += dk_heads[h, :kv_len]
                dv[valid, kv_head] += dv_heads[h, :kv_len]
            seen[k0:k0 + kv_len] |= mask[:, :kv_len].any(0)
        if self.bug == "saved_stats_overwritten":
            stats.data[1].reciprocal_()  # through .data: autograd's version counter, like a kernel's write, misses it
        if self.bug == "unwritten_grad_rows":
            # Only rows some query saw are written into a torch.empty result.
            dk = torch.empty_like(dk).index_copy_(0, seen.nonzero().flatten(), dk[seen])
            dv = torch.empty_like(dv).index_copy_(0, seen.nonzero().flatten(), dv[seen])
        return (dq * scale).to(dtype), (dk * scale).to(dtype), dv.to(dtype)

    def _dq(self, ds, ks, problem: Problem):
        """dS K summed over key blocks; in a shuffled (run-dependent) order for nondeterministic_dq."""
        block_n = self.active["BLOCK_N"]
        blocks = list(range(0, ks.shape[1], block_n))
        if self.bug == "ordered_dq_path" and problem.deterministic:
            blocks = blocks[:-1]
        if self.bug == "nondeterministic_dq":
            blocks = [blocks[i] for i in torch.randperm(len(blocks)).tolist()]
        total = torch.zeros(ds.shape[0], ds.shape[1], ks.shape[2], device=ds.device)
        for j0 in blocks:
            total = total + ds[:, :, j0:j0 + block_n] @ ks[:, j0:j0 + block_n]
        return total


EMULATOR = Emulator()
jfa.register_backend(EMULATOR.name, EMULATOR)
for _bug in BUG_NAMES:
    jfa.register_backend(f"planted-{_bug}", Emulator(_bug))


def _callable(name: str):
    def attention(*args, **kwargs):
        return jfa.attention(*args, backend=name, **kwargs)

    attention.__name__ = name
    return attention


emulator = _callable("emulator")
globals().update({bug: _callable(f"planted-{bug}") for bug in BUG_NAMES})

# Per kv offsets tensor object (by id, dropped when the tensor is freed, so a new tensor never inherits it).
_BY_BUFFER: dict = {}


def offsets_cached_by_address(q, k, v, q_offsets, kv_offsets, **kwargs):
    """The clean emulator behind host state kept per offsets buffer: the offsets the buffers held at their
    first call are used for every later call on them."""
    key = id(kv_offsets)
    if key not in _BY_BUFFER:
        _BY_BUFFER[key] = (None if q_offsets is None else q_offsets.clone(), kv_offsets.clone())
        weakref.finalize(kv_offsets, _BY_BUFFER.pop, key, None)
    return jfa.attention(q, k, v, *_BY_BUFFER[key], backend="emulator", **kwargs)


def _entry_past_end(offsets: torch.Tensor) -> int | None:
    """The entry just past offsets' last one, as a kernel reading one more gets it, where their allocation holds
    one (past an allocation a kernel reads whatever memory follows, which an emulator cannot do safely)."""
    storage, size = allocation_bytes(offsets), offsets.element_size()
    start = (offsets.storage_offset() + offsets.shape[0]) * size
    if start + size > storage.numel():
        return None
    return int(storage[start:start + size].view(offsets.dtype)[0])


def phantom_tail_sequence(q, k, v, q_offsets, kv_offsets, **kwargs):
    """The clean emulator, then the tile past the last sequence (flash-attention PR #2333): its end is the q
    offsets' entry past their last one, and its output rows, from offsets[-1] to there, are stored past out's
    end (zeros: what they hold does not matter, where they land does)."""
    result = jfa.attention(q, k, v, q_offsets, kv_offsets, backend="emulator", **kwargs)
    past = None if q_offsets is None else _entry_past_end(q_offsets)
    if past is not None and past > int(q_offsets[-1]):
        store_past_end(result[0] if isinstance(result, tuple) else result, past - int(q_offsets[-1]))
    return result

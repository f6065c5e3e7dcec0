"""Whether the GPU's bf16 MMA gives a row the same bits wherever its products sit along the summed dimension
(a GPU probe; docs/performance-log.md, 2026-12-05, says what it found on the H200 and why it matters):

    python scripts/mma_position_probe.py [DRAWS]

Triton's `tl.dot` of a [64, 64] bf16 P by a [64, 128] bf16 V with fp32 accumulation, 4 warps: the packed
forward's P·V. Row r of P has nonzeros only in keys [off, off + L); every other key's V row holds unrelated
values (another sequence's, at weight exactly 0). Each draw compares every row's result with the same products at
keys [0, L), bit for bit. Packed slots shorter than the MMA's 16-key step keep a sequence's bits whatever its
neighbours only if the within-step cases print all equal; packing sequences back to back needs the spanning ones
too (a sequence's keys split over two steps). On the H200 (2026-12-05) the first were all equal and the second
equal in no draw: hence `jfa.tile_scheduler.PACK_ALIGN` 8.
"""

import sys

import torch
import triton
import triton.language as tl

BLOCK, DIM = 64, 128
WITHIN_STEP = ((16, (16, 32, 48)), (8, (8, 16, 24, 40, 56)), (4, (4, 8, 12, 20)), (2, (2, 6, 14)), (12, (4, 20)),
               (3, (1, 5, 13)))
SPANNING_STEPS = ((12, (8, 10)), (16, (8, 4)), (6, (13, 29)))  # H200 2026-12-05: equal in no draw


@triton.jit
def _pv_kernel(P, V, Out, BLOCK: tl.constexpr, DIM: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, DIM)
    p = tl.load(P + rows[:, None] * BLOCK + rows[None, :])
    v = tl.load(V + rows[:, None] * DIM + cols[None, :])
    tl.store(Out + rows[:, None] * DIM + cols[None, :], tl.dot(p, v))


def products_at(start: int, probs: torch.Tensor, v_rows: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """P·V with each row's probabilities `probs` at keys [start, start + L) and `v_rows` there."""
    length = probs.shape[1]
    p = torch.zeros(BLOCK, BLOCK, device="cuda", dtype=torch.bfloat16)
    p[:, start:start + length] = probs
    v = (torch.randn(BLOCK, DIM, generator=gen, device="cuda") * 100).to(torch.bfloat16)  # the neighbours'
    v[start:start + length] = v_rows
    out = torch.empty(BLOCK, DIM, device="cuda", dtype=torch.float32)
    _pv_kernel[(1,)](p, v, out, BLOCK=BLOCK, DIM=DIM, num_warps=4)
    return out


def main() -> None:
    draws = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    gen = torch.Generator(device="cuda").manual_seed(0)
    for title, cases in (("within one 16-key step", WITHIN_STEP), ("spanning two steps", SPANNING_STEPS)):
        print(title)
        for length, offsets in cases:
            for off in offsets:
                equal, worst = 0, 0.0
                for _ in range(draws):
                    probs = torch.rand(BLOCK, length, generator=gen, device="cuda").to(torch.bfloat16)
                    v_rows = (torch.randn(length, DIM, generator=gen, device="cuda") * 4).to(torch.bfloat16)
                    at_zero = products_at(0, probs, v_rows, gen)
                    moved = products_at(off, probs, v_rows, gen)
                    equal += torch.equal(at_zero, moved)
                    worst = max(worst, (at_zero - moved).abs().max().item())
                print(f"  length {length:2d} offset {off:2d}: {equal}/{draws} draws bitwise equal, "
                      f"max |diff| {worst:.3g}")


if __name__ == "__main__":
    main()

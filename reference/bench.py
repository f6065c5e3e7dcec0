"""Peak memory and time of the float64 reference on one long sequence (the sizing claim of the README).

    python -m reference.bench --tokens 65536 --heads 8 --head-dim 128 [--backward] [--device cpu]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from jfa.validation import validate
from reference.exact import reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    shape = (args.tokens, args.heads, args.head_dim)
    q, k, v, dout = (torch.randn(shape, generator=gen).bfloat16().to(args.device) for _ in range(4))
    offsets = torch.tensor([0, args.tokens], dtype=torch.int32, device=args.device)
    problem = validate(q, k, v, offsets, offsets, max_q_len=None, max_kv_len=None, sm_scale=None, window=None,
                       causal=False, broadcast_q=False, deterministic=False)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    reference(q, k, v, problem, dout if args.backward else None)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        peak = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB GPU"
    else:
        peak = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB RSS (inputs {before / 2**20:.2f})"
    print(f"reference {'forward+backward' if args.backward else 'forward'} {args.tokens} tokens x {args.heads} heads "
          f"x D {args.head_dim} on {args.device}: {time.perf_counter() - start:.1f} s, peak {peak}")


if __name__ == "__main__":
    main()

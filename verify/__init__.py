"""verify: the numerics suite for jagged attention kernels (reference comparison, bf16 error-bound
statistics, invariants) plus its gate, bisect and report commands."""

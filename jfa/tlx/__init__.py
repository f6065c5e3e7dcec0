"""TLX (Triton Low-level Extensions, the `fbtriton` package) kernels of jfa for Hopper, and their host side.

The backend registers as "tlx" (`jfa.tlx.backend:BACKEND`). Nothing here imports fbtriton until a kernel is
compiled or launched: `forward.py` (the kernel) is imported lazily by `backend.py`. `python -m
jfa.tlx.compile_check` compiles every kernel configuration for sm_90 without a GPU; `python -m
jfa.tlx.gpu_selftest` checks and times the kernel on an H100/H200.
"""

"""Portable Triton kernels of jfa (forward.py, backward.py) and their host side (backend.py).

The backend registers as "triton" (`jfa.triton.backend:BACKEND`). On the CPU it runs under the Triton
interpreter, which must be switched on before triton is first imported: `TRITON_INTERPRET=1`.
"""

"""The unit tests run the Triton kernels on the CPU under the interpreter, which triton chooses when it
decorates a function: set it before anything imports triton (importing torch does not)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

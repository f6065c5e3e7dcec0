"""The unit tests run the Triton kernels on the CPU under the interpreter, which triton chooses when it
decorates a function: set it before anything imports triton (importing torch does not). Importing verify
pins MKL's CPU arithmetic (verify/__init__) before any test's first matmul, so that the tests comparing with
the committed CPU baseline compute as the suite that recorded it."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import verify  # noqa: E402,F401

"""jfa: jagged flash attention kernels and the op that dispatches to them."""

from jfa.backends import names as backend_names
from jfa.backends import register as register_backend
from jfa.interface import attention
from jfa.problem import Problem

__all__ = ["attention", "backend_names", "register_backend", "Problem"]

"""Running the Triton kernels under TRITON_INTERPRET=1 at a cost CI can afford.

The interpreter patches `triton.language` for the launched kernel, and patches it again on every call of a
`@triton.jit` helper inside it (`_patch_lang` in `InterpretedFunction.__call__`, triton 3.x): a full
`inspect.getmembers` walk of the language modules, about 1 ms, for each call of `visible`, `online_update`,
`mma`, ... in every block iteration. Inside a running kernel the modules a helper sees are usually patched
already, and a nested patch is never restored, so repeating it only costs time: on the ci profile it was
40% of the interpreter's time. `skip_nested_language_patching` skips a nested call's patching when every
language module the helper sees was patched during this launch; anything else (a launch, a helper that sees
a module not yet patched) goes through triton's own function as before.

The interpreter also recomputes every int32 add, sub and mul in int64 and compares it with the int32 range
(`sanitize_overflow`), a third of its time on the verify suite, and then discards the comparison: it only
asserts with `debug=True`, and the interpreter's options are fixed at their defaults (debug off). So the
check never fires here; `skip_overflow_arithmetic` turns the arithmetic off. (Sizes whose offsets could
overflow int32, FAILURES.md's > 2^31-element tensors, are beyond the interpreter anyway; the GPU's
nightly profile runs them.)
"""

from __future__ import annotations

import dataclasses


def skip_nested_language_patching() -> bool:
    """Installs the fast path once; False (and nothing changed) when this triton has no such hook."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_class = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_class is None:
        return False
    if getattr(patch_lang, "jfa_nested_skip", False):
        return True
    language_modules = (tl, tl.core)
    patched: list[object] = []  # the language modules patched by the running launch

    seen: dict[tuple[int, int], frozenset[int]] = {}  # (module globals, their count) -> language modules

    def visible_languages(fn) -> frozenset[int]:
        # Walking a module's globals on every helper call was 7% of the interpreter's time; a module's
        # globals only grow, and their count keys the cached answer.
        key = (id(fn.__globals__), len(fn.__globals__))
        if key not in seen:
            seen[key] = frozenset(id(value) for value in fn.__globals__.values()
                                  if any(value is m for m in language_modules))
        return seen[key]

    def patch_lang_once(fn):
        if patched and visible_languages(fn) <= set(patched):
            return scope_class()
        scope = patch_lang(fn)
        if patched:  # a helper that sees a module the launch did not (tl.core from triton.language.standard)
            patched.extend(visible_languages(fn))
            return scope
        restore = scope.restore

        def restore_and_close() -> None:
            patched.clear()
            restore()

        scope.restore = restore_and_close
        patched.extend(visible_languages(fn))
        return scope

    patch_lang_once.jfa_nested_skip = True
    interpreter._patch_lang = patch_lang_once
    return True


def skip_overflow_arithmetic() -> bool:
    """Turns the interpreter's int32 overflow arithmetic off; False (and nothing changed) when this triton
    has no such option or runs its interpreter with debug on (where the check would assert)."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not hasattr(options, "sanitize_overflow") or getattr(options, "debug", True):
        return False
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True

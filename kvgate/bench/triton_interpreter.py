"""Triton 3.6's CPU interpreter under numpy >= 2.5 (the GPU image's pair): a scalar inside a kernel is a 1-element
array there, and the interpreter turns it into a Python int with int(array), which numpy 2.5 refuses ("only
0-dimensional arrays can be converted to Python scalars"), so every `range(lo, hi)` over loaded bounds fails:
25 kernel tests, all in the interpreter (later Triton squeezes the array first). Not a kernel fault: compiled
kernels never take this path. `squeeze_scalar_index` gives the interpreter that later conversion; it does nothing
where numpy still converts 1-element arrays or the interpreter is absent."""
from __future__ import annotations


def squeeze_scalar_index() -> bool:
    """True when the interpreter needed the later conversion and now has it."""
    import numpy as np

    try:
        int(np.ones(1, dtype=np.int32))
        return False
    except TypeError:
        pass
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch = interpreter._patch_lang_tensor
    if getattr(patch, "squeezes_scalars", False):
        return True

    def patch_lang_tensor(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
    patch_lang_tensor.squeezes_scalars = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True

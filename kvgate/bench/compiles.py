"""What a timed round must not do (issue 41): compile a Triton kernel or grow the allocator. `RoundWatch` counts both
for one round of `kvgate bench engine`.

Compiles are counted over every Triton kernel in kvgate.kernels: compiled, by the entries of each kernel's own
in-memory cache (one per variant Triton built or loaded from its disk cache); under TRITON_INTERPRET, where nothing
is compiled and nothing cached, by the key a compiled run would specialise each launch on, by Triton's rule - every
constexpr and launch option's value, each tensor's dtype and whether its address is 16-byte aligned, and for each
integer not in `do_not_specialize` whether it is 1 and whether it divides by 16 - so a CPU test sees the variants a GPU
round would compile. Both count a variant once per process: a later round that launches nothing new counts 0.

Allocator growth is CUDA's reserved memory at the round's end less at its start, and its peak above the start (0 on
a CPU, which has no caching allocator to grow)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections import Counter
from dataclasses import dataclass, field

_seen: set[tuple] = set()  # the variants launched in this process (the interpreter's stand-in for Triton's cache)
_hooked: dict[str, object] = {}  # qualified kernel name -> kernel


def kernel_modules() -> list[str]:
    import kvgate.kernels as package

    return [f"kvgate.kernels.{m.name}" for m in pkgutil.iter_modules(package.__path__)]


def launched_kernels() -> dict[str, object]:
    """Every Triton kernel (compiled or interpreted) defined in kvgate.kernels, hooked once; a module that does not
    import here (no Triton) has none."""
    try:
        from triton.runtime.jit import JITFunction
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return {}
    for name in kernel_modules():
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a kernel module that cannot load has no kernel to count
            continue
        for attr, value in vars(module).items():
            qualified = f"{name.rsplit('.', 1)[1]}.{attr}"
            if isinstance(value, (JITFunction, InterpretedFunction)) and qualified not in _hooked:
                hook(value, qualified)
    return _hooked


def hook(kernel, name: str) -> None:
    """Keep `kernel` to read its cache; an interpreted one (no cache) gets its `run` (what `kernel[grid](...)` calls)
    wrapped to note the variant each launch needs. A compiled launch is left alone: a key per launch would cost the
    timed round tens of microseconds of host time each."""
    _hooked[name] = kernel
    if hasattr(kernel, "device_caches"):
        return
    run, fn = kernel.run, getattr(kernel, "fn", kernel)
    params = list(inspect.signature(fn).parameters)
    annotations = getattr(fn, "__annotations__", {})
    constexpr = {p for p in params if "constexpr" in str(annotations.get(p, ""))}
    kwargs = getattr(kernel, "kwargs", {})  # an InterpretedFunction keeps the decorator's arguments here
    unspecialised = set(getattr(kernel, "do_not_specialize", None) or kwargs.get("do_not_specialize") or ())
    unspecialised = {params[p] if isinstance(p, int) else p for p in unspecialised}

    def noted_run(*args, **kw):
        _seen.add((name, *variant_key(params, constexpr, unspecialised, args, kw)))
        return run(*args, **kw)
    kernel.run = noted_run


def variant_key(params: list[str], constexpr: set[str], unspecialised: set[str], args: tuple, kw: dict) -> tuple:
    values = dict(zip(params, args)) | {k: v for k, v in kw.items() if k in params}
    options = tuple(sorted((k, repr(v)) for k, v in kw.items() if k not in params and k not in ("grid", "warmup")))
    return (*(specialisation(values.get(p), p in constexpr, p in unspecialised) for p in params), options)


def specialisation(value, is_constexpr: bool, unspecialised: bool):
    if is_constexpr or value is None or isinstance(value, (bool, str)):
        return repr(value)
    if hasattr(value, "data_ptr"):
        return (str(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, int):
        wide = not -2**31 <= value < 2**31
        return ("int", wide) if unspecialised else ("int", wide, value == 1, value % 16 == 0)
    return type(value).__name__


def cached_variants() -> int | None:
    """Entries in the compiled kernels' in-memory caches; None under the interpreter (it keeps none)."""
    total, found = 0, False
    for kernel in _hooked.values():
        for cache in getattr(kernel, "device_caches", {}).values():
            total, found = total + len(cache[0]), True
    return total if found else None


@dataclass(slots=True)
class RoundWatch:
    """Start it just before a timed round and `stop` it just after: the round's new Triton variants (by kernel) and
    its allocator growth."""
    device: object
    variants: set = field(default_factory=set)
    cached: int | None = None
    reserved: int = 0

    def __post_init__(self) -> None:
        launched_kernels()
        self.variants, self.cached = set(_seen), cached_variants()
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.reserved = torch.cuda.memory_reserved(self.device)

    def stop(self) -> dict:
        new = _seen - self.variants
        cached = cached_variants()
        compiled = cached - self.cached if cached is not None and self.cached is not None else None
        found = {"triton_compiles": compiled if compiled is not None else len(new),
                 "compiles_counted_by": "triton's kernel cache" if compiled is not None
                 else "specialisation keys (interpreter)",
                 "new_variants_by_kernel": dict(Counter(v[0] for v in new))}
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
            found["allocator_growth_bytes"] = torch.cuda.memory_reserved(self.device) - self.reserved
            found["allocator_peak_growth_bytes"] = torch.cuda.max_memory_reserved(self.device) - self.reserved
        else:
            found["allocator_growth_bytes"] = 0
        return found

"""Where Triton kernels can run: lazy imports, availability checks and the reasons they fail.

Nothing here imports Triton at module import time, so ``import floatxq`` works on a machine
without Triton or CUDA. Kernels ask :func:`import_triton` for the modules when they are first
launched; dispatchers ask :func:`triton_unavailable_reason` which fast path a tensor may take.
"""

import contextlib
import functools
import importlib
import math
import operator
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "BoundLaunch",
    "CachedLauncher",
    "call_key",
    "capability_shortfall",
    "cuda_capability",
    "dependent_launches",
    "import_kernel_sources",
    "import_triton",
    "launch_device",
    "new_output",
    "on_rows",
    "require_kernel_device",
    "triton_available",
    "triton_interpret_enabled",
    "triton_unavailable_reason",
]


@functools.cache
def _import_error() -> str | None:
    try:
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising at import
        return f"{type(exc).__name__}: {exc}"
    return None


def triton_available() -> bool:
    """Whether ``import triton`` works in this environment (it is imported once, then cached).

    Numerics: none; an environment check.
    """
    return _import_error() is None


def triton_interpret_enabled() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set: kernels then run on CPU tensors (slowly, for tests).

    Numerics: none; an environment check.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def import_triton(*, where: str) -> tuple[ModuleType, ModuleType]:
    """``(triton, triton.language)``, or a ``RuntimeError`` naming what is missing.

    Args:
      where: the caller's name, used in the error message.

    Raises:
      RuntimeError: Triton is not installed or does not import.

    Numerics: none.
    """
    error = _import_error()
    if error is not None:
        raise RuntimeError(
            f"{where}: needs Triton, which does not import here ({error}); install it "
            f"(pip install 'floatxq[triton]', or a CUDA build of PyTorch that ships it) or use "
            f"the pure floatxq function instead"
        )
    import triton
    import triton.language as tl

    return triton, tl


def import_kernel_sources(module: str, *, interpret: bool, where: str) -> ModuleType:
    """Import a module of jitted Triton sources (``floatxq.kernels._*_jit``) on first use.

    Such a module imports Triton and decorates its kernels at import, and ``triton.jit`` picks
    the compiler or the interpreter right then (from ``TRITON_INTERPRET``); the module records
    which in ``INTERPRETED``.

    Args:
      module: the module's full name.
      interpret: the mode the caller launches in (``triton_interpret_enabled()``).
      where: the caller's name, used in error messages.

    Raises:
      RuntimeError: Triton does not import, or the kernels were jitted in the other mode
        (``TRITON_INTERPRET`` changed after the first launch).

    Numerics: none.
    """
    import_triton(where=where)
    sources = importlib.import_module(module)
    if sources.INTERPRETED != interpret:
        raise RuntimeError(
            f"{where}: the Triton kernels were jitted with TRITON_INTERPRET="
            f"{int(sources.INTERPRETED)}; set TRITON_INTERPRET before the first kernel launch "
            f"and keep it for the life of the process"
        )
    return sources


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why a Triton kernel cannot run on tensors of ``device`` here, or ``None`` when it can.

    Args:
      device: the device of the tensors the kernel would read.

    Returns:
      ``None`` when Triton imports and ``device`` is CUDA (or any device under
      ``TRITON_INTERPRET=1``); otherwise a one-line reason naming the missing piece.

    Numerics: none; an environment check.
    """
    error = _import_error()
    if error is not None:
        return f"Triton is not importable ({error})"
    if triton_interpret_enabled():
        return None
    if device.type != "cuda":
        return (
            f"the tensor is on {device}; Triton kernels need a CUDA tensor (TRITON_INTERPRET=1 "
            f"runs them on CPU for testing)"
        )
    if not torch.cuda.is_available():
        return "torch.cuda is not available"
    return None


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA ``device`` (its index, or the current device).

    Numerics: none; an environment query.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)


def dependent_launches(device: torch.device) -> bool:
    """Whether a kernel on ``device`` may be launched programmatically dependent on the one
    before it (CUDA SM 9.0+, not interpreted): it starts as that one signals, and waits for it
    to end (``griddepcontrol.wait``) before reading what it wrote.

    Numerics: none; an environment check.
    """
    if device.type != "cuda" or triton_interpret_enabled():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _hopper_or_newer(index)


@functools.cache
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def capability_shortfall(
    device: torch.device, minimum: tuple[int, int], *, need: str
) -> str | None:
    """Why a CUDA ``device`` is too old for a kernel that needs SM ``minimum`` (``need`` says
    what for), or ``None`` when it is new enough.

    Numerics: none; an environment check.
    """
    cap = cuda_capability(device)
    if cap >= minimum:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"CUDA device {index} is SM {cap[0]}.{cap[1]} < {minimum[0]}.{minimum[1]}: {need}"


def require_kernel_device(
    tensors: tuple[torch.Tensor, ...],
    *,
    where: str,
    reason: Any = None,
) -> torch.device:
    """The one device of ``tensors``, where a kernel can run on it (else an exception).

    Args:
      tensors: the kernel's tensor arguments.
      where: the caller's name, used in error messages.
      reason: ``device -> str | None``, why the kernel cannot run there (default
        :func:`triton_unavailable_reason`).

    Raises:
      TypeError: tensors on several devices, or on a device no kernel runs on (CPU without
        ``TRITON_INTERPRET=1``).
      RuntimeError: Triton missing, or a GPU the kernel does not support.

    Numerics: none.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        got = sorted(map(str, devices))
        raise TypeError(f"{where}: every tensor must be on one device, got {got}")
    device = devices.pop()
    why = (reason or triton_unavailable_reason)(device)
    if why is not None:
        if device.type != "cuda" and _import_error() is None:
            raise TypeError(f"{where}: {why}")
        raise RuntimeError(f"{where}: {why}")
    return device


class CachedLauncher:
    """Launches of one jitted kernel whose Triton-side argument binding is done once per key.

    ``kernel[grid](*args)`` binds, specializes and hashes every argument on each call: host work
    that grows with the argument count (thirty here) and can exceed the GPU time of a
    decode-sized launch (measured, see benchmarks/RESULTS.md). The caller names each launch
    with a ``key`` that fixes every non-tensor argument, every tensor argument's dtype and
    16-byte alignment (exactly what Triton specializes a compiled kernel on) and the launch
    options; the first launch of a key goes through the JIT and keeps the compiled kernel,
    later ones call its launcher directly with the same arguments in the same order (all
    positional, constexprs included) on the given device's current stream. While Triton launch
    hooks are registered (a profiler), every launch takes Triton's own path, which calls them.

    A key that misses a compile-time argument would hand one compiled kernel to launches that
    need different ones (wrong results, no error). So each kept launch remembers its
    constexpr arguments, and a later launch of the key whose constexprs differ raises a
    ``RuntimeError`` naming them (a bug at the call site) instead of running.

    Under ``TRITON_INTERPRET=1`` every launch goes through the interpreter (nothing is kept).
    """

    __slots__ = ("_compiled", "_jit", "_knobs")

    def __init__(self, jit_fn: Any) -> None:
        self._jit = jit_fn
        self._compiled: dict[Any, tuple[Any, ...]] = {}
        self._knobs: Any = None

    def _constexpr_getter(self, count: int) -> Any:
        """``args -> the values at the kernel's constexpr parameters`` among the first
        ``count`` (one C-level item lookup per launch)."""
        params = getattr(self._jit, "params", ())[:count]
        positions = [i for i, p in enumerate(params) if p.is_constexpr]
        if not positions:
            return lambda args: ()
        getter = operator.itemgetter(*positions)
        return getter if len(positions) > 1 else lambda args: (getter(args),)

    def __call__(
        self,
        key: Any,
        grid: tuple[int, int, int],
        args: tuple[Any, ...],
        options: dict[str, Any],
        device_index: int,
    ) -> Any:
        """Launch on ``grid`` with ``args`` (and launch ``options`` such as ``num_warps``) on
        CUDA device ``device_index`` (the current device); returns the compiled kernel (None
        when interpreted)."""
        entry = self._compiled.get(key)
        if entry is not None:
            compiled, run, function, metadata, getter, count, kept = entry
            if len(args) != count or getter(args) != kept:
                now = getter(args) if len(args) == count else f"{len(args)} arguments"
                raise RuntimeError(
                    f"CachedLauncher({getattr(self._jit, '__name__', self._jit)}): launch key "
                    f"{key!r} was kept with constexprs {kept!r} ({count} arguments) and is now "
                    f"launched with {now!r}; the key must name every compile-time argument"
                )
            knobs = self._knobs
            if _hooked(knobs.launch_enter_hook) or _hooked(knobs.launch_exit_hook):
                compiled[grid](*args)
            else:
                stream = torch._C._cuda_getCurrentRawStream(device_index)
                run(*grid, stream, function, metadata, None, None, None, *args)
            return compiled
        compiled = self._jit[grid](*args, **options)
        try:
            run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
            from triton import knobs

            self._knobs = knobs.runtime
            if function is not None:
                getter = self._constexpr_getter(len(args))
                self._compiled[key] = (
                    compiled,
                    run,
                    function,
                    metadata,
                    getter,
                    len(args),
                    getter(args),
                )
        except (AttributeError, ImportError):  # the interpreter, or another Triton: no shortcut
            pass
        return compiled

    def bind(self, key: Any, grid: tuple[int, int, int], device_index: int) -> "BoundLaunch | None":
        """The kept launch of ``key`` on ``grid`` and CUDA device ``device_index``, to be called
        with its arguments alone (:class:`BoundLaunch`); None before its first launch, when
        none is kept (the interpreter) and during CUDA graph capture (what a call allocates
        there belongs to the graph: it is bound on a later call outside)."""
        entry = self._compiled.get(key)
        if entry is None or (
            torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        ):
            return None
        return BoundLaunch(entry[:4], grid, device_index, self._knobs)

    def __len__(self) -> int:
        """How many compiled launches are kept."""
        return len(self._compiled)

    def compiled(self) -> list[Any]:
        """The compiled kernels of the kept launches, oldest first (``.asm`` holds their PTX)."""
        return [entry[0] for entry in self._compiled.values()]


class BoundLaunch:
    """One kept compiled launch with its grid and device fixed (:meth:`CachedLauncher.bind`):
    a call passes the arguments, in :class:`CachedLauncher`'s order, straight to the driver's
    launcher on the device's current stream. A module that holds one per input shape pays for
    its key, its checks and its plan once, not per call. The device is made current for the
    launch when it is not; launch hooks, while registered, take Triton's own path."""

    __slots__ = ("_entry", "_grid", "_index", "_knobs")

    def __init__(
        self, entry: tuple[Any, Any, Any, Any], grid: tuple[int, int, int], index: int, knobs: Any
    ) -> None:
        self._entry, self._grid, self._index, self._knobs = entry, grid, index, knobs

    def __call__(self, *args: Any) -> None:
        compiled, run, function, metadata = self._entry
        knobs, index = self._knobs, self._index
        if torch._C._cuda_getDevice() != index:
            with torch.cuda.device(index):
                self(*args)
        elif _hooked(knobs.launch_enter_hook) or _hooked(knobs.launch_exit_hook):
            compiled[self._grid](*args)
        else:
            stream = torch._C._cuda_getCurrentRawStream(index)
            run(*self._grid, stream, function, metadata, None, None, None, *args)


def _hooked(hook: Any) -> bool:
    """Whether a Triton launch hook (a ``HookChain``, a function or None) would call anything."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch_device(device: torch.device) -> tuple[contextlib.AbstractContextManager[Any], int]:
    """``(context, index)`` to launch a kernel on ``device``'s tensors: the CUDA device made
    current when it is not already (and its index), or a no-op and -1 for CPU tensors (the
    interpreter).

    Numerics: none.
    """
    if device.type != "cuda":
        return contextlib.nullcontext(), -1
    index = torch.cuda.current_device()
    if device.index is None or device.index == index:
        return contextlib.nullcontext(), index
    return torch.cuda.device(device), device.index


def new_output(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, bias: torch.Tensor | None
) -> tuple[torch.Tensor, bool]:
    """``(out, done)`` of a GEMM launch: a fresh ``(m, n)`` output in ``dtype``, and whether it
    is already the result (no rows or columns: left empty; ``k == 0``: the bias broadcast over
    the rows, else zeros), so that nothing is launched.

    Numerics: the bias rounded once to ``dtype``.
    """
    out = torch.empty((m, n), dtype=dtype, device=device)
    if m == 0 or n == 0:
        return out, True
    if k == 0:
        return (out.copy_(bias.to(dtype).expand(m, n)) if bias is not None else out.zero_()), True
    return out, False


def call_key(x: torch.Tensor) -> tuple[Any, ...]:
    """What a launch bound for ``x`` is specialized on: shape, dtype, device, strides and
    16-byte alignment (a module keeps its bound calls under this key).

    Numerics: none.
    """
    return (x.shape, x.dtype, x.device, x.stride(), x.data_ptr() % 16 == 0)


def on_rows(
    call: Callable[[torch.Tensor], torch.Tensor] | None, x: torch.Tensor, n: int
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``call`` (over ``(rows, in)``, bound for ``x`` flattened) for tensors like ``x``
    ``(*, in)``, returning ``(*, n)``; None where ``call`` is or where ``x`` flattens only by a
    copy (a non-contiguous ``x`` of more than two axes).

    Numerics: none.
    """
    if call is None or x.ndim == 2:
        return call
    if not x.is_contiguous():
        return None
    rows, shape = (math.prod(x.shape[:-1]), x.shape[-1]), (*x.shape[:-1], n)
    return lambda t: call(t.view(rows)).view(shape)

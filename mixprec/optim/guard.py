"""Compiled kernels that are checked before they are trusted (the compiled fp32-master step,
:mod:`.kernels`).

What inductor makes of a function depends on the torch version, the device and the dtypes (one
torch release compiled a Kahan AdamW step into a kernel that applied -4.73 times the intended
update while its eager twin was right). So the first time a :class:`GuardedKernel` is called
for a given (device, argument dtypes) in a process, the compiled kernel and the eager function
step copies of a small slice of the real arguments (at most :data:`PROBE_ELEMENTS` elements of
each element-wise tensor), and the results are compared: integer tensors bit for bit; floating
ones to within 1% of how far the eager step moved them plus two ulps of their dtype (the
compiled kernel may fuse a multiply-add). On a mismatch the kernel falls back to eager for that
signature, with one :class:`CompiledKernelWarning` naming the kernel, the device, the dtypes and
torch's version. The verdicts are cached for the process; what was compiled and how long it
took is logged once (logger ``"mixprec"``; a warning when it took a second or more).

Compiling makes torch emit its own ``torch.jit.script_method`` ``DeprecationWarning`` (from
inductor's internals): :func:`quiet_compile` silences exactly that message around our compiled
calls, so ``-W error::DeprecationWarning`` users are not broken by torch's internals.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator

import torch

__all__ = ["GuardedKernel", "CompiledKernelWarning", "quiet_compile", "PROBE_ELEMENTS",
           "verdicts", "forget_verdicts"]

_LOG = logging.getLogger("mixprec")
#: A compile that took this many seconds or more is logged as a warning (else as info).
SLOW_COMPILE_S = 1.0
#: At most this many elements of each element-wise argument are stepped by the check.
PROBE_ELEMENTS = 256
_TORCH_DEPRECATION = r"`torch\.jit\.script_method` is deprecated"
# (kernel name, device, argument dtypes) -> True (the compiled kernel is trusted) or False
_VERDICTS: dict[tuple, bool] = {}


class CompiledKernelWarning(RuntimeWarning):
    """A compiled kernel disagreed with its eager twin; the eager one runs instead."""


@contextlib.contextmanager
def quiet_compile() -> Iterator[None]:
    """Silence torch's own ``torch.jit.script_method`` DeprecationWarning (emitted by its
    compiler's internals), and nothing else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TORCH_DEPRECATION,
                                category=DeprecationWarning)
        yield


def verdicts() -> dict[tuple, bool]:
    """The checks made so far in this process: (kernel, device, dtypes) -> trusted (a copy)."""
    return dict(_VERDICTS)


def forget_verdicts() -> None:
    """Forget every check (the next call of each kernel checks again)."""
    _VERDICTS.clear()


def _signature(name: str, args: tuple) -> tuple:
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    return (name, str(device), tuple(a.dtype if isinstance(a, torch.Tensor) else type(a).__name__
                                     for a in args))


def _probe(args: tuple) -> list:
    """Copies of the arguments, the element-wise tensors (as long as the first tensor) cut to
    their first :data:`PROBE_ELEMENTS` elements."""
    n0 = next(a for a in args if isinstance(a, torch.Tensor)).numel()

    def probe(a: torch.Tensor) -> torch.Tensor:
        if a.dim() and a.numel() == n0 > PROBE_ELEMENTS:
            return a.detach().reshape(-1)[:PROBE_ELEMENTS].clone()
        return a.detach().clone()
    return [probe(a) if isinstance(a, torch.Tensor) else a for a in args]


def _ulp(t: torch.Tensor) -> torch.Tensor:
    eps = torch.finfo(t.dtype).eps
    tiny = torch.finfo(t.dtype).tiny
    return t.abs().float() * eps + tiny


def _disagreement(before: list, eager: list, compiled: list, eager_out, compiled_out
                  ) -> str | None:
    """Why the compiled results are not the eager ones (None when they agree)."""
    pairs = [(b, e, c) for b, e, c in zip(before, eager, compiled) if isinstance(e, torch.Tensor)]
    if eager_out is None:
        eager_out = compiled_out = ()
    outs = eager_out if isinstance(eager_out, (tuple, list)) else (eager_out,)
    couts = compiled_out if isinstance(compiled_out, (tuple, list)) else (compiled_out,)
    pairs += [(None, e, c) for e, c in zip(outs, couts) if isinstance(e, torch.Tensor)]
    for i, (b, e, c) in enumerate(pairs):
        if e.shape != c.shape or e.dtype != c.dtype:
            return f"result {i}: {c.dtype} {tuple(c.shape)} against {e.dtype} {tuple(e.shape)}"
        if not e.is_floating_point():
            if not torch.equal(e, c):
                return f"result {i} ({e.dtype}): bits differ"
            continue
        e32, c32 = e.float(), c.float()
        same = (e32 == c32) | (e32.isnan() & c32.isnan())
        if bool(same.all()):
            continue
        moved = (e32 - b.float()).abs().nan_to_num(0.0) if b is not None else e32.abs() * 0
        scale = moved.max() if moved.numel() else torch.tensor(0.0)
        err = (c32 - e32).abs()
        bad = ~same & ~(err <= 0.01 * scale + 2 * _ulp(e))
        if bool(bad.any()):
            return (f"result {i} ({e.dtype}): off by up to {err[bad].max().item():.3g} where "
                    f"the eager step moved it by up to {scale.item():.3g}")
    return None


class GuardedKernel:
    """``fn`` compiled by ``torch.compile`` (``dynamic=True``, ``options``), checked against
    ``fn`` itself on the first call per (device, argument dtypes), falling back to ``fn`` with one
    :class:`CompiledKernelWarning` where they disagree (see the module docstring).

    Args:
        name: the kernel's name in messages and verdicts.
        fn: the eager function (it writes its results into its tensor arguments and/or returns
            tensors).
        options: inductor options.
        compiler: what compiles ``fn`` (tests inject a wrong "compiled" kernel here).
    """

    def __init__(self, name: str, fn: Callable, options: dict | None = None, *,
                 compiler: Callable | None = None):
        self.name, self.fn, self.options = name, fn, dict(options or {})
        self._compiler = compiler
        self._compiled: Callable | None = None

    def compiled(self) -> Callable:
        """The compiled kernel (made on first use; unchecked)."""
        if self._compiled is None:
            if self._compiler is not None:
                self._compiled = self._compiler(self.fn)
            else:
                self._compiled = torch.compile(self.fn, dynamic=True, options=self.options)
        return self._compiled

    def _run_compiled(self, *args):
        with quiet_compile():
            return self.compiled()(*args)

    def trusted(self, *args) -> bool:
        """Whether the compiled kernel runs for these arguments (checks it the first time)."""
        key = _signature(self.name, args)
        verdict = _VERDICTS.get(key)
        if verdict is None:
            start = time.perf_counter()
            verdict = _VERDICTS[key] = self._check(key, args)
            took = time.perf_counter() - start
            _LOG.log(logging.WARNING if took >= SLOW_COMPILE_S else logging.INFO,
                     "mixprec: compiled the '%s' kernel for %s (arguments %s) and checked it "
                     "against its eager twin in %.1f s (once per process)", self.name, key[1],
                     ", ".join(map(str, key[2])), took)
        return verdict

    def _check(self, key: tuple, args: tuple) -> bool:
        before = _probe(args)
        eager_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in before]
        comp_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in before]
        with torch.no_grad():
            eager_out = self.fn(*eager_args)
            compiled_out = self._run_compiled(*comp_args)
            why = _disagreement(before, eager_args, comp_args, eager_out, compiled_out)
        if why is None:
            return True
        warnings.warn(
            f"mixprec: the compiled '{self.name}' kernel disagrees with its eager twin on "
            f"{key[1]} (torch {torch.__version__}, arguments {list(map(str, key[2]))}): {why}. "
            "The eager kernel runs instead for this process (same results, slower); please "
            "report it with your torch version", CompiledKernelWarning, stacklevel=3)
        return False

    def __call__(self, *args):
        if self.trusted(*args):
            return self._run_compiled(*args)
        return self.fn(*args)

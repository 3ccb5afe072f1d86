"""Compiled kernels that are checked before they are trusted.

A ``torch.compile``-d kernel is the same Python function as its eager twin, but what inductor
makes of it depends on the torch version, the device and the dtypes: one torch release compiled
the Kahan AdamW step into a kernel that applied -4.73 times the intended update while its eager
twin was right. So every compiled kernel of the master optimizers runs through
:class:`GuardedKernel`: the first time it is called for a given (device, argument dtypes) in a
process, both the compiled kernel and the eager function step copies of a small slice of the
real arguments (the first elements of every element-wise tensor), and the results are compared:
integer tensors bit for bit; floating ones to within 1% of how far the eager step moved them plus
two ulps of their dtype (the compiled kernel may fuse a multiply-add; the 16-bit ones may round
the other way at a tie). A kernel whose fp32 arithmetic precedes a rounding into bits (the
one-pass update kernels) is compared on the values its results hold (the split master,
weight + compensation), not on their bits. On a mismatch the kernel falls back to eager for
that signature, with one :class:`CompiledKernelWarning` naming the kernel, the device, the
dtypes and torch's version.
The verdicts are cached for the process (a check costs one eager and one compiled step of at most
:data:`PROBE_ELEMENTS` elements). The check is where a signature compiles: what was compiled and how
long it took is logged once (logger ``"mixprec"``; a warning when it took a second or more, so a
slow first step says why).

Compiling also makes torch emit its own ``torch.jit.script_method`` ``DeprecationWarning`` (from
inductor's internals, 14 times at the first compiled step): :func:`quiet_compile` silences exactly
that message around our compiled calls, so ``-W error::DeprecationWarning`` users are not broken
by torch's internals.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import shutil
import time
import warnings
from collections.abc import Callable, Iterator

import torch

__all__ = ["GuardedKernel", "CompiledKernelWarning", "quiet_compile", "PROBE_ELEMENTS",
           "verdicts", "forget_verdicts", "can_compile"]

_LOG = logging.getLogger("mixprec")
#: A compile that took this many seconds or more is logged as a warning (else as info).
SLOW_COMPILE_S = 1.0
#: At most this many elements of each element-wise argument are stepped by the check.
PROBE_ELEMENTS = 256
_TORCH_DEPRECATION = r"`torch\.jit\.script_method` is deprecated"
# (kernel name, device, argument dtypes) -> True (the compiled kernel is trusted) or False
_VERDICTS: dict[tuple, bool] = {}


@functools.lru_cache(maxsize=None)
def can_compile(device_type: str) -> bool:
    """True when ``torch.compile`` can build kernels for ``device_type`` here (CPU: a C++
    compiler on the PATH; CUDA: Triton importable)."""
    if device_type == "cpu":
        return any(shutil.which(c) for c in ("g++", "c++", "clang++"))
    if device_type == "cuda":
        return importlib.util.find_spec("triton") is not None
    return False


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
    """Copies of the arguments, element-wise tensors cut to their first elements (in proportion
    to the first tensor's length: int32 pair views hold two elements a word)."""
    first = next(a for a in args if isinstance(a, torch.Tensor))
    n0 = first.numel()
    keep = min(n0, PROBE_ELEMENTS)
    out = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            out.append(a)
        elif a.dim() == 0 or a.numel() * 2 < n0 or n0 <= PROBE_ELEMENTS:
            out.append(a.detach().clone())
        else:
            out.append(a.detach().reshape(-1)[: keep * a.numel() // n0].clone())
    return out


def _ulp(t: torch.Tensor) -> torch.Tensor:
    eps = torch.finfo(t.dtype).eps
    tiny = torch.finfo(t.dtype).tiny
    return t.abs().float() * eps + tiny


def _disagreement(before: list, eager: list, compiled: list, eager_out, compiled_out,
                  rel_tol: float) -> str | None:
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
        bad = ~same & ~(err <= 0.01 * scale + 2 * _ulp(e) + rel_tol * e32.abs())
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
        recompile_limit: dynamo's recompile limit while it runs (None: torch's).
        compiler: what compiles ``fn`` (tests inject a wrong "compiled" kernel here).
        outcome: ``(args, result) -> tensors`` to compare after a call (None: every tensor
            argument and result); e.g. the fp32 value a weight and its buffer hold, not their
            bits, where the arithmetic before them may round an ulp apart.
        rel_tol: a further tolerance, relative to the values compared (a Kahan pair holds
            about 16 significant bits).
    """

    def __init__(self, name: str, fn: Callable, options: dict | None = None, *,
                 recompile_limit: int | None = None, compiler: Callable | None = None,
                 outcome: Callable | None = None, rel_tol: float = 0.0):
        self.name, self.fn, self.options = name, fn, dict(options or {})
        self.outcome, self.rel_tol = outcome, rel_tol
        self.recompile_limit = recompile_limit
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
        limit = (contextlib.nullcontext() if self.recompile_limit is None else
                 torch._dynamo.config.patch(recompile_limit=self.recompile_limit))
        with quiet_compile(), limit:
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
            if self.outcome is None:
                why = _disagreement(before, eager_args, comp_args, eager_out, compiled_out, 0.0)
            else:
                start = self.outcome(before, None)
                why = _disagreement(start, self.outcome(eager_args, eager_out),
                                    self.outcome(comp_args, compiled_out), None, None,
                                    self.rel_tol)
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

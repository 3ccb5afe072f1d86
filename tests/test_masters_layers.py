"""The master packages in layers: ``mixprec.masters`` (the methods, their load/store and the split
and rounding arithmetic) below ``mixprec.optim`` (the optimizers), which asks each method for
its load and store; no import climbs back, none hides in a function, and neither package loads
``torch.distributed.tensor`` when it is imported.
"""

import ast
import dataclasses
import pathlib
from typing import ClassVar

import pytest
import torch
from torch import nn

from mixprec.masters import Kahan, MasterMethod, Split, Stochastic
from mixprec.optim import CompactMasterOptimizer, compact_kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]


# -- the import rules -----------------------------------------------------------------------------
def _imports(source: str, module: str, is_package: bool):
    """(absolute target, line, inside a function) of every import in ``source``."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, inner) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = base[:len(base) - child.level + 1] + ([child.module] if child.module
                                                                  else [])
                    target = ".".join(parts)
                else:
                    target = child.module
                found.extend((f"{target}.{a.name}", child.lineno, inner) for a in child.names)
            visit(child, inner)

    visit(ast.parse(source), False)
    return found


def _problems(source: str, module: str, is_package: bool = False) -> list[str]:
    out = []
    for target, line, inner in _imports(source, module, is_package):
        if module.startswith("mixprec.masters") and (target == "mixprec.optim"
                                                     or target.startswith("mixprec.optim.")):
            out.append(f"{module}:{line} imports {target} (the layer above)")
        if inner and target.startswith("mixprec"):
            out.append(f"{module}:{line} imports {target} inside a function")
        if not inner and target.startswith("torch.distributed.tensor"):
            out.append(f"{module}:{line} imports {target} at import time")
    return out


def test_masters_import_no_optimizer_and_nothing_hides_in_a_function():
    found = []
    for package in ("master", "masters"):
        for path in sorted((ROOT / "mixprec" / package).glob("*.py")):
            name = f"mixprec.{package}" + ("" if path.stem == "__init__" else f".{path.stem}")
            found += _problems(path.read_text(encoding="utf-8"), name,
                               path.stem == "__init__")
    assert found == []


def test_the_import_rules_can_fail():
    source = ("from ..optim import CompactMasterOptimizer\n"
              "from torch.distributed.tensor import DTensor\n"
              "def f():\n    from .split_bits import split_of\n")
    assert _problems(source, "mixprec.masters.kahan") == [
        "mixprec.masters.kahan:1 imports mixprec.optim.CompactMasterOptimizer (the layer above)",
        "mixprec.masters.kahan:2 imports torch.distributed.tensor.DTensor at import time",
        "mixprec.masters.kahan:4 imports mixprec.masters.split_bits.split_of inside a function"]


# -- each method's load and store ----------------------------------------------------------------
def test_split_stores_and_loads_its_master_exactly_in_both_views():
    new = torch.randn(4096) * torch.logspace(-30, 30, 4096)
    key = torch.tensor(7, dtype=torch.int32)
    weight, rem = Split.stored(new.bfloat16(), torch.zeros(4096, dtype=torch.int16), new, key)
    assert torch.equal(Split.load(weight, rem), new)
    words = Split.kernel_views(weight, rem)  # the CPU's int32 pair words
    assert words[0].dtype == torch.int32
    assert torch.equal(Split.load(*words), new)
    w2, r2 = weight.clone(), rem.clone()
    Split.store(*Split.kernel_views(w2, r2), new * 3, key)  # in place, through the words
    assert torch.equal(Split.load(w2, r2), new * 3)
    on_gpu = (torch.empty(8, dtype=torch.bfloat16, device="meta"),
              torch.empty(8, dtype=torch.int16, device="meta"))
    assert all(a is b for a, b in zip(Split.kernel_views(*on_gpu), on_gpu))  # Triton: int16


def test_kahan_and_stochastic_store_what_they_load():
    new = torch.randn(4096)
    key = torch.tensor(11, dtype=torch.int32)
    weight, comp = Kahan.stored(new.bfloat16(), torch.zeros(4096, dtype=torch.bfloat16), new, key)
    assert torch.equal(weight, new.bfloat16())  # the weight rounds to nearest
    held = Kahan.load(weight, comp)
    assert (held - new).abs().max() <= 2.0 ** -15 * new.abs().max()
    assert (held - new).abs().max() > 0  # bf16 compensation: close, not exact
    rounded, none = Stochastic.stored(new.bfloat16(), None, new, key)
    assert none is None and torch.equal(Stochastic.load(rounded, None), rounded.float())
    assert ((rounded.float() - new).abs() <= new.abs() * 2.0 ** -7).all()  # within a bf16 ulp


@dataclasses.dataclass(frozen=True, eq=False)
class Nearest(MasterMethod):
    """A method of the test's own: no buffer, the fp32 result rounded to nearest; it counts the
    calls of its load and store (not registered: a method instance is enough)."""

    name: ClassVar[str] = "nearest-for-test"
    dtypes: ClassVar[tuple] = (torch.bfloat16,)
    draws_bits: ClassVar[bool] = False
    calls: ClassVar[list] = []

    @staticmethod
    def load(weight, buf):
        Nearest.calls.append("load")
        return weight.float()

    @staticmethod
    def store(weight, buf, new, key):
        Nearest.calls.append("store")
        weight.copy_(new.to(weight.dtype))

    @staticmethod
    def stored(weight, buf, new, key):
        Nearest.calls.append("stored")
        return new.to(weight.dtype), None

    def assign(self, weight, buf, value):
        weight.copy_(value)


OPTIMIZERS = {"adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
              "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
              "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2))}


@pytest.mark.parametrize("name,fused,calls", [
    ("adamw", "auto", ["load", "stored"]),   # a param group at a time (family)
    ("sgd", "auto", ["load", "stored"]),
    ("adamw", False, ["load", "store"]),     # per tensor, the eager one-pass kernels
    ("rmsprop", "auto", ["load", "store"]),  # through transient fp32 copies
])
def test_the_optimizer_steps_through_the_methods_own_load_and_store(name, fused, calls,
                                                                    monkeypatch):
    monkeypatch.setattr(compact_kernels, "can_compile", lambda device_type: False)
    cls, options = OPTIMIZERS[name]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3)).bfloat16()
    ref = [p.detach().float().clone().requires_grad_() for p in net.parameters()]
    opt = CompactMasterOptimizer(cls(net.parameters(), **options), Nearest(), fused=fused)
    ref_opt = cls(ref, **options, **({"fused": True} if fused == "auto" and name != "rmsprop"
                                     else {}))
    Nearest.calls.clear()
    for step in range(3):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(step * 9 + i))
                 for i, p in enumerate(net.parameters())]
        for p, r, g in zip(net.parameters(), ref, grads):
            p.grad, r.grad = g.bfloat16(), g.bfloat16().float()
        opt.step()
        ref_opt.step()
        with torch.no_grad():
            for r in ref:  # the weight holds the result rounded to nearest
                r.copy_(r.bfloat16().float())
    assert sorted(set(Nearest.calls)) == sorted(calls)
    for p, r in zip(net.parameters(), ref):
        if fused is False:  # torch's single-tensor arithmetic: an fp32 ulp may flip a rounding
            torch.testing.assert_close(p.float(), r, rtol=2.0 ** -7, atol=0)
        else:  # torch's fused kernel (or the optimizer itself) on the loaded values: bitwise
            assert torch.equal(p.float(), r.detach())

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
from mixprec.optim import CompactMasterOptimizer

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
def test_each_method_stores_what_it_loads_over_a_piece():
    """Over a piece of two tensors (one strided): split exactly, Kahan's weight to nearest with a
    compensation within 2^-15 of the value, stochastic rounding within a bf16 ulp; each
    method's per-tensor load reads what its piece store wrote."""
    new = torch.randn(4096) * torch.logspace(-3, 3, 4096)
    keys = torch.tensor([7, 11], dtype=torch.int32)
    for method, buf_dtype in ((Split(), torch.int16), (Kahan(), torch.bfloat16),
                              (Stochastic(), None)):
        weights = [torch.empty(1024, dtype=torch.bfloat16),
                   torch.empty(48, 64, dtype=torch.bfloat16).t()]
        bufs = None if buf_dtype is None else [torch.empty(w.shape, dtype=buf_dtype)
                                               for w in weights]
        method.store_lists(new.clone(), weights, bufs, keys)
        held = torch.cat([method.load(w, None if bufs is None else b).reshape(-1)
                          for w, b in zip(weights, bufs or weights)])
        out = torch.empty(4096)
        method.load_lists(out, weights, bufs)
        assert torch.equal(out, held)
        if isinstance(method, Split):
            assert torch.equal(held, new)
        elif isinstance(method, Kahan):
            assert torch.equal(torch.cat([w.reshape(-1) for w in weights]), new.bfloat16())
            assert ((held - new).abs() <= 2.0 ** -15 * new.abs()).all()
        else:
            assert ((held - new).abs() <= new.abs() * 2.0 ** -7).all()


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
        return weight.float()

    @staticmethod
    def load_lists(out, weights, bufs):
        Nearest.calls.append("load_lists")
        torch._foreach_copy_(list(torch._C._nn.unflatten_dense_tensors(out, weights)), weights)

    @staticmethod
    def store_lists(values, weights, bufs, keys):
        Nearest.calls.append("store_lists")
        assert keys is None  # draws no bits
        torch._foreach_copy_(weights, torch._C._nn.unflatten_dense_tensors(values, weights))

    def assign(self, weight, buf, value):
        weight.copy_(value)


OPTIMIZERS = {"adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
              "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
              "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2))}


@pytest.mark.parametrize("name,fused", [("adamw", "auto"), ("sgd", "auto"), ("adamw", False),
                                        ("rmsprop", "auto")])
def test_the_optimizer_steps_through_the_methods_own_load_and_store(name, fused):
    """Every optimizer, fused or not, through the method's load_lists and store_lists around
    torch's own step: bitwise torch's optimizer on fp32 weights rounded to nearest each step."""
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
    assert Nearest.calls == ["load_lists", "store_lists"] * 3  # one piece a step
    for p, r in zip(net.parameters(), ref):
        assert torch.equal(p.float(), r.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kahan_with_a_spare_buffer_loads_and_stores_the_same_bits(dtype):
    """Kahan's load and store widen their 16-bit operands into the caller's spare fp32 buffer
    (where a mixed-dtype op on the CPU would allocate a copy of each): the same values, weights
    and compensations bit for bit, and the spare only written, never read."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (2, 2, 2)]
    weights = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    comps = [(torch.randn(s, generator=g) * 1e-3).to(dtype) for s in shapes]
    n = sum(w.numel() for w in weights)
    keys = torch.tensor([5, 1 << 19, 12345], dtype=torch.int32)
    out = {}
    for spare in (None, torch.full((n + 3,), float("nan"))):
        kw = {} if spare is None else {"spare": spare}
        w, c = [t.clone() for t in weights], [t.clone() for t in comps]
        values = torch.empty(n)
        Kahan.load_lists(values, w, c, **kw)
        loaded = values.clone()
        values.add_(torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-2)
        Kahan.store_lists(values, w, c, keys, **kw)
        out[spare is None] = (loaded, w, c)
    (a_loaded, a_w, a_c), (b_loaded, b_w, b_c) = out[True], out[False]
    assert torch.equal(a_loaded, b_loaded)
    assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a_w, b_w))
    assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a_c, b_c))
    assert Kahan.uses_spare and Split.uses_spare and not Stochastic.uses_spare


def test_the_spare_goes_where_mixed_operands_are_copied(monkeypatch):
    """The optimizer hands Kahan and split its spare buffer on the CPU, where an in-place fp32 op
    copies a 16-bit operand first (and split's in-place ops on every other int16 run element by
    element), and not under CUDA's limits (its kernels read the operand as they go), nor to a
    method that takes none."""
    from mixprec import kernel_table
    from mixprec.optim.pieces import spare_for

    buf = torch.empty(4)
    assert spare_for(Kahan(), buf, torch.bfloat16)["spare"] is buf
    assert spare_for(Split(), buf, torch.bfloat16)["spare"] is buf
    assert spare_for(Stochastic(), buf, torch.bfloat16) == {}
    monkeypatch.setattr(kernel_table, "TABLE", kernel_table.TABLE.imposing("cuda"))
    assert spare_for(Kahan(), buf, torch.bfloat16) == {}
    assert spare_for(Kahan(), buf, torch.float16) == {}
    assert spare_for(Split(), buf, torch.bfloat16) == {}

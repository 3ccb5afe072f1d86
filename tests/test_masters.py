"""Master methods as typed components (``mp.masters``): the registry, shorthands that resolve
once to equal methods and equal policies, round trips through a policy's ``state_dict``, each
method's own validation and bytes, and no code outside ``mixprec/masters`` branching on a
method's name.
"""

import ast
import pathlib

import pytest
import torch
from torch import nn

import mixprec as mp
from mixprec.masters import FP32, Kahan, Split, Stochastic

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMES = ("fp32", "kahan", "split", "stochastic")


def o2(master, dtype="bf16"):
    return mp.Policy.from_level("O2", dtype, warn=False).replace(master=master)


def test_the_registry_lists_the_four_methods():
    assert mp.masters.shorthands() == NAMES
    assert mp.masters.methods() == {"fp32": FP32, "kahan": Kahan, "split": Split,
                                    "stochastic": Stochastic}
    assert [m.compact for m in mp.masters.methods().values()] == [False, True, True, True]
    assert [mp.masters.resolve(n).master_bytes(2) for n in NAMES] == [4, 2, 2, 0]
    assert mp.policy.MASTERS == NAMES  # the strings master= accepts


@pytest.mark.parametrize("name,method", list(zip(NAMES, (FP32(), Kahan(), Split(), Stochastic()))))
def test_shorthands_give_equal_methods_and_equal_policies(name, method):
    assert mp.masters.resolve(name) == method == name and str(method) == name
    assert hash(mp.masters.resolve(name)) == hash(method)
    assert o2(name) == o2(method) and hash(o2(name)) == hash(o2(method))
    assert o2(name).master is not name  # resolved to the component
    assert isinstance(o2(name).master, type(method))
    state = o2(method).state_dict()
    assert state["master"] == name
    assert mp.Policy.from_state_dict(state) == o2(name)
    assert f"master={name}" in str(o2(method))
    assert method != "bogus" and all(method != m for m in NAMES if m != name)


def test_bad_methods_are_refused_by_the_component():
    with pytest.raises(ValueError, match=r"master must be one of 'fp32', 'kahan', 'split', "
                                         r"'stochastic'.*got 'exact'"):
        mp.Policy(master="exact")
    with pytest.raises(TypeError, match="master must be a mixprec.masters method"):
        mp.Policy(master=3)
    with pytest.raises(ValueError, match="master method 'fp64'"):
        mp.masters.resolve({"method": "fp64"})
    assert mp.masters.resolve(Split().state_dict()) == Split()
    with pytest.raises(ValueError, match="master='stochastic' rounds into bf16 weights; got "
                                         "fp16 parameters. Use master='fp32' or 'kahan'"):
        o2("stochastic", "fp16")
    assert o2("kahan", "fp16").master == Kahan()
    with pytest.raises(ValueError, match="name 'split' is taken by Split"):
        class Other(Split):
            pass
        mp.masters.register(Other)
    with pytest.raises(TypeError, match="MasterMethod subclass"):
        mp.masters.register(int)


@pytest.mark.parametrize("master", NAMES)
def test_each_method_wraps_the_optimizer_it_says(master):
    net = nn.Linear(4, 4)
    net, opt = mp.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), level="O2",
                          dtype="bf16", master=mp.masters.resolve(master))
    method = mp.policy_of(net).master
    assert isinstance(opt, mp.CompactMasterOptimizer) == method.compact
    if method.compact:
        assert opt.master == method
        buf = opt.compensation(net.weight)
        assert (buf is None) == (method.buffer_key is None)
        assert buf is None or buf.dtype == method.buffer_dtype(torch.bfloat16)


def _docstrings(tree):
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)}


def _mentions_master(node) -> bool:
    return any((isinstance(n, ast.Name) and "master" in n.id)
               or (isinstance(n, ast.Attribute) and "master" in n.attr) for n in ast.walk(node))


def _names_in(node) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in NAMES]


def test_no_code_outside_the_methods_branches_on_a_method_name():
    """Outside mixprec/masters, no comparison (``==``, ``!=``, ``in``) of a master-method name,
    and no dict keyed by one: "kahan", "split" and "stochastic" anywhere, "fp32" (also a dtype
    name) where the other side is about a master."""
    found = []
    for path in sorted((ROOT / "mixprec").rglob("*.py")):
        if "masters" in path.relative_to(ROOT / "mixprec").parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            hits = []
            if isinstance(node, ast.Compare):
                names = _names_in(node)
                hits = [n for n in names if n != "fp32" or _mentions_master(node)]
            elif isinstance(node, ast.Dict):
                hits = [k.value for k in node.keys if isinstance(k, ast.Constant)
                        and k.value in NAMES[1:] and id(k) not in docstrings]
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {h!r}" for h in hits]
    assert found == []


def test_the_grep_catches_a_branch():
    """The check above can fail: it flags the forms it looks for."""
    tree = ast.parse("if policy.master == 'fp32': pass\nx = {'kahan': 2}\n"
                     "y = m in ('split', 'stochastic')\nz = dtype == 'fp32'\n")
    compares = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)]
    flagged = [n for c in compares for n in _names_in(c) if n != "fp32" or _mentions_master(c)]
    assert flagged == ["fp32", "split", "stochastic"]

"""The layers of the package, drawn in docs/internals.md ("Layers"), checked from the source.

Read from the AST of every module under mixprec/ (nothing is imported). A room is a top-level
module or package of mixprec (``mixprec.policy``, ``mixprec.optim``; ``mixprec`` itself is the
package's ``__init__.py``). The rules:

1. every room has a layer in :data:`LAYERS`;
2. no cycle between rooms;
3. no import climbs: a room imports rooms of its own layer or below, except the imports named
   in :data:`CLIMBS` (at most 2, each with its reason in docs/internals.md);
4. no function-level import of mixprec's own modules (``import``, ``from ... import`` or
   ``importlib.import_module`` in a function), except where the line says why: ``# optional:``
   (the module imports an optional dependency) or ``# lazy:`` (a package's PEP 562
   ``__getattr__``, for import time).

``mixprec.masters`` (the master methods and their arithmetic) sits one layer below
``mixprec.optim`` (the optimizers that step them).
"""

from __future__ import annotations

import ast
import collections
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mixprec"
DOC = ROOT / "docs" / "internals.md"

#: bottom first: a room may import its own layer and the layers below
LAYERS = (
    ("foundations", ("dtypes", "hardware", "formats", "components", "kernel_table", "shards",
                     "callsite",
                     "norms", "forwards", "distenv", "oplists", "emulation", "modulecasts",
                     "hfsave", "benchmodels", "integrity")),
    ("master methods", ("masters",)),
    ("components", ("lowbit", "scaling", "optim")),
    ("policy and casting", ("precision", "precision_map", "policy", "autocast", "outputs",
                            "regions", "recompute", "casting")),
    ("preparing a model", ("vocabulary", "fp8", "statedict", "fp32export", "prepare_checks",
                           "prepare", "footprint", "averaging")),
    ("engine", ("engine", "engine_checks", "engine_parallel")),
    ("around the engine", ("parallel", "monitor", "debug", "advisor", "training",
                           "integrations", "compat")),
    ("entry points", ("mixprec", "commands", "cli", "__main__")),
)
#: rooms that count as one (see the module docstring)
SAME_ROOM: dict[str, str] = {}
#: imports allowed to climb: (file, imported room) -> reason (also in docs/internals.md)
CLIMBS: dict[tuple[str, str], str] = {}
#: function-level imports of our own modules allowed without a marker: (file, function) -> why
LISTED: dict[tuple[str, str], str] = {}
MARKERS = re.compile(r"#\s*(optional|lazy):")

LAYER_OF = {room: i for i, (_, rooms) in enumerate(LAYERS) for room in rooms}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def room(module: str) -> str:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "mixprec"
    return SAME_ROOM.get(name, name)


def _known(name: str) -> str | None:
    """The mixprec module ``name`` names (or the package holding it), else None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _absolute(module: str, ispkg: bool, level: int, target: str | None) -> str:
    base = module.split(".")
    if not ispkg:
        base = base[:-1]
    if level:
        base = base[:len(base) - (level - 1)]
        return ".".join(base + ([target] if target else []))
    return target or ""


Import = collections.namedtuple("Import", "file line module target function text")


def _imports_of(module: str, rel: str, source: str) -> list[Import]:
    """Every import of a mixprec module in ``module`` (file ``rel``, text ``source``;
    TYPE_CHECKING blocks aside), with the function it sits in (None at module level)."""
    lines = source.splitlines()
    ispkg = rel.endswith("__init__.py")
    found = []

    def add(node, names, function):
        for name in names:
            target = _known(name)
            if target and target != module and target.startswith("mixprec"):
                found.append(Import(rel, node.lineno, module, target, function,
                                    lines[node.lineno - 1]))

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for sub in child.orelse:
                    visit(sub, function)
                continue
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else function
            if isinstance(child, ast.Import):
                add(child, [a.name for a in child.names], function)
            elif isinstance(child, ast.ImportFrom):
                base = _absolute(module, ispkg, child.level, child.module)
                add(child, [f"{base}.{a.name}" for a in child.names], function)
            elif (isinstance(child, ast.Call) and ast.unparse(child.func).endswith("import_module")
                  and child.args):
                arg = child.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    name = arg.value
                    level = len(name) - len(name.lstrip("."))
                    add(child, [_absolute(module, ispkg, level, name[level:] or None)
                                if level else name], function)
                elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(
                        arg.values[0], ast.Constant) and arg.values[0].value.startswith(
                        ("mixprec", ".")):  # a name computed from one of ours
                    found.append(Import(rel, child.lineno, module, module, function,
                                        lines[child.lineno - 1]))
            visit(child, inner)

    visit(ast.parse(source), None)
    return found


IMPORTS = [imp for module, path in MODULES.items()
           for imp in _imports_of(module, str(path.relative_to(ROOT)), path.read_text())]


def _rooms(imp: Import) -> tuple[str, str]:
    return room(imp.module), room(imp.target)


def test_every_room_has_a_layer():
    missing = sorted({f"{path.relative_to(ROOT)}: room {room(m)!r}" for m, path in
                      MODULES.items() if room(m) not in LAYER_OF})
    assert not missing, ("rule 1 (every top-level module or package has a layer): add these to "
                         "LAYERS in tests/test_layers.py and to docs/internals.md, 'Layers':\n"
                         + "\n".join(missing))


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one room (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def _cycle_report(imports: list[Import]) -> list[str]:
    edges = collections.defaultdict(set)
    where = collections.defaultdict(list)
    for imp in imports:
        a, b = _rooms(imp)
        if a != b:
            edges[a].add(b)
            where[a, b].append(f"{imp.file}:{imp.line}")
    report = []
    for comp in _cycles(edges):
        report.append("cycle: " + " <-> ".join(comp))
        report += [f"  {imp} ({a} -> {b})" for a in comp for b in comp
                   for imp in where.get((a, b), ())]
    return report


def _climbs(imports: list[Import]) -> list[str]:
    climbs = []
    for imp in imports:
        a, b = _rooms(imp)
        if a in LAYER_OF and b in LAYER_OF and LAYER_OF[b] > LAYER_OF[a] \
                and (imp.file, b) not in CLIMBS:
            climbs.append(f"{imp.file}:{imp.line}: {a} ({LAYERS[LAYER_OF[a]][0]}) imports "
                          f"{imp.target} ({LAYERS[LAYER_OF[b]][0]}, a layer above)")
    return climbs


def _unmarked(imports: list[Import]) -> list[str]:
    unmarked = []
    for imp in imports:
        if imp.function is None or (imp.file, imp.function) in LISTED:
            continue
        marker = MARKERS.search(imp.text)
        if marker and marker.group(1) == "lazy" and not (
                imp.function == "__getattr__" and imp.file.endswith("__init__.py")):
            marker = None  # '# lazy:' is for a package's PEP 562 __getattr__ only
        if marker is None:
            unmarked.append(f"{imp.file}:{imp.line}: {imp.text.strip()} (in {imp.function}())")
    return unmarked


def test_no_cycle_between_rooms():
    report = _cycle_report(IMPORTS)
    assert not report, "rule 2 (no cycle between rooms):\n" + "\n".join(report)


def test_no_import_climbs_a_layer():
    climbs = _climbs(IMPORTS)
    assert not climbs, ("rule 3 (a room imports its own layer and the layers below; "
                        "docs/internals.md, 'Layers'):\n" + "\n".join(climbs))


def test_climbs_are_few_named_and_current():
    assert len(CLIMBS) <= 2, f"at most 2 imports may climb; CLIMBS lists {len(CLIMBS)}"
    doc = DOC.read_text()
    for (file, target), reason in CLIMBS.items():
        assert reason and file in doc, f"{file} -> {target}: its reason belongs in {DOC.name}"
        assert any(imp.file == file and room(imp.target) == target for imp in IMPORTS), \
            f"CLIMBS lists {file} -> {target}, which no longer climbs: remove it"


def test_function_level_imports_say_why():
    unmarked = _unmarked(IMPORTS)
    assert not unmarked, (
        "rule 4 (no function-level import of mixprec's own modules, unless its line says "
        "'# optional: <dependency>' or, in a package's __getattr__, '# lazy: <why>'):\n"
        + "\n".join(unmarked))


def test_docs_draw_every_layer():
    doc = DOC.read_text()
    section = doc.split("## Layers", 1)[-1].split("\n## ", 1)[0]
    for name, rooms in LAYERS:
        assert name in section, f"docs/internals.md, 'Layers', does not name the layer {name!r}"
        for r in rooms:
            assert f"`{r}`" in section, (f"docs/internals.md, 'Layers', does not place {r!r} "
                                         f"(layer {name!r})")


def test_the_rules_catch_violations():
    """Planted in the bottom layer: a function-level import, a climb, and a cycle."""
    source = ("from .policy import Policy\n\n\ndef f():\n    from . import policy\n\n\n"
              "def g():\n    from . import lowbit  # optional: torchao\n")
    planted = _imports_of("mixprec.dtypes", "mixprec/dtypes.py", source)
    unmarked = _unmarked(planted)
    assert len(unmarked) == 1 and unmarked[0].startswith("mixprec/dtypes.py:5: "), unmarked
    climbs = _climbs(planted)
    assert climbs and climbs[0].startswith("mixprec/dtypes.py:1: dtypes (foundations) imports "
                                           "mixprec.policy"), climbs
    cycle = _cycle_report(IMPORTS + planted)
    assert any("mixprec/dtypes.py:1" in line for line in cycle), cycle


def test_import_mixprec_loads_the_core_only():
    """``import mixprec`` loads no advisor, monitor, diagnostics, Trainer, CLI or distributed
    code (they load on first use of their names); every public name still resolves."""
    code = textwrap.dedent("""
        import sys
        import mixprec as mp
        heavy = ("mixprec.advisor", "mixprec.monitor", "mixprec.debug", "mixprec.training",
                 "mixprec.parallel", "mixprec.cli", "mixprec.commands", "mixprec.integrations",
                 "mixprec.compat", "torch.distributed.tensor", "torch.distributed.checkpoint",
                 "torch.distributed.fsdp", "torchao", "transformers", "lightning")
        print(sorted(m for m in sys.modules if m.startswith(heavy)))
        assert set(mp.__all__) <= set(dir(mp)), set(mp.__all__) - set(dir(mp))
        print(all(getattr(mp, name) is not None for name in mp.__all__))
        from mixprec import Trainer
        print(Trainer is mp.Trainer is mp.training.Trainer, "mixprec.training" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["[]", "True", "True True"], out.stdout

"""One direction between rooms (issue 46): the import graph of recycle/, converters/ and distill/, read from the source.

Every module is parsed with `ast` and every import counts, those inside functions and under `TYPE_CHECKING`
included: an import a function makes when it runs is as much a dependency as one at the top of the file, only
harder to see. Relative imports are resolved, and `from pkg import name` counts as the submodule `pkg.name` where
there is one (else as `pkg`, its `__init__`). What is checked:

- no circle of files (a strongly connected component of more than one module);
- no loop between rooms, a room being a package below recycle (recycle.converters, recycle.distill,
  recycle.decoding, ...) or a top-level module of recycle/;
- converters never imports distill, and the lower rooms import nothing above them.

A module's import of its own package's `__init__` counts like any other: a registry lives in its package's
`registry.py` (or `base.py`), which the members and the `__init__` both import, so no member reads the `__init__`
that imports it. Only the root package `recycle` (its `__init__` holds the version and imports nothing) is no edge.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"recycle": "recycle", "converters": "recycle.converters", "distill": "recycle.distill"}  # as installed

# the lower rooms (README's Layout) and what none of them may import
LOWER = ("recycle.formats", "recycle.families", "recycle.checkpoint", "recycle.io", "recycle.drafters",
         "recycle.decoding", "recycle.mtp", "recycle.fit", "recycle.quant", "recycle.registry", "recycle.errors",
         "recycle.preflight", "recycle.encode", "recycle.chat", "recycle.texts", "recycle.hardware")
UPPER = ("recycle.converters", "recycle.distill", "recycle.bench", "recycle.cli", "recycle.hub", "recycle.plan",
         "recycle.report")


@dataclass(frozen=True)
class Import:
    """One import statement's edge: module `source` imports module `target`, at `path`:`line`."""

    source: str
    target: str
    path: Path
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.text}"


def modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted module name → (file, whether it is a package's `__init__`)."""
    found = {}
    for folder, dotted in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = dotted.split(".") + list(path.relative_to(root / folder).with_suffix("").parts)
            package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _within(name: str, known: Mapping[str, object]) -> str | None:
    """The deepest known module `name` is, or is inside (`recycle.checkpoint.Checkpoint` → `recycle.checkpoint`)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, package: bool, source: str, path: Path, known: Mapping[str, object]) -> list[Import]:
    """Every import of another known module that `source` (module `module`'s text) makes, anywhere in it."""
    lines = source.splitlines()
    here = module if package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        text = " ".join(line.strip() for line in lines[node.lineno - 1:node.end_lineno])
        for name in dict.fromkeys(names):
            target = _within(name, known)
            if target is None or target == module or target == "recycle":  # the root package: see above
                continue
            out.append(Import(module, target, path, node.lineno, text))
    return out


@cache
def graph(root: Path = ROOT) -> tuple[Import, ...]:
    """Every edge of the tree under `root` (read once per run)."""
    known = modules(root)
    return tuple(edge for name, (path, package) in known.items()
                 for edge in imports_of(name, package, path.read_text(), path, known))


def room(module: str, known: Mapping[str, tuple[Path, bool]]) -> str:
    """The room a module lives in: its package right below recycle, or itself (a top-level module of recycle/)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (len(parts) == 2 and known[module][1]) else module


def cycles(edges: Iterable[tuple[str, str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, without recursion)."""
    succ: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        succ[a].append(b)
        succ.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for start in list(succ):
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(succ[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(comp)
    return found


def _explain(kind: str, comps: list[set[str]], edges: Iterable[Import], node=lambda m: m) -> str:
    out = []
    for comp in comps:
        out.append(f"{kind}: {' ↔ '.join(sorted(comp))}")
        out += [f"    {e}" for e in sorted(edges, key=str) if node(e.source) in comp and node(e.target) in comp
                and node(e.source) != node(e.target)]
    return "\n".join(out)


def test_no_circle_of_files():
    edges = graph()
    comps = cycles((e.source, e.target) for e in edges)
    assert not comps, "files that import each other, round a circle:\n" + _explain("circle", comps, edges)


def test_no_loop_between_rooms():
    known = modules()
    edges = graph()
    node = lambda m: room(m, known)
    comps = cycles((node(e.source), node(e.target)) for e in edges if node(e.source) != node(e.target))
    assert not comps, "rooms that import each other:\n" + _explain("loop", comps, edges, node)


def _inside(module: str, rooms: Iterable[str]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in rooms)


def test_converters_never_import_distill():
    bad = [e for e in graph() if _inside(e.source, ["recycle.converters"]) and _inside(e.target, ["recycle.distill"])]
    assert not bad, "converters import distill (calibration is distill's, passed in by the caller):\n" + \
        "\n".join(f"    {e}" for e in bad)


def test_lower_rooms_import_nothing_above():
    bad = [e for e in graph() if _inside(e.source, LOWER) and _inside(e.target, UPPER)]
    assert not bad, "a lower room imports a higher one:\n" + "\n".join(f"    {e}" for e in bad)


def test_the_graph_counts_every_kind_of_import(tmp_path):
    """The reader itself: imports inside functions, relative ones, `from pkg import submodule` as the submodule,
    names inside a module as that module, its own package's `__init__` as an edge (the root package's as none), and
    other packages' modules as nothing."""
    for rel in ("recycle/__init__.py", "recycle/low.py", "recycle/sub/__init__.py", "recycle/sub/a.py",
                "recycle/sub/b.py", "converters/__init__.py", "converters/x.py", "distill/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / "recycle/sub/a.py").write_text(
        "import torch\nfrom . import b\nfrom recycle.sub import REGISTRY\n"
        "def f():\n    from ..low import thing\n    from recycle import distill\n")
    (tmp_path / "converters/x.py").write_text(
        "from __future__ import annotations\nclass C:\n    def m(self):\n        import recycle.distill\n"
        "        from recycle.sub import (\n            a,\n        )\n")
    edges = {(e.source, e.target, e.line) for e in graph(tmp_path)}
    assert edges == {("recycle.sub.a", "recycle.sub.b", 2), ("recycle.sub.a", "recycle.sub", 3),
                     ("recycle.sub.a", "recycle.low", 5),
                     ("recycle.sub.a", "recycle.distill", 6), ("recycle.converters.x", "recycle.distill", 4),
                     ("recycle.converters.x", "recycle.sub.a", 5)}
    known = modules(tmp_path)
    assert room("recycle.sub.a", known) == "recycle.sub" and room("recycle.low", known) == "recycle.low"
    assert room("recycle.converters.x", known) == "recycle.converters"
    assert cycles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [{"a", "b", "c"}]

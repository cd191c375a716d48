"""The package's floors, as docs/design.md ("## Floors") declares them, against its imports as a reader sees them;
and no file longer than a reader can hold (500 lines).

Every `import` and `from ... import` of yolo5l and yolo5l_kernels counts, at module level and inside functions
(`TYPE_CHECKING` blocks too: a reader follows them the same way). Each folder (room) stands on one floor, so a file's
folder says what it may import: its own room and the rooms of lower floors; no import points up or sideways (to
another room on the same floor), no modules import each other round a circle, no module imports a command, and
there are at most 8 floors.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: import name -> folder
PACKAGES = {"yolo5l": ROOT / "yolo5l", "yolo5l_kernels": ROOT / "kernels"}
DESIGN = ROOT / "docs" / "design.md"
ROOT_ONLY = frozenset({"yolo5l"})
MAX_LINES = 500
MAIN = re.compile(r"^if __name__ == .__main__.:", re.M)  # what `python -m <module>` runs


def read_floors(text: str, roots: tuple[str, ...] = tuple(PACKAGES)) -> list[tuple[str, list[str]]]:
    """The `## Floors` section's list, top floor first: [(floor name, [the rooms it names])]: the names in backticks
    that start with one of `roots` (the rest of an entry's words describe the room)."""
    section = re.search(r"^## Floors\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "docs/design.md has no '## Floors' section"
    floors = []
    for item in re.findall(r"^- \*\*([^*]+)\*\*:(.*(?:\n  .*)*)", section.group(1), re.M):
        name, body = item
        names = re.findall(r"`([A-Za-z_][\w.]*)`", body)
        floors.append((name, [n for n in names if n.split(".")[0] in roots]))
    return floors


def find_modules(packages: Mapping[str, Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `packages` (a package's `__init__.py` is the package)."""
    modules = {}
    for top, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if any(p.startswith(".") or p == "__pycache__" for p in parts):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((top, *parts))] = path
    return modules


def room_of(module: str, modules: Mapping[str, Path]) -> str:
    """The room (folder) a module lives in: the package whose folder holds its file (`yolo5l.data.cache` ->
    `yolo5l.data`; `yolo5l.train` and `yolo5l` itself -> `yolo5l`)."""
    path = modules[module]
    if path.name == "__init__.py":
        return module
    return module.rpartition(".")[0] or module


def imports_of(name: str, path: Path, modules: Mapping[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported module of `modules`, line) for each import in the file, wherever it stands in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a.b: the module a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target, node.lineno


def import_graph(packages: Mapping[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}."""
    modules = find_modules(packages)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for target, line in imports_of(name, path, modules):
            edges.setdefault(target, line)
    return graph


def floor_numbers(floors: list[tuple[str, list[str]]]) -> dict[str, int]:
    """room -> floor number (0 is the bottom)."""
    return {room: number for number, (_, rooms) in enumerate(reversed(floors)) for room in rooms}


def misplaced_imports(
    graph: Mapping[str, Mapping[str, int]], rooms: Mapping[str, str], floors: list[tuple[str, list[str]]]
) -> list[str]:
    """Each import that points up a floor, or sideways into another room of the same floor."""
    number, names = floor_numbers(floors), [name for name, _ in reversed(floors)]
    found = []
    for module, edges in sorted(graph.items()):
        here = rooms[module]
        for target, line in sorted(edges.items()):
            there = rooms[target]
            if here == there or here not in number or there not in number:
                continue
            if number[there] > number[here]:
                found.append(f"{module}:{line} ({names[number[here]]}) imports {target} ({names[number[there]]}): up")
            elif number[there] == number[here]:
                found.append(f"{module}:{line} imports {target}: sideways, another room of {names[number[here]]}")
    return found


def commands(modules: Mapping[str, Path]) -> set[str]:
    """The package's commands: its own modules that run as `python -m yolo5l.<command>`."""
    return {
        name for name, path in modules.items()
        if name.count(".") == 1 and name.startswith("yolo5l.") and MAIN.search(path.read_text())
    }  # fmt: skip


def circles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


@pytest.fixture(scope="module")
def floors():
    return read_floors(DESIGN.read_text())


@pytest.fixture(scope="module")
def modules():
    return find_modules(PACKAGES)


@pytest.fixture(scope="module")
def graph():
    return import_graph(PACKAGES)


@pytest.fixture(scope="module")
def rooms(modules):
    return {name: room_of(name, modules) for name in modules}


def test_every_room_is_on_one_floor(rooms, floors):
    listed = [room for _, names in floors for room in names]
    missing = sorted(set(rooms.values()) - set(listed))
    assert not missing, f"rooms on no floor of docs/design.md's '## Floors': {missing}"
    twice = sorted({room for room in listed if listed.count(room) > 1})
    assert not twice, f"rooms on more than one floor: {twice}"
    stale = sorted(set(listed) - set(rooms.values()))
    assert not stale, f"docs/design.md's '## Floors' names what is not a folder of the package: {stale}"


def test_at_most_eight_floors(floors):
    assert 2 <= len(floors) <= 8, [name for name, _ in floors]


def test_no_import_points_up_or_sideways(graph, rooms, floors):
    found = misplaced_imports(graph, rooms, floors)
    assert not found, "imports that point up or sideways:\n" + "\n".join(found)


def test_no_module_imports_a_command(graph, modules):
    names = commands(modules)
    assert {"yolo5l.train", "yolo5l.val", "yolo5l.benchmark"} <= names
    found = sorted(f"{m}:{line} imports {t}" for m, edges in graph.items() for t, line in edges.items() if t in names)
    assert not found, "commands share code through the orchestration modules and lower floors:\n" + "\n".join(found)


def test_the_checks_find_what_they_look_for():
    """The checks on a made-up package: an import up, one sideways, one within a room, one down, and a circle."""
    floors = [("top", ["p"]), ("middle", ["p.a", "p.b"]), ("bottom", ["p.c"])]
    rooms = {"p.run": "p", "p.a.x": "p.a", "p.a.y": "p.a", "p.b.z": "p.b", "p.c.w": "p.c"}
    graph = {"p.run": {"p.a.x": 1}, "p.a.x": {"p.a.y": 2, "p.b.z": 3}, "p.a.y": {"p.c.w": 4}, "p.b.z": {},
             "p.c.w": {"p.run": 5}}  # fmt: skip
    found = misplaced_imports(graph, rooms, floors)
    assert len(found) == 2, found
    assert found[0].startswith("p.a.x:3 imports p.b.z: sideways")
    assert found[1].startswith("p.c.w:5 (bottom) imports p.run (top): up")
    assert circles(graph) == [["p.a.x", "p.a.y", "p.c.w", "p.run"]]


def test_no_import_circle(graph):
    found = circles(graph)
    assert not found, "modules that import each other round a circle:\n" + "\n".join(" <-> ".join(g) for g in found)


def test_no_file_over_500_lines():
    lines = {path: len(path.read_text().splitlines()) for path in find_modules(PACKAGES).values()}
    long = sorted(f"{path.relative_to(ROOT)}: {n}" for path, n in lines.items() if n > MAX_LINES)
    assert not long, f"files over {MAX_LINES} lines (split them along their seams):\n" + "\n".join(long)


def test_the_readme_map_shows_the_tree():
    """The README's map names every subpackage (`base/`, `io/`, ...), every module at the package's top level and
    every module of a subpackage (but for deploy/'s one module per format)."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^## Map\n+```\n(.*?)```", readme, re.S | re.M)
    assert block, "README.md has no '## Map' code block"
    folder = PACKAGES["yolo5l"]
    rooms = [p.parent.name for p in sorted(folder.glob("*/__init__.py")) if p.parent.name != "conf"]
    modules = [p.name for p in sorted(folder.glob("*.py")) if p.name != "__init__.py"]
    missing = [f"{r}/" for r in rooms if not re.search(rf"^  {r}/ ", block.group(1), re.M)]
    missing += [m for m in modules if not re.search(rf"(?<![\w/]){re.escape(m)}\b", block.group(1))]
    for room in set(rooms) - {"deploy"}:  # deploy/: "one writer per export format"
        stems = [p.stem for p in sorted((folder / room).glob("*.py")) if p.stem != "__init__"]
        missing += [f"{room}/{s}" for s in stems if not re.search(rf"\b{s}\b", block.group(1))]
    assert not missing, f"README.md's map leaves out: {missing}"


def test_the_walk_reads_imports_as_a_reader_does(tmp_path):
    """The checker on a package of its own: imports inside functions, `from pkg import module`, relative imports
    and TYPE_CHECKING blocks all count; a circle and an upward import are both found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from pkg.sub import high\n")  # up, and inside a function
    (pkg / "sub" / "high.py").write_text("from .. import mid\n")  # relative
    (pkg / "mid.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.low\nimport os\n"
    )  # fmt: skip
    graph = import_graph({"pkg": pkg})
    assert graph["pkg.low"] == {"pkg.sub.high": 2}
    assert graph["pkg.sub.high"] == {"pkg.mid": 1}
    assert graph["pkg.mid"] == {"pkg.low": 3}
    assert circles(graph) == [["pkg.low", "pkg.mid", "pkg.sub.high"]]
    floors = read_floors("## Floors\n- **top**: `pkg.sub`, `other`,\n  and more\n- **bottom**: `pkg`\n", ("pkg",))
    assert floors == [("top", ["pkg.sub"]), ("bottom", ["pkg"])]
    modules = find_modules({"pkg": pkg})
    rooms = {name: room_of(name, modules) for name in modules}
    assert rooms == {"pkg": "pkg", "pkg.low": "pkg", "pkg.mid": "pkg", "pkg.sub": "pkg.sub", "pkg.sub.high": "pkg.sub"}
    assert misplaced_imports(graph, rooms, floors) == ["pkg.low:2 (bottom) imports pkg.sub.high (top): up"]

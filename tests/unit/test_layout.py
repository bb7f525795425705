"""The house by stage (Issue #38): ``ls src/remat`` shows the pipeline, and every room says what comes in and
what goes out."""

import ast
import importlib
from pathlib import Path

import remat
from remat.errors import MissingDependencyError

SRC = Path(remat.__file__).parent


def _entries() -> list[Path]:
    return sorted(p for p in SRC.iterdir()
                  if p.name not in ("__init__.py", "__main__.py", "__pycache__") and not p.name.endswith(".pyc"))


def test_the_top_level_holds_at_most_fifteen_rooms_each_named_in_the_package_docstring():
    """Fourteen rooms for the pipeline measured here (#38), one more for the modelled target (#39): where costs
    come from has two implementations, each a room of its own."""
    import re

    entries = _entries()
    assert len(entries) <= 15, [p.name for p in entries]
    for p in entries:
        name = p.name + "/" if p.is_dir() else p.stem
        # the name itself, not inside another word or path ("capture" is not "captured", "costs/" not "costs/x")
        assert re.search(rf"(?<![\w/.]){re.escape(name)}(?![\w/])", remat.__doc__), \
            f"{name} is not named in remat's docstring"


def test_every_room_has_a_docstring():
    for p in _entries():
        path = p / "__init__.py" if p.is_dir() else p
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.relative_to(SRC)} has no docstring"


def _python_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_short_rooms():
    """No module over 400 lines, no function over 80 (from its ``def`` to its last line)."""
    long_modules = [(str(p.relative_to(SRC)), n) for p in _python_files()
                    if (n := len(p.read_text().splitlines())) > 400]
    assert long_modules == []
    long_functions = []
    for p in _python_files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long_functions.append((str(p.relative_to(SRC)), node.name, node.end_lineno - node.lineno + 1))
    assert long_functions == []


def test_errors_remat_raises_are_its_own():
    """Every exception remat raises on purpose is a RematError (an invariant of its own too: InternalError, never an
    ``assert``, which ``python -O`` drops and which would reach the user as an AssertionError); the builtin
    NotImplementedError marks a method a class does not provide (abstract, or a meter's ``live_bytes`` that only
    the allocator's events answer)."""
    builtins = {"ValueError", "TypeError", "RuntimeError", "KeyError", "IndexError", "AssertionError", "Exception",
                "AttributeError", "ImportError", "OSError"}
    found = []
    for p in _python_files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in builtins:
                    found.append((str(p.relative_to(SRC)), node.lineno, exc.id))
            elif isinstance(node, ast.Assert):
                found.append((str(p.relative_to(SRC)), node.lineno, "assert"))
    assert found == []


def test_no_module_imports_a_package_above_it():
    """A module of remat imports stages and shared ground by their own modules, never the package it sits in (nor
    remat's top), at module level or inside a function (imports for type checkers only, which never run, aside)."""
    up = []
    for p in _python_files():
        rel = p.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        tree = ast.parse(p.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                       for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            elif isinstance(node, ast.ImportFrom) and node.module and name.startswith(node.module + ".") \
                    and not (rel.name == "__init__" and node.module == name):
                up.append((name, node.module))
            elif isinstance(node, ast.Import):
                up += [(name, a.name) for a in node.names if name.startswith(a.name + ".")]
    assert up == []


def _modules() -> dict[str, Path]:
    modules = {}
    for p in _python_files():
        rel = p.relative_to(SRC.parent).with_suffix("")
        modules[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    return modules


def _imports(p: Path) -> list[ast.ImportFrom | ast.Import]:
    """Every import of a module, at its top or inside a function (issue #62: a cycle hidden in a function is a
    cycle), but those for type checkers only, which never run."""
    tree = ast.parse(p.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING" for n in ast.walk(block)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in typing_only]


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph = {}
    for name, p in modules.items():
        deps = set()
        for node in _imports(p):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("remat"):
                named = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
                deps |= named or {node.module}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles = []

    def visit(u: str, path: list[str]) -> None:
        state[u] = 1
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(path[path.index(v):] + [v])
            elif v not in state:
                visit(v, path + [v])
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u, [u])
    return cycles


def test_no_import_cycle_between_modules():
    """The imports of remat's modules, those inside functions included, form no cycle (a module may import a
    module of its own package that does not import it back: a package's ``__init__`` counts as its own module)."""
    assert _cycles(_graph(_modules())) == []


def test_the_cycle_check_finds_a_cycle_hidden_in_a_function():
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


#: the layers, lowest first: a module imports only from its own layer's package or a lower layer's (issue #62).
#: The torch-free models of numbers at the bottom (what the design keeps free of torch: costs, then the solver
#: over them), then the shared ground that touches torch (private APIs, the step and its meters), the stages in
#: the pipeline's order, the modelled target (a source of costs beside the measured one, which lives in api), the
#: front doors, the features built on them, and the CLI over everything
LAYERS = (("remat.errors",), ("remat.costs",), ("remat.solve",), ("remat._compat",), ("remat.runtime",),
          ("remat.capture",), ("remat.rewrite",), ("remat.profile",), ("remat.check",), ("remat.target",),
          ("remat.examples", "remat.api"), ("remat.sweeps",), ("remat.integrations",), ("remat.cli",),
          ("remat", "remat.__main__"))


def _layer(module: str) -> int:
    package = ".".join(module.split(".")[:2])
    return next(i for i, names in enumerate(LAYERS) if package in names or module in names)


def _upward(modules: dict[str, Path]) -> list[tuple[str, str]]:
    return sorted((name, dep) for name, deps in _graph(modules).items() for dep in deps
                  if _layer(dep) > _layer(name))


def test_every_import_goes_down_the_layers():
    """No module imports from a higher layer than its own (imports inside functions included)."""
    assert _upward(_modules()) == []


def test_the_layer_check_finds_an_import_up(tmp_path):
    (tmp_path / "costs.py").write_text("def f():\n    from remat.api import x\n")
    (tmp_path / "api.py").write_text("")
    assert _upward({"remat.costs.thing": tmp_path / "costs.py", "remat.api": tmp_path / "api.py"}) == \
        [("remat.costs.thing", "remat.api")]


def test_no_private_name_is_taken_from_another_package():
    """``from remat.X import _name`` only within package X (remat._compat's names are private to torch's, not to
    remat: they are the one place private torch APIs live, and public to remat)."""
    taken = []
    for name, p in _modules().items():
        for node in _imports(p):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("remat") \
                    and ".".join(node.module.split(".")[:2]) != ".".join(name.split(".")[:2]):
                taken += [(name, node.module, a.name) for a in node.names if a.name.startswith("_")]
    assert taken == []


def test_the_examples_and_benchmarks_import_what_exists():
    """Every ``from remat... import name`` in examples/, benchmarks/ and scripts/ names a module and a name that
    exist (most of them run in no test: a moved module broke five examples once, found only by the Trainer's)."""

    root = SRC.parents[1]
    missing = []
    for p in sorted([*root.glob("examples/*.py"), *root.glob("benchmarks/**/*.py"), *root.glob("scripts/*.py")]):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "remat":
                try:
                    defined = set(dir(importlib.import_module(node.module)))
                except MissingDependencyError:  # an integration whose framework is absent here (torchtitan on the
                    defined = _top_level_names(node.module)  # oldest torch): its names, read from its source
                except ImportError:
                    missing.append((p.name, node.module))
                    continue
                missing += [(p.name, f"{node.module}.{a.name}") for a in node.names if a.name not in defined
                            and _source_of(f"{node.module}.{a.name}") is None]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "remat" and _source_of(a.name) is None:
                        missing.append((p.name, a.name))
    assert missing == []


def test_names_read_from_source_are_those_the_module_binds():
    """The check above reads an integration's names from its source where its framework is absent (torchtitan on
    torch 2.8): that reading finds what the module binds and nothing else."""
    names = _top_level_names("remat.integrations.torchtitan")
    assert {"remat_ac", "RematAC", "__all__"} <= names
    assert "RematACConfig" not in names and "Any" in names
    assert _source_of("remat.integrations.torchtitan.planning") is not None
    assert _source_of("remat.integrations.torchtitan.no_such_module") is None


def _source_of(module: str) -> Path | None:
    """The file of a module of remat's, found without importing it (or its package, which may need a framework)."""
    base = SRC.parent.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def _top_level_names(module: str) -> set[str]:
    """The names a module's source binds at its top level (for a module that cannot be imported here)."""
    names = set()
    for node in ast.parse(_source_of(module).read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _module_names(src: Path = SRC) -> dict[str, Path]:
    out = {}
    for p in sorted(src.rglob("*.py")):
        rel = p.relative_to(src.parent).with_suffix("")
        out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    return out


def _names_used(tree: ast.Module) -> set[str]:
    """The names a module's code reads, annotations written as strings included."""
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and len(n.value) < 200:
            try:
                used |= {m.id for m in ast.walk(ast.parse(n.value, mode="eval")) if isinstance(m, ast.Name)}
            except SyntaxError:
                pass
    return used


def _imported_through(root: Path, modules: dict[str, Path]) -> set[tuple[str, str]]:
    """Every ``(module, name)`` the repository's Python takes from a module of remat: ``from module import name``,
    ``module.name`` (the module named in full or by an alias it was imported as) and ``setattr(module, "name")``
    (``monkeypatch.setattr`` too)."""
    pairs = set()
    for d in ("src", "tests", "benchmarks", "scripts", "examples"):
        for p in sorted((root / d).rglob("*.py")):
            tree = ast.parse(p.read_text())
            aliases = {}  # a local name -> the module of remat it names
            for n in ast.walk(tree):
                if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                    pairs |= {(n.module, a.name) for a in n.names}
                    aliases |= {a.asname or a.name: f"{n.module}.{a.name}" for a in n.names
                                if f"{n.module}.{a.name}" in modules}
                elif isinstance(n, ast.Import):
                    aliases |= {a.asname: a.name for a in n.names if a.asname and a.name in modules}

            def module_of(node: ast.AST) -> str | None:
                text = ast.unparse(node)
                head, _, rest = text.partition(".")
                full = aliases.get(head, head) + ("." + rest if rest else "")
                return full if full in modules else None

            for n in ast.walk(tree):
                if isinstance(n, ast.Attribute) and (m := module_of(n.value)):
                    pairs.add((m, n.attr))
                elif isinstance(n, ast.Call) and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) \
                        and isinstance(n.args[1].value, str) and (m := module_of(n.args[0])):
                    pairs.add((m, n.args[1].value))
    return pairs


def _shims(src: Path, root: Path) -> list[str]:
    """The re-exports under ``src`` (a package) that break the rule of the test below, as "module: name (from ...)"."""
    modules = _module_names(src)
    pairs = _imported_through(root, modules)
    shims = []
    for name, p in modules.items():
        tree = ast.parse(p.read_text())
        used = _names_used(tree)
        exported = set()
        for n in tree.body:
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets):
                exported = {e.value for e in n.value.elts}
        for n in tree.body:
            if isinstance(n, ast.ImportFrom) and n.module != "__future__":
                aliases = [(a.asname or a.name, n.module) for a in n.names]
            elif isinstance(n, ast.Import):
                aliases = [((a.asname or a.name).split(".")[0], a.name) for a in n.names]
            else:
                continue
            for alias, source in aliases:
                if alias in used or alias in exported or f"{source}.{alias}" in modules:
                    continue
                if alias.startswith("_") and not alias.startswith("__") or (name, alias) not in pairs:
                    shims.append(f"{name}: {alias} (from {source})")
    return shims


def test_no_module_re_exports_a_name_nothing_takes_from_it():
    """Issue #49: no shims left by the move. A name a module imports but does not use (a re-export) is one that
    some code imports from that module (``from module import name``, ``module.name``, ``setattr(module, "name")``),
    or is in its ``__all__``; a private name is never re-exported (import it from the module that defines it).
    Submodules a package imports to load them aside."""
    shims = _shims(SRC, SRC.parents[1])
    assert shims == [], "\n".join(shims)


def test_the_shim_check_finds_a_shim(tmp_path):
    """The check above can fail: a package that re-exports a private name and a public one nothing takes from it
    is caught twice; once some code imports the public name through it, only the private one."""
    pkg = tmp_path / "src" / "remat" / "pkg"
    pkg.mkdir(parents=True)
    (tmp_path / "src" / "remat" / "__init__.py").write_text('"""remat."""\n')
    (pkg / "a.py").write_text("_x = 1\ny = 2\n")
    (pkg / "__init__.py").write_text("from remat.pkg.a import _x, y  # noqa: F401 - re-exported\n")
    src, root = tmp_path / "src" / "remat", tmp_path
    assert _shims(src, root) == ["remat.pkg: _x (from remat.pkg.a)", "remat.pkg: y (from remat.pkg.a)"]
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_y.py").write_text("import remat.pkg as p\n\nprint(p.y)\n")
    assert _shims(src, root) == ["remat.pkg: _x (from remat.pkg.a)"]

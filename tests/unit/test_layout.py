"""The house by stage (Issue #38): ``ls src/remat`` shows the pipeline, and every room says what comes in and
what goes out."""

import ast
from pathlib import Path

import remat

SRC = Path(remat.__file__).parent


def _entries() -> list[Path]:
    return sorted(p for p in SRC.iterdir()
                  if p.name not in ("__init__.py", "__main__.py", "__pycache__") and not p.name.endswith(".pyc"))


def test_the_top_level_holds_at_most_fourteen_rooms_each_named_in_the_package_docstring():
    entries = _entries()
    assert len(entries) <= 14, [p.name for p in entries]
    for p in entries:
        name = p.name + "/" if p.is_dir() else p.stem
        assert name in remat.__doc__, f"{name} is not named in remat's docstring"


def test_every_room_has_a_docstring():
    for p in _entries():
        path = p / "__init__.py" if p.is_dir() else p
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.relative_to(SRC)} has no docstring"

"""Write docs/reference.md from remat's docstrings: every name in ``remat.__all__`` with its signature and
docstring; for classes, their public methods and properties, and the ``#:`` comments of dataclass fields.

    python scripts/api_reference.py          # rewrite docs/reference.md
    python scripts/api_reference.py --check  # exit 1 when docs/reference.md is not what this writes

tests/unit/test_docs.py runs the check, so the reference cannot fall behind the code.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference.md"


def _signature(obj) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    return re.sub(r" at 0x[0-9a-f]+", "", sig)


def _doc(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    return textwrap.dedent(doc).strip()


def _field_comments(cls) -> dict[str, str]:
    """The ``#:`` comment lines above each field of a dataclass, by field name."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        m = re.match(r"(\w+)\s*:", stripped)
        if m and pending:
            out[m.group(1)] = " ".join(pending)
        pending = []
    return out


def _block(text: str) -> list[str]:
    return [text, ""] if text else []


def render() -> str:
    sys.path.insert(0, str(ROOT / "src"))
    import remat

    lines = ["# API reference", "",
             "Generated from the docstrings by `python scripts/api_reference.py` (a test checks it is current). "
             "Units are in the names: `*_bytes` are bytes, `*_s` seconds, `budget_gb` GiB (2**30 bytes). "
             "See [the Python API](api.md) for an overview.", ""]
    for name in remat.__all__:
        obj = getattr(remat, name)
        kind = "class" if inspect.isclass(obj) else "function"
        lines += [f"## `remat.{name}`", ""]
        if kind == "function":
            lines += [f"```python\nremat.{name}{_signature(obj)}\n```", ""] + _block(_doc(obj))
            continue
        base = next((b.__name__ for b in obj.__mro__[1:] if b.__module__.startswith("remat")), None)
        lines += _block(f"*class*{f' (a {base})' if base else ''}")
        lines += _block(_doc(obj))
        if dataclasses.is_dataclass(obj):
            comments = _field_comments(obj)
            rows = [f"| `{f.name}` | {comments.get(f.name, '')} |" for f in dataclasses.fields(obj)]
            lines += ["| field | meaning |", "|---|---|", *rows, ""]
        elif not issubclass(obj, Exception):
            init = obj.__dict__.get("__init__")
            if init is not None:
                lines += [f"```python\nremat.{name}{_signature(obj)}\n```", ""] + _block(_doc(init))
        for attr, member in sorted(vars(obj).items()):
            if attr.startswith("_"):
                continue
            if isinstance(member, property):
                lines += [f"- `{attr}` (property): {_doc(member.fget).splitlines()[0] if _doc(member.fget) else ''}"]
            elif inspect.isfunction(member) or isinstance(member, (classmethod, staticmethod)):
                fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                doc = _doc(fn)
                lines += [f"- `{attr}{_signature(fn)}`" + (f": {doc}" if doc else "")]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run python scripts/api_reference.py")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

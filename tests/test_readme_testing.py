"""The README's "Testing your models" examples, run as they are written.

Each Python block of the section is a complete test module: it is compiled with its
README line numbers (so a failure points into the README) and run in a namespace of its
own, and its ``test_*`` functions are collected here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).parent.parent / "README.md"
SECTION = "## Testing your models"


def _blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, code) of each Python block in the section."""
    start = text.index(f"\n{SECTION}\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    first_line = text[:start].count("\n") + 1
    return [
        (first_line + section[: m.start(1)].count("\n"), m.group(1))
        for m in re.finditer(r"```python\n(.*?)```", section, re.DOTALL)
    ]


def _collect() -> dict[str, Any]:
    tests: dict[str, Any] = {}
    blocks = _blocks(README.read_text())
    assert len(blocks) >= 6, "the README's testing examples went missing"
    for line, code in blocks:
        namespace: dict[str, Any] = {"__name__": f"readme_line_{line}"}
        exec(compile("\n" * (line - 1) + code, str(README), "exec"), namespace)
        found = {name: f for name, f in namespace.items() if name.startswith("test_")}
        assert found, f"the README block at line {line} defines no test"
        assert not found.keys() & tests.keys(), f"README tests share a name: {found.keys()}"
        tests.update(found)
    return tests


globals().update(_collect())

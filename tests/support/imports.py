"""What a Python file imports, read from its source (nothing is imported)."""

from __future__ import annotations

import ast
from pathlib import Path


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Modules `path` imports (every import, or only those that run when it is imported)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found

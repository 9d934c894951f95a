"""Writing a generated block into docs/benchmarks.md, between markers, keeping the rest."""

from __future__ import annotations

import os


def replace_section(path: str, section: str, begin: str, end: str, generated: str) -> None:
    """Put ``generated`` (which starts with ``begin`` and ends with ``end``) in place of the
    previous block, or append it under the heading ``section``."""
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    if begin in text:
        before, rest = text.split(begin, 1)
        text = before + generated + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + f"\n\n{section}\n\n{generated}\n"
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}")

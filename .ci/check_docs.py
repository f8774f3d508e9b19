#!/usr/bin/env python3
"""Check that the Markdown lists of the documentation render as lists (stdlib only).

Python-Markdown, which MkDocs uses, differs from GitHub in two ways that silently turn a list into run-on text:

1. A list must be separated from a paragraph (or a table) above it by a blank line. Without it, the items are
   glued onto the paragraph as text.
2. A nested list must be indented by four spaces. Items indented by one to three spaces become siblings of the
   outer list, losing their nesting.
3. A fenced code block inside a list item must be indented by four spaces too; one indented by one to three spaces
   ends the list, and what follows it in the item becomes an indented code block.

This script flags all three, printing `file:line: message`, and exits 1 if anything was found. Fenced code blocks are
skipped. Usage: `python .ci/check_docs.py [FILES or FOLDERS...]` (default: `docs/` and `benchmarks/README.md`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PATHS = [ROOT / "docs", ROOT / "benchmarks" / "README.md"]

LIST_ITEM = re.compile(r"^(?P<indent> *)(?:[-*+]|\d{1,9}[.)])(?: +|$)")
FENCE = re.compile(r"^ *(`{3,}|~{3,})")
HEADING = re.compile(r"^ {0,3}#{1,6}(?: |$)")
TABLE_ROW = re.compile(r"^ *\|")
HORIZONTAL_RULE = re.compile(r"^ {0,3}([-*_])( *\1){2,} *$")


def check_file(path: Path) -> list[str]:
    problems = []
    lines = path.read_text(encoding="utf-8").splitlines()
    fence = None  # the opening fence's marker while inside a fenced block
    in_list = False  # inside a list: its items may follow one another, or continuation lines, directly
    previous = ""  # the previous line outside code fences ("" when blank)
    for number, line in enumerate(lines, start=1):
        match = FENCE.match(line)
        if fence is not None:
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = None
            continue
        if match:
            fence = match.group(1)
            indent = len(line) - len(line.lstrip(" "))
            if in_list and 0 < indent < 4:
                problems.append(
                    f"{path}:{number}: code fence indented by {indent} space(s) inside a list: indent it by 4 "
                    "spaces (and leave a blank line before it), or it ends the list"
                )
            previous = line
            continue
        if not line.strip():
            previous = ""
            continue
        item = LIST_ITEM.match(line)
        if item and not HORIZONTAL_RULE.match(line):
            indent = len(item.group("indent"))
            if not in_list and previous and not HEADING.match(previous):
                what = "a table" if TABLE_ROW.match(previous) else "a paragraph"
                problems.append(
                    f"{path}:{number}: list item directly after {what} line: add a blank line before the list, "
                    "or it renders as run-on text"
                )
            elif in_list and 0 < indent < 4:
                problems.append(
                    f"{path}:{number}: list item indented by {indent} space(s): nest it by 4 spaces (or put it at "
                    "the margin), or Python-Markdown makes it a sibling of the outer list"
                )
            in_list = True
        elif in_list and not previous and not line.startswith(" "):
            in_list = False  # a paragraph at the margin after a blank line ends the list
        elif not in_list and not previous:
            in_list = False
        previous = line
    return problems


def markdown_files(paths: list[Path]) -> list[Path]:
    files = []
    for path in paths:
        files.extend(sorted(path.rglob("*.md")) if path.is_dir() else [path])
    return files


def main(argv: list[str]) -> int:
    paths = [Path(arg) for arg in argv] or DEFAULT_PATHS
    problems = []
    for path in markdown_files(paths):
        problems.extend(check_file(path))
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} list problem(s) in the documentation", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

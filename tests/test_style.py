"""The shape the files keep, checked so that it stays: ruff (lines <= 120 characters, no unused imports, pyflakes);
each top-level file's module docstring at most 40 lines and its docstrings at most 0.3 lines per line of code;
README.md at most 200 lines, every file it links to present."""
import ast
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

# Every top-level file: the algorithms, and the shared modules they are read beside
ALGORITHMS = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))


def docstring_measure(path):
    """(module docstring lines, all docstring lines / code lines): code lines are the non-blank lines that are
    neither docstrings nor comments."""
    source = open(path).read()
    doc_lines, module_doc = set(), 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            constant = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            if constant and isinstance(first.value.value, str):
                lines = range(first.lineno, first.end_lineno + 1)
                doc_lines.update(lines)
                module_doc = len(lines) if isinstance(node, ast.Module) else module_doc
    code = sum(1 for i, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in doc_lines)
    return module_doc, len(doc_lines) / code


def test_ruff_passes():
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_docstrings_frame_the_code_and_do_not_bury_it(name):
    module_doc, ratio = docstring_measure(os.path.join(ROOT, f"{name}.py"))
    assert module_doc <= 40, f"{name}.py: module docstring of {module_doc} lines (at most 40)"
    assert ratio <= 0.3, f"{name}.py: {ratio:.2f} docstring lines per code line (at most 0.3)"


def test_the_readme_is_a_first_page_and_its_links_resolve():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert len(text.splitlines()) <= 200, len(text.splitlines())
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://", target):
            assert os.path.exists(os.path.join(ROOT, target)), target

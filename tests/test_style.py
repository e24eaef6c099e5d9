"""The shape the files keep, checked so that it stays: ruff (every file's lines <= 100 columns,
no unused imports, pyflakes); a top-level file's module docstring at most 40 lines and its
docstrings at most 0.3 lines per line of code; the shared modules importing downwards only, at their
top; model.py a model (at most 560 lines, kernels/ its only project import); README.md at most 200
lines, every file it links to present."""
import ast
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

# Every top-level file: the algorithms, and the shared modules they are read beside
ALGORITHMS = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))
# ... and the shared modules in folders (hf/, plumbing/)
FILES = ALGORITHMS + sorted(f"{d}/{f[:-3]}" for d in ("hf", "plumbing")
                            for f in os.listdir(os.path.join(ROOT, d))
                            if f.endswith(".py") and f != "__init__.py")


def docstring_measure(path):
    """(module docstring lines, all docstring lines / code lines): code lines are the non-blank
    lines that are neither docstrings nor comments."""
    source = open(path).read()
    doc_lines, module_doc = set(), 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef,
                             ast.ClassDef)) and node.body:
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
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]


@pytest.mark.parametrize("name", FILES)
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


# The shared modules, lowest first: each imports only modules before it (no cycle, no import back
# up from a folder), at its top (no import hidden in a function to dodge one)
LAYERS = ["kernels", "tasks", "model", "lora", "hf.sandbox", "hf.chat", "hf.tools", "hf.tokenizer",
          "hf.checkpoint", "sampler", "episode", "task", "evaluation", "plumbing.live",
          "plumbing.flags", "plumbing.parking", "plumbing.distributed", "plumbing.lock",
          "plumbing.loading", "plumbing.run", "plumbing.plot", "plumbing"]
PACKAGES = {"hf": "hf.sandbox", "plumbing": "plumbing"}     # a package's name, as its lowest room


def module_path(name):
    return os.path.join(ROOT, *name.split(".")) + ".py" if name != "plumbing" else \
        os.path.join(ROOT, "plumbing", "__init__.py")


def project_imports(path):
    """(module imported, at the top level?) for every import of a project module in `path`:
    `from hf import chat` and `from hf.chat import X` are both hf.chat."""
    tree = ast.parse(open(path).read())
    top = {id(n) for n in tree.body}
    names = set(LAYERS) | set(ALGORITHMS)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            mods = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names
                    else node.module for a in node.names]
        else:
            continue
        for m in mods:
            m = m if m in names else m.split(".")[0]
            if m in names or m in PACKAGES:
                out.append((m, id(node) in top))
    return out


@pytest.mark.parametrize("name", LAYERS[2:])
def test_the_shared_modules_import_downwards_and_at_their_top(name):
    for module, at_top in project_imports(module_path(name)):
        assert at_top, f"{name} imports {module} inside a function"
        module = PACKAGES.get(module, module) if module != name.split(".")[0] else module
        assert module in LAYERS and LAYERS.index(module) < LAYERS.index(name), \
            f"{name} imports {module}, which is not below it ({' < '.join(LAYERS)})"


def test_the_root_shows_the_algorithms():
    """The root's .py files: the algorithms, the two commands and at most seven shared files; every
    other shared module sits in hf/ or plumbing/."""
    shared = {m for m in LAYERS if "." not in m and os.path.exists(module_path(m))}
    assert shared <= {"model", "lora", "sampler", "episode", "task", "evaluation",
                      "plumbing"}
    root = {m for m in ALGORITHMS if m not in ("export", "gguf_to_hf")}
    assert len(root & shared) <= 6, sorted(root & shared)
    for folder in PACKAGES:
        files = {f[:-3] for f in os.listdir(os.path.join(ROOT, folder)) if f.endswith(".py")}
        assert {f"{folder}.{f}" for f in files - {"__init__"}} <= set(LAYERS), folder


# A main reads as the algorithm's steps: what several scripts do alike lives in the plumbing
MAIN_LINES = {"grpo": 110, "reinforce": 110, "rloo": 110, "ppo": 140}


@pytest.mark.parametrize("name", MAIN_LINES)
def test_a_scripts_main_is_its_steps(name):
    tree = ast.parse(open(os.path.join(ROOT, f"{name}.py")).read())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    lines = main.end_lineno - main.lineno + 1
    assert lines <= MAIN_LINES[name], f"{name}.py: main() is {lines} lines (at most " \
                                      f"{MAIN_LINES[name]})"


def test_model_py_is_a_model():
    """model.py holds the model (at most 570 lines) and imports kernels/ alone of the project."""
    path = os.path.join(ROOT, "model.py")
    assert len(open(path).read().splitlines()) <= 570
    assert {m for m, _ in project_imports(path)} <= {"kernels"}
    assert docstring_measure(path)[0] <= 25


def test_every_files_tests_are_in_the_table():
    """tests/README.md's table names the tests of every file of the root, hf/, plumbing/, tasks/
    and kernels/; every test file it names exists, and every test file is named in it."""
    text = open(os.path.join(ROOT, "tests", "README.md")).read()
    covered, named = set(), set()
    for files, tests in re.findall(r"^\| (.+?) \| (.+?) \|$", text, re.M):
        covered |= set(re.findall(r"`([\w/]+\.py)`", files))
        named |= set(re.findall(r"`(test_\w+\.py)`", tests))
    project = {f for f in os.listdir(ROOT) if f.endswith(".py")} | {
        f"{d}/{f}" for d in ("hf", "plumbing", "tasks", "kernels")
        for f in os.listdir(os.path.join(ROOT, d)) if f.endswith(".py") and f != "__init__.py"}
    assert not project - covered, f"not in tests/README.md's table: {sorted(project - covered)}"
    tests = {f for f in os.listdir(os.path.join(ROOT, "tests"))
             if f.startswith("test_") and f.endswith(".py")}
    assert not named - tests, f"named in the table, not in tests/: {sorted(named - tests)}"
    assert not tests - named, f"in no row of the table: {sorted(tests - named)}"

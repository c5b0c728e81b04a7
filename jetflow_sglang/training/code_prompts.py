"""Code-completion prompts from the Python standard library, for regenerated training data.

HumanEval is evaluation only, and ShareGPT's prompts are chat. To draft raw code
completions the head needs the target's own code, so this set gives it HumanEval-shaped
prompts the target can finish: a module's imports, then a function's signature and
docstring (a method's after its class line), cut where the body begins. Every top-level
function and method of the running interpreter's standard library that has a docstring
and a body gives one prompt. They come shuffled by a hash of their
id, so that the first N (`--limit`) sample every module, and in the same order on one
Python version.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from pathlib import Path

from jetflow_sglang.training.data import Prompt

MIN_DOC_CHARS = 40
MAX_DOC_CHARS = 1200
MAX_IMPORT_LINES = 12
SKIPPED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__", "turtledemo"}


def _module_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if not SKIPPED_DIRS.intersection(p.relative_to(root).parts[:-1]))


def _function_prompts(path: Path, root: Path) -> list[Prompt]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = source.splitlines()
    imports = [ast.get_source_segment(source, node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    header = "\n".join(line for line in imports[:MAX_IMPORT_LINES] if line and "\n" not in line)
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    functions = [(node, None) for node in tree.body]
    functions += [(item, node) for node in tree.body if isinstance(node, ast.ClassDef) for item in node.body]
    prompts = []
    for node, owner in functions:
        if not isinstance(node, ast.FunctionDef) or len(node.body) < 2:
            continue
        doc = ast.get_docstring(node)
        if doc is None or not MIN_DOC_CHARS <= len(doc) <= MAX_DOC_CHARS:
            continue
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        text = "\n".join(lines[start - 1 : node.body[0].end_lineno]) + "\n"
        if owner is not None:  # a method: its class header (all its lines), then the method
            header_end = max(owner.body[0].lineno - 1, owner.lineno)
            text = "\n".join(lines[owner.lineno - 1 : header_end]) + "\n" + text
        if header:
            text = header + "\n\n\n" + text
        name = f"{owner.name}.{node.name}" if owner is not None else node.name
        prompts.append(Prompt(id=f"{module}.{name}:{node.lineno}", text=text, kind="code"))
    return prompts


def python_stdlib_prompts(root: str | Path | None = None) -> list[Prompt]:
    """Signature + docstring of every documented stdlib function and method with a body."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    prompts = [prompt for path in _module_files(root) for prompt in _function_prompts(path, root)]
    return sorted(prompts, key=lambda prompt: hashlib.sha256(prompt.id.encode()).hexdigest())

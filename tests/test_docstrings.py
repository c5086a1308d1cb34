"""Every function or method under src/fastmm (fastmm.bench aside) that takes more than three
parameters names each of them in an ``Args:`` list of its docstring (issue 52); an ``__init__``
may have the list in its class docstring instead. Pure AST: nothing is imported, so the check
runs in a fraction of a second."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "fastmm"
MOST_WITHOUT_ARGS = 3  # parameters a function may take without an Args list


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Its parameters by name (``*args`` and ``**kwargs`` too), self and cls left out."""
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    return names + [x.arg for x in (a.vararg, a.kwarg) if x is not None]


def _listed(doc: str) -> set[str] | None:
    """The names an ``Args:`` list gives (``a, b: ...`` names two; ``*``, ``**`` and backquotes
    dropped), or None where the docstring has none. An entry is a line at the list's own indent
    under ``Args:``; the list ends at the first line back at the indent of ``Args:``."""
    lines = doc.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == "Args:"]
    if not starts:
        return None
    names: set[str] = set()
    for start in starts:
        outer = len(lines[start]) - len(lines[start].lstrip())
        inner = None
        for line in lines[start + 1:]:
            if not line.strip():
                continue
            indent = len(line) - len(line.lstrip())
            if indent <= outer:
                break
            inner = indent if inner is None else inner
            if indent == inner and ":" in line:
                head = line.strip().split(":", 1)[0]
                names.update(n.strip().strip("`").lstrip("*") for n in head.split(","))
    return names


def _functions():
    """(where, name, parameters, Args names or None) for every function at module or class
    level (nested functions are out of scope), from the source alone."""
    for path in sorted(SRC.rglob("*.py")):
        if "bench" in path.relative_to(SRC).parts:
            continue
        tree = ast.parse(path.read_text(), str(path))
        classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for cls in [None, *classes]:
            for node in (tree if cls is None else cls).body:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                docs = [ast.get_docstring(node) or ""]
                if cls is not None and node.name == "__init__":
                    docs.append(ast.get_docstring(cls) or "")  # the class may hold the list
                found = [names for names in map(_listed, docs) if names is not None]
                listed = set().union(*found) if found else None
                where = f"{path.relative_to(SRC.parent)}:{node.lineno}"
                name = f"{cls.name}.{node.name}" if cls is not None else node.name
                yield where, name, _parameters(node), listed


def test_functions_of_many_parameters_list_them_under_args():
    functions = list(_functions())
    assert len(functions) > 100  # the walk found the package
    problems = []
    for where, name, params, listed in functions:
        if len(params) <= MOST_WITHOUT_ARGS:
            continue
        if listed is None:
            problems.append(f"{where} {name}: no Args list for {', '.join(params)}")
        elif missing := [p for p in params if p not in listed]:
            problems.append(f"{where} {name}: its Args list lacks {', '.join(missing)}")
    assert not problems, ("docstrings without an Args list for every parameter (issue 52):\n"
                          + "\n".join(problems))

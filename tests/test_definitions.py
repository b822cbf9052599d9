"""No Python module of the project defines a function or class twice in one scope (a module's top
level or a class body): the later definition silently replaces the earlier, and a test so shadowed
is never collected (tests/test_cuda_sources.py had one until 2026-12-01). Property setters, which
reuse their getter's name by design, are allowed."""
import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "lossless_hc").rglob("*.py"), *(ROOT / "plugins").glob("*.py"),
                  *(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").glob("*.py")])


def _defined_twice(body) -> list:
    def is_accessor(node):
        return any(isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter") for d in node.decorator_list)
    names = collections.Counter(n.name for n in body
                                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                                and not is_accessor(n))
    return sorted(name for name, count in names.items() if count > 1)


def test_no_function_or_class_is_defined_twice_in_one_scope():
    assert len(SOURCES) > 100, SOURCES   # the globs found the project
    found = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        scopes = [("module", tree.body)] + [(f"class {c.name}", c.body) for c in ast.walk(tree)
                                            if isinstance(c, ast.ClassDef)]
        for scope, body in scopes:
            found += [f"{path.relative_to(ROOT)} ({scope}): {name}" for name in _defined_twice(body)]
    assert not found, found

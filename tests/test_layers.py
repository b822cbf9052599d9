"""The package's layers (docs/DESIGN.md, "Layers"): every import inside lossless_hc (lossless_hc/ and
plugins/, installed as lossless_hc.plugins) points down or sideways within a package, never up; nothing
in the core imports the adapters or the benchmarks; and there is no import cycle between modules."""
import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "lossless_hc"

# Lower numbers are lower layers (pure layout math at the bottom, the benchmarks at the top).
LAYERS = {
    "lossless_hc.lhc.layout": 0, "lossless_hc.lhc.hashing": 0, "lossless_hc.lhc.sizing": 0, "lossless_hc.lhc.cost_model": 0,
    "lossless_hc.thc.table": 0, "lossless_hc.thc.layout": 0,
    "lossless_hc.backends": 1, "lossless_hc._C": 1, "lossless_hc._C_cuda": 1,
    "lossless_hc.lhc.codec": 2, "lossless_hc.lhc.status": 2, "lossless_hc.lhc.reference": 2,
    "lossless_hc.thc.codec": 2, "lossless_hc.thc": 2, "lossless_hc.lhc": 2,
    "lossless_hc.training": 3, "lossless_hc": 3.5, "lossless_hc.fuzz": 3.6, "lossless_hc.plugins": 4,
    "lossless_hc.bench": 5,
}


def layer(module: str) -> float:
    best = None
    for prefix, rank in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, rank)
    assert best is not None, f"no layer for {module}: add it to LAYERS"
    return best[1]


PLUGINS = ROOT / "plugins"   # installed as lossless_hc.plugins (setup.py's package_dir)


def modules():
    """(module name, path) of every module of the installed package: lossless_hc/ and plugins/."""
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path
    for path in sorted(PLUGINS.rglob("*.py")):
        parts = ["lossless_hc", "plugins"] + list(path.relative_to(PLUGINS).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


@functools.lru_cache(maxsize=None)
def known_modules() -> frozenset:
    """Every module name of :func:`modules`, listed once."""
    return frozenset(m for m, _ in modules())


def test_plugins_are_checked():
    names = dict(modules())
    for m in ("lossless_hc.plugins", "lossless_hc.plugins.ddp", "lossless_hc.plugins.fsdp",
              "lossless_hc.plugins.horovod", "lossless_hc.plugins.byteps", "lossless_hc.plugins._torch_dist"):
        assert m in names, sorted(names)


def _absolute(node: ast.ImportFrom, module: str, path: pathlib.Path) -> str:
    """The absolute module a (possibly relative) ``from ... import`` names."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(path: pathlib.Path, module: str, top_level_only: bool):
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    for node in nodes:
        source = _absolute(node, module, path) if isinstance(node, ast.ImportFrom) else ""
        if source.startswith("lossless_hc"):
            for alias in node.names:
                full = f"{source}.{alias.name}"
                yield full if (full in LAYERS or full in known_modules()) else source
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lossless_hc"):
                    yield alias.name


def test_imports_point_down():
    for module, path in modules():
        if module == "lossless_hc":      # the public names, re-exported
            continue
        for target in imports(path, module, top_level_only=False):
            assert layer(target) <= layer(module), f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"


def test_core_never_imports_adapters_or_benchmarks():
    for module, path in modules():
        if module.startswith("lossless_hc.bench"):
            continue
        # the adapters import each other (lossless_hc.plugins._torch_dist), never the benchmarks
        banned = ("lossless_hc.bench",) if module.startswith("lossless_hc.plugins") else \
            ("lossless_hc.plugins", "lossless_hc.bench")
        for target in imports(path, module, top_level_only=False):
            assert not target.startswith(banned), f"{module} imports {target}"


def test_no_import_cycles():
    graph = {m: set(t for t in imports(p, m, top_level_only=True) if t in dict(modules())) for m, p in modules()}
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for t in graph.get(m, ()):
            assert state.get(t) != "open", "import cycle: " + " -> ".join(stack + [m, t])
            if t not in state:
                visit(t, stack + [m])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [])

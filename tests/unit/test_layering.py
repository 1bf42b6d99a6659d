"""The code's shape, checked: imports point one way through the layers (docs/architecture.md), no import cycles
(function-level imports included), the router process loads no torch and the launcher none before its services
start, tests and benchmarks do not import each other, and no line of code is over 120 characters."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top: a module may import its own layer and the layers below it, never one above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("shared.errors", "shared.sampling_params", "shared.cache_dir", "shared.config", "shared.telemetry",
              "shared.metrics", "shared.metrics_server", "shared.tensor_codec", "shared.model_files",
              "shared.tree")),
    ("text", ("shared.tokenizer", "shared.detokenizer", "shared.text_output", "shared.tool_calls",
              "shared.tool_parsers", "shared.tool_stream", "shared.reasoning")),
    ("ops", ("shared.ops",)),
    ("quant", ("shared.quant",)),
    ("model", ("shared.model",)),
    ("kv", ("shared.kv",)),
    ("engine", ("shared.engine",)),
    ("spec", ("shared.spec",)),
    ("rpc", ("shared.rpc", "upesi")),
    ("clients", ("shared.shards", "shared.registry")),
    ("convert", ("shared.convert",)),
    ("testing", ("shared.testing",)),
    ("services", ("services",)),
]
SERVICES = ("router", "target", "draft", "experts")          # each its own process: none imports another


def layer_of(module: str) -> int | None:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (function-level and TYPE_CHECKING imports too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)     # `from pkg import module`
    return found


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for top in ("shared", "services") for p in (ROOT / top).rglob("*.py")}


def resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The project module an import names (a symbol import resolves to its module), or None if external."""
    while target:
        if target in modules:
            return target
        target = target.rpartition(".")[0]
    return None


def test_every_module_has_a_layer():
    missing = [m for m in project_modules() if layer_of(m) is None and m not in ("shared", "services")]
    assert not missing, f"modules outside every layer (add them to LAYERS and docs/architecture.md): {missing}"


def test_imports_point_down_the_layers():
    modules = project_modules()
    upward = []
    for name, path in sorted(modules.items()):
        mine = layer_of(name)
        if mine is None:
            continue
        for target in sorted(imports(path)):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                upward.append(f"{name} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_services_do_not_import_each_other():
    crossing = []
    for name, path in project_modules().items():
        parts = name.split(".")
        if len(parts) < 2 or parts[1] not in SERVICES:
            continue
        for target in imports(path):
            t = target.split(".")
            if t[0] == "services" and len(t) > 1 and t[1] in SERVICES and t[1] != parts[1]:
                crossing.append(f"{name} imports {target}")
    assert not crossing, "\n".join(sorted(crossing))


def test_no_import_cycles():
    modules = project_modules()
    graph = {m: sorted({r for t in imports(p) if (r := resolve(t, modules)) and r != m}) for m, p in modules.items()}
    # Tarjan's strongly connected components; a package's __init__ is not an edge to its own modules' imports
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def loaded_after(code: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules starting with `prefixes` that a fresh interpreter holds after running `code`."""
    code += f"\nimport sys\nprint(sorted(m for m in sys.modules if m == 'torch' or m.startswith({prefixes!r})))\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_the_router_process_loads_no_torch():
    code = ("import services.router.main, services.router.servicer, services.router.frontend\n"
            "import services.router.openai_api, services.router.http, services.router.auth\n"
            "from services.cli import build_parser\n"
            "build_parser(only='router').parse_args(['router', '--target', '127.0.0.1:1'])\n")
    bad = loaded_after(code, ("torch.", "shared.engine.", "shared.model."))
    assert bad == [], f"the router imports {bad}"


def test_the_launcher_checks_its_flags_without_torch():
    """`upesi serve` starts its services at once: torch (more than a second to import) is theirs to load."""
    code = ("from services.cli import build_parser\n"
            "from services.launcher import ServeConfig\n"
            "from shared.config import config_from_args\n"
            "args = build_parser(only='serve').parse_args(['serve', '--draft', 'eagle:models/eagle-smollm2-135m',\n"
            "                                              '--draft-tree-nodes', '5', '--dtype', 'auto'])\n"
            "config_from_args(ServeConfig, args)\n")
    bad = loaded_after(code, ("torch.",))
    assert bad == [], f"the launcher imports {bad[:10]}"


def test_tests_and_benchmarks_do_not_import_each_other():
    crossing = []
    for top, other in (("tests", "bench"), ("bench", "tests")):
        for path in (ROOT / top).rglob("*.py"):
            for target in imports(path):
                if target == other or target.startswith(other + "."):
                    crossing.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not crossing, "shared helpers belong in shared/testing:\n" + "\n".join(sorted(crossing))


def test_test_modules_do_not_import_each_other():
    """Helpers several tests need live in shared/testing, fixtures in tests/conftest.py."""
    crossing = [f"{path.relative_to(ROOT)} imports {target}" for path in (ROOT / "tests").rglob("*.py")
                for target in imports(path)
                if target.startswith("tests.") and not (target + ".").startswith("tests.conftest.")]
    assert not crossing, "shared helpers belong in shared/testing:\n" + "\n".join(sorted(crossing))


def test_lines_are_at_most_120_characters():
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    code = [f for f in files if f.endswith((".py", ".c", ".h", ".proto", ".yaml", ".yml", ".sh", ".toml"))
            or Path(f).name in ("Makefile", "Dockerfile")]
    long = []
    for f in code:
        path = ROOT / f
        if not path.is_file() or f.startswith("upesi/"):              # generated gRPC stubs
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if len(line) > 120:
                long.append(f"{f}:{n} ({len(line)})")
    assert not long, "lines over 120 characters:\n" + "\n".join(long)

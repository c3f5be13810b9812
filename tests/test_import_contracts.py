"""The layering rules of shared/DESIGN.md as checks over the package's real imports (every ``import`` statement of
every module, function-level and ``if TYPE_CHECKING:`` ones included, read with ``ast``), plus the pure scheduler
imported with torch blocked."""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tokenmill"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def import_graph() -> dict[str, set[str]]:
    """tokenmill module -> every module name it imports (absolute; ``from a import b`` counts a.b and a)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name, imported = _module_name(path), set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                imported.add(base)
                imported.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = imported
    return graph


def internal(name: str) -> str | None:
    """The tokenmill module an imported name refers to (a module, or the module holding an imported attribute)."""
    graph = import_graph()
    while name and name not in graph:
        name = name.rpartition(".")[0]
    return name or None


def closure(root: str) -> set[str]:
    """Every name imported by ``root`` and, transitively, by the tokenmill modules it imports."""
    seen, todo, names = set(), [root], set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in import_graph()[module]:
            names.add(name)
            if (target := internal(name)) is not None:
                todo.append(target)
    return names


def modules_under(prefix: str) -> list[str]:
    return sorted(m for m in import_graph() if m == prefix or m.startswith(prefix + "."))


def top(name: str) -> str:
    return name.split(".")[0]


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "tokenmill.engine.core" in graph and "tokenmill.scheduler.scheduler" in graph
    assert "tokenmill.scheduler.output" in graph["tokenmill.scheduler.scheduler"]


@pytest.mark.parametrize("module", modules_under("tokenmill.scheduler"))
def test_scheduler_reaches_neither_torch_nor_models(module):
    reached = closure(module)
    assert not {n for n in reached if top(n) in ("torch", "numpy", "triton")}, module
    assert not {n for n in reached if within(n, ("tokenmill.models", "tokenmill.engine", "tokenmill.kernels",
                                                  "tokenmill.server"))}, module


SERVER_MAY_IMPORT = ("tokenmill.engine.client", "tokenmill.engine.messages", "tokenmill.engine.footprint", "tokenmill.sampling.params",
                     "tokenmill.structured.spec", "tokenmill.structured.errors", "tokenmill.structured.checker",
                     "tokenmill.tools", "tokenmill.config", "tokenmill.model_specs", "tokenmill.logs", "tokenmill.fair",
                     "tokenmill.server")


@pytest.mark.parametrize("module", modules_under("tokenmill.server"))
def test_server_imports_only_the_client_and_message_types(module):
    wrong = {n for n in import_graph()[module] if top(n) == "tokenmill" and not within(n, SERVER_MAY_IMPORT)}
    assert not wrong, f"{module} imports {wrong}"


@pytest.mark.parametrize("module", modules_under("tokenmill.kernels"))
def test_kernels_import_nothing_above_them(module):
    wrong = {n for n in import_graph()[module] if top(n) == "tokenmill" and not within(n, ("tokenmill.kernels",))}
    assert not wrong, f"{module} imports {wrong}"


def test_nothing_but_the_cli_imports_the_server():
    for module, names in import_graph().items():
        if not within(module, ("tokenmill.server", "tokenmill.cli")):
            assert not {n for n in names if within(n, ("tokenmill.server",))}, module


def test_only_the_server_imports_web_and_metrics_libraries():
    web = ("fastapi", "starlette", "uvicorn", "sse_starlette", "prometheus_client")
    for module, names in import_graph().items():
        if not within(module, ("tokenmill.server",)):
            assert not {n for n in names if top(n) in web}, module


@pytest.mark.parametrize("layer", ["tokenmill.kvcache", "tokenmill.sampling"])
def test_kvcache_and_sampling_import_no_upper_layer(layer):
    upper = ("tokenmill.engine", "tokenmill.server", "tokenmill.scheduler", "tokenmill.models", "tokenmill.llm")
    for module in modules_under(layer):
        assert not {n for n in import_graph()[module] if within(n, upper)}, module


def test_scheduler_imports_where_torch_cannot_be_imported():
    blocker = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('torch', 'numpy', 'triton'):\n"
               "            raise ImportError(f'{name} is blocked')\n"
               "sys.meta_path.insert(0, Block())\n"
               "import tokenmill.scheduler.scheduler, tokenmill.kvcache.block_pool, tokenmill.models.config\n"
               "assert 'torch' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_api_process_starts_without_torch_or_xgrammar():
    """The API process imports everything `tokenmill serve` needs before it spawns the engine, and none of it is torch,
    xgrammar or transformers (3 s of imports on 2 cores that would delay the engine's start): those load later, off
    the start-up path, where first needed."""
    code = ("import sys\n"
            "import tokenmill.cli, tokenmill.server.launch\n"
            "def serve(config):\n"  # `tokenmill serve`'s own path (its function-level imports too), up to serving
            "    loaded = [m for m in ('torch', 'xgrammar', 'transformers', 'triton') if m in sys.modules]\n"
            "    assert not loaded, loaded\n"
            "    return 7\n"
            "tokenmill.server.launch.serve = serve\n"
            "assert tokenmill.cli.main(['serve', '--port', '8123']) == 7\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("module", modules_under("tokenmill.speculative"))
def test_speculative_imports_nothing_above_it(module):
    """Proposers see a DraftContext of plain arrays (speculative/proposer.py), never the engine's types."""
    allowed = ("tokenmill.speculative", "tokenmill.kernels", "tokenmill.kvcache")
    wrong = {n for n in import_graph()[module] if top(n) == "tokenmill" and not within(n, allowed)}
    assert not wrong, f"{module} imports {wrong}"


@pytest.mark.parametrize("layer", ["tokenmill.structured", "tokenmill.tools"])
def test_grammar_and_tool_libraries_import_nothing_above_them(layer):
    """Pure libraries the server may import: they never reach the engine, the models or the server."""
    allowed = ("tokenmill.structured", "tokenmill.tools", "tokenmill.runtime")
    for module in modules_under(layer):
        wrong = {n for n in import_graph()[module] if top(n) == "tokenmill" and not within(n, allowed)}
        assert not wrong, f"{module} imports {wrong}"


def test_admission_is_api_side_policy():
    assert "tokenmill.server.admission" in import_graph() and "tokenmill.engine.admission" not in import_graph()
    assert not {n for n in closure("tokenmill.server.admission") if top(n) == "torch"}


def _cycles(modules: list[str]) -> list[list[str]]:
    """The strongly connected components of more than one module among ``modules`` (Tarjan's algorithm)."""
    edges = {m: sorted({t for n in import_graph()[m] if (t := internal(n)) in modules and t != m}) for m in modules}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for t in edges[m]:
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in on_stack:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            component = []
            while (t := stack.pop()) != m:
                on_stack.discard(t)
                component.append(t)
            on_stack.discard(m)
            if component:
                found.append(sorted(component + [m]))
    for m in modules:
        if m not in index:
            visit(m)
    return found


@pytest.mark.parametrize("layer", ["tokenmill.engine", "tokenmill.scheduler", "tokenmill.server",
                                   "tokenmill.speculative", "tokenmill.structured"])
def test_no_import_cycle_within_a_layer(layer):
    assert _cycles(modules_under(layer)) == []


def test_no_import_cycle_in_the_package():
    """Outside kernels/: there each op's dispatch imports its Triton kernel lazily (CPU users never import triton)
    and the kernel reads its reference's types and constants -- a pair per op, by design."""
    assert _cycles([m for m in sorted(import_graph()) if not within(m, ("tokenmill.kernels",))]) == []


def test_the_cycle_finder_finds_cycles(monkeypatch):
    fake = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    monkeypatch.setattr(sys.modules[__name__], "import_graph", lambda: fake)
    assert _cycles(sorted(fake)) == [["p.a", "p.b", "p.c"]]

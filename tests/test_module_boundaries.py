"""The module boundaries of the architecture (docs/design/architecture.md), held by a test.

Every import statement of every module of ours is read with ``ast.walk``, so an
import inside a function body, or under ``if TYPE_CHECKING:``, counts as much as
one at the top. Four kinds of rule:

1. **Layers.** A package is a folder of modules; :data:`MAY_IMPORT` names, for
   every package, the packages of ours its modules may import (itself always).
   Each package's ``__init__.py`` docstring says the same in a line
   ``May import: ...`` (``serving.*``: any package under ``serving``), and the
   test holds the two equal, so the docstrings cannot drift.
2. **Third-party reach.** :data:`NO_JAX` packages never reach JAX or Flax, and
   :data:`NO_HTTP` packages never reach the HTTP stack, through any chain of
   imports of ours (the chain is printed).
3. **No cycles**, between modules and between packages.
4. The model and kernels never ask JAX which platform they run on (the
   engine's backend policy decides, ``serving.engine.backend_policy``).

Plus one of size: no folder of ``serving/`` holds more than
:data:`MAX_MODULES_PER_FOLDER` modules.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "kernels_pallas", "kernels_cpu", "sharding", "serving", "benchmarks")

GATEWAY_BASE = {"serving.contract", "serving.config", "serving.output", "serving.core"}
MAY_IMPORT: dict[str, set[str]] = {
    "model": {"kernels_pallas"},
    "kernels_pallas": set(),
    "kernels_cpu": set(),
    "sharding": {"model", "kernels_pallas"},
    "benchmarks": {"*"},
    "serving": set(),
    # the contract and settings: the bottom
    "serving.contract": set(),
    "serving.config": set(),
    "serving.output": {"serving.contract"},
    # host planning, no JAX
    "serving.core": {"serving.contract", "serving.config"},
    "serving.core.kv": set(),
    "serving.core.sched": {"serving.config", "serving.core.kv"},
    # the device
    "serving.engine": {"model", "kernels_pallas", "kernels_cpu", "sharding", "serving.contract",
                       "serving.config",
                       "serving.core.sched", "serving.core.kv", "serving.engine.sample"},
    "serving.engine.sample": {"serving.contract", "serving.config", "serving.core.sched"},
    "serving.loading": {"model", "sharding", "serving.contract", "serving.config"},
    "serving.runtime": {"serving.contract", "serving.config", "serving.core", "serving.core.sched",
                        "serving.core.kv", "serving.engine", "serving.engine.sample"},
    # between processes
    "serving.rpc": {"serving.contract"},
    "serving.replica": {"model", "serving.contract", "serving.config", "serving.core.kv", "serving.engine",
                        "serving.runtime", "serving.rpc"},
    "serving.routing": {"serving.contract", "serving.core.kv", "serving.rpc"},
    # the HTTP gateway, bottom to top
    "serving.gateway.http": {"serving.contract"},
    "serving.gateway.accounts": {"serving.config", "serving.gateway.http"},
    "serving.gateway.services": GATEWAY_BASE | {"serving.gateway.http", "serving.gateway.accounts"},
    "serving.gateway.tools.tool_parsers": set(),
    "serving.gateway.tools": {"serving.gateway.tools.tool_parsers"},
    "serving.gateway.media": {"serving.contract", "serving.gateway.http"},
    "serving.gateway.schema": GATEWAY_BASE | {"serving.gateway.http", "serving.gateway.tools"},
    "serving.gateway.openai": GATEWAY_BASE | {"serving.gateway.http", "serving.gateway.accounts",
                                              "serving.gateway.services", "serving.gateway.tools",
                                              "serving.gateway.tools.tool_parsers", "serving.gateway.schema",
                                              "serving.gateway.media"},
    "serving.gateway.responses": GATEWAY_BASE | {"serving.gateway.http", "serving.gateway.accounts",
                                                 "serving.gateway.tools", "serving.gateway.schema",
                                                 "serving.gateway.openai", "serving.gateway.media"},
    "serving.gateway.anthropic": GATEWAY_BASE | {"serving.gateway.http", "serving.gateway.accounts",
                                                 "serving.gateway.tools", "serving.gateway.schema",
                                                 "serving.gateway.openai", "serving.gateway.media"},
    "serving.gateway.rerank": GATEWAY_BASE | {"serving.gateway.http", "serving.gateway.accounts",
                                              "serving.gateway.services", "serving.gateway.schema",
                                              "serving.gateway.openai"},
    "serving.gateway.console": {"serving.contract", "serving.gateway.http", "serving.gateway.accounts"},
    "serving.gateway.batch": GATEWAY_BASE | {"serving.gateway.http", "serving.gateway.accounts",
                                             "serving.gateway.openai"},
    "serving.gateway": GATEWAY_BASE | {"serving.gateway.*"},
    # the commands: the top
    "serving.cli": {"model", "sharding", "serving.*"},
}
"""{package: the packages of ours its modules may import}; ``P.*`` is any package under ``P``."""

JAX = ("jax", "jaxlib", "flax")
NO_JAX = ("serving.contract", "serving.config", "serving.output", "serving.core", "serving.rpc",
          "serving.routing", "serving.gateway")
"""Packages (with their subpackages) that never reach JAX, Flax, or what imports them."""

HTTP = ("fastapi", "starlette", "uvicorn", "httpx")
NO_HTTP = ("model", "kernels_pallas", "kernels_cpu", "sharding", "serving.contract", "serving.config",
           "serving.output",
           "serving.core", "serving.engine", "serving.runtime", "serving.loading", "serving.rpc",
           "serving.replica", "serving.routing")
"""Packages (with their subpackages) that never reach the HTTP stack: only the gateway and the
commands serve HTTP."""

MAX_MODULES_PER_FOLDER = 15

PLATFORM_QUERIES = ("default_backend", "devices", "local_devices", "platform", "device_count",
                    "local_device_count")
"""Attribute names that ask JAX (or a device) which platform this is."""


# ------------------------------------------------------------------ the import graph


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, name: str, is_package: bool = False) -> set[str]:
    """Every module an import statement anywhere in ``source`` names (function bodies
    included), relative imports resolved against module ``name``."""
    out = set()
    package = name if is_package or "." not in name else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # "from pkg import module"
    return out


def our_modules(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: the modules it imports} for every .py file of our packages."""
    graph = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            name = module_name(path, root)
            graph[name] = imports_of(path.read_text(), name, path.name == "__init__.py")
    return graph


def our_packages(root: Path = ROOT) -> set[str]:
    """Every folder of our packages that holds an ``__init__.py``, as a dotted name."""
    return {module_name(p, root) for pkg in PACKAGES for p in (root / pkg).rglob("__init__.py")}


def package_of(module: str, packages: set[str]) -> str:
    """The package whose folder holds ``module`` (a package's ``__init__`` is its own)."""
    return module if module in packages else module.rsplit(".", 1)[0]


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _allowed(target: str, allowed: set[str]) -> bool:
    return any(target == a or (a.endswith(".*") and _within(target, a[:-2]) and target != a[:-2])
               or a == "*" for a in allowed)


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """{module of ours reachable from ``start`` through imports: the module importing it}."""
    seen = {start: ""}
    todo = [start]
    while todo:
        mod = todo.pop()
        for imp in graph.get(mod, ()):
            if imp in graph and imp not in seen:
                seen[imp] = mod
                todo.append(imp)
    return seen


def _chain(via: dict[str, str], mod: str) -> str:
    chain = [mod]
    while via[chain[-1]]:
        chain.append(via[chain[-1]])
    return " <- ".join(chain)


# ------------------------------------------------------------------ the rules


def layer_violations(graph: dict[str, set[str]], packages: set[str],
                     may_import: dict[str, set[str]] = MAY_IMPORT) -> list[str]:
    """Every import of a package of ours that its importer's package may not import."""
    out = []
    for mod, imps in graph.items():
        src = package_of(mod, packages)
        for imp in imps:
            if imp not in graph:
                continue
            dst = package_of(imp, packages)
            if dst != src and not _allowed(dst, may_import.get(src, set())):
                out.append(f"{src} ↛ {dst}: {mod} imports {imp}")
    return sorted(set(out))


def reach_violations(graph: dict[str, set[str]], scopes: tuple[str, ...], forbidden: tuple[str, ...],
                     label: str) -> list[str]:
    """Every module of ``scopes`` that reaches an import of ``forbidden``, with the chain."""
    out = []
    for start in [m for m in graph if any(_within(m, s) for s in scopes)]:
        via = reachable(graph, start)
        for mod in via:
            for imp in graph[mod]:
                if any(_within(imp, f) for f in forbidden):
                    out.append(f"{start} ↛ {label} ({imp}): {_chain(via, mod)}")
    return sorted(set(out))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    return cycles({m: {i for i in imps if i in graph and i != m} for m, imps in graph.items()})


def package_cycles(graph: dict[str, set[str]], packages: set[str]) -> list[list[str]]:
    edges: dict[str, set[str]] = {}
    for mod, imps in graph.items():
        src = package_of(mod, packages)
        edges.setdefault(src, set()).update(
            d for d in (package_of(i, packages) for i in imps if i in graph) if d != src)
    return cycles(edges)


def stated_imports(root: Path = ROOT) -> dict[str, set[str] | None]:
    """{package: the packages its ``__init__.py`` docstring's ``May import:`` line names}
    (None: no such line). ``nothing of ours`` is the empty set."""
    out = {}
    for pkg in sorted(our_packages(root)):
        path = root / pkg.replace(".", "/") / "__init__.py"
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        m = re.search(r"May import: (.*?)(?:\n\n|$)", doc, re.S)
        if m is None:
            out[pkg] = None
            continue
        text = " ".join(m.group(1).split()).rstrip(".")
        out[pkg] = set() if text == "nothing of ours" else {
            p.strip().strip("`") for p in text.split(",")}
    return out


def platform_queries(root: Path = ROOT) -> list[str]:
    """``jax.default_backend()``, ``.platform``, ``jax.devices()``... in model/ or kernels_pallas/."""
    out = []
    for pkg in ("model", "kernels_pallas"):
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in PLATFORM_QUERIES:
                    out.append(f"{path.relative_to(root)}:{node.lineno}: .{node.attr}")
    return out


# ------------------------------------------------------------------ the tree holds them


def test_every_package_has_its_rule_and_its_docstring_states_it():
    packages = our_packages()
    assert {"serving.gateway.http", "serving.core.sched", "serving.engine.sample"} <= packages
    assert sorted(packages - set(MAY_IMPORT)) == [], "a new package needs its line in MAY_IMPORT"
    assert sorted(set(MAY_IMPORT) - packages) == [], "MAY_IMPORT names a package that is gone"
    stated = stated_imports()
    wrong = {p: (stated[p], MAY_IMPORT[p]) for p in sorted(packages) if stated[p] != MAY_IMPORT[p]}
    assert wrong == {}, "each __init__.py docstring's 'May import:' line must equal MAY_IMPORT"


def test_no_package_imports_above_its_layer():
    graph = our_modules()
    assert len(graph) > 200 and "serving.gateway.app" in graph
    assert layer_violations(graph, our_packages()) == []


def test_no_jax_in_the_host_side_and_no_http_below_the_gateway():
    graph = our_modules()
    assert reach_violations(graph, NO_JAX, JAX, "JAX") == []
    assert reach_violations(graph, NO_HTTP, HTTP, "HTTP") == []


def test_no_import_cycles():
    graph = our_modules()
    assert module_cycles(graph) == []
    assert package_cycles(graph, our_packages()) == []


def test_no_folder_of_serving_holds_more_than_15_modules():
    sizes = {str(d.relative_to(ROOT)): len([p for p in d.glob("*.py") if p.name != "__init__.py"])
             for d in [ROOT / "serving", *sorted((ROOT / "serving").rglob("*"))] if (d / "__init__.py").is_file()}
    assert {d: n for d, n in sizes.items() if n > MAX_MODULES_PER_FOLDER} == {}


def test_model_and_kernels_never_ask_the_platform():
    assert platform_queries() == []


# ------------------------------------------------------------------ the checks catch what they should


def test_a_planted_forbidden_import_is_caught():
    """An import a package may not make fails the layer rule, even hidden in a function
    body; reaching JAX through a module of ours fails the reach rule, with the chain."""
    graph, packages = our_modules(), our_packages()
    graph["serving.core.sched.scheduler"] = graph["serving.core.sched.scheduler"] | imports_of(
        "def plan():\n    from serving.engine.engine import Engine\n", "serving.core.sched.scheduler")
    assert ("serving.core.sched ↛ serving.engine: serving.core.sched.scheduler imports "
            "serving.engine.engine") in layer_violations(graph, packages)

    graph = our_modules()
    hidden = "def handler():\n    import jax.numpy as jnp\n    return jnp.zeros(1)\n"
    graph["serving.gateway.http.hidden"] = imports_of(hidden, "serving.gateway.http.hidden")
    assert any("serving.gateway.http.hidden ↛ JAX (jax.numpy)" in v
               for v in reach_violations(graph, NO_JAX, JAX, "JAX"))

    graph = our_modules()
    graph["serving.gateway.app"] = graph["serving.gateway.app"] | {"serving.core.helper"}
    graph["serving.core.helper"] = imports_of("def f():\n    from sharding import mesh\n", "serving.core.helper")
    assert "serving.core ↛ sharding: serving.core.helper imports sharding" in layer_violations(
        graph, packages | {"serving.core"})
    graph["serving.core.helper"] |= {"flax"}
    assert any(v.startswith("serving.gateway.app ↛ JAX (flax): serving.core.helper <- serving.gateway.app")
               for v in reach_violations(graph, NO_JAX, JAX, "JAX"))

    graph = our_modules()
    graph["model.hidden"] = imports_of("class M:\n    def f(self):\n        from serving.engine import engine\n",
                                       "model.hidden")
    assert any(v.startswith("model ↛ serving.engine") for v in layer_violations(graph, packages))


def test_a_planted_cycle_is_caught():
    """A function-level import back up the layers makes a module cycle and a package cycle."""
    graph, packages = our_modules(), our_packages()
    assert module_cycles(graph) == [] and package_cycles(graph, packages) == []
    graph["serving.gateway.http.errors"] = graph["serving.gateway.http.errors"] | imports_of(
        "def handler():\n    from serving.gateway.openai.openai_serving import read_json\n",
        "serving.gateway.http.errors")
    found = module_cycles(graph)
    assert any({"serving.gateway.http.errors", "serving.gateway.openai.openai_serving"} <= set(c) for c in found)
    assert any({"serving.gateway.http", "serving.gateway.openai"} <= set(c) for c in package_cycles(graph, packages))

    graph = our_modules()  # no module cycle, but kv -> sched -> kv between the packages
    graph["serving.core.kv.host_kv_cache"] = graph["serving.core.kv.host_kv_cache"] | {"serving.core.sched.step_plan"}
    assert module_cycles(graph) == []
    assert [c for c in package_cycles(graph, packages) if "serving.core.kv" in c] == [
        ["serving.core.kv", "serving.core.sched"]]


def test_a_docstring_that_drifts_from_the_rule_is_caught(tmp_path):
    pkg = tmp_path / "serving" / "thing"
    pkg.mkdir(parents=True)
    (tmp_path / "serving" / "__init__.py").write_text('"""x.\n\nMay import: nothing of ours.\n"""\n')
    (pkg / "__init__.py").write_text('"""Things.\n\nMay import: serving.contract,\n`serving.config`.\n"""\n')
    assert stated_imports(tmp_path) == {"serving": set(), "serving.thing": {"serving.contract", "serving.config"}}
    (pkg / "__init__.py").write_text('"""Things, with no rule stated."""\n')
    assert stated_imports(tmp_path)["serving.thing"] is None


def test_a_platform_query_in_the_model_is_caught(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "kernels_pallas").mkdir()
    (tmp_path / "model" / "layer.py").write_text(
        "import jax\n\ndef dot(a):\n    if jax.default_backend() == 'cpu':\n        return a\n")
    (tmp_path / "kernels_pallas" / "k.py").write_text("def f(x):\n    return x.devices()[0].platform\n")
    assert sorted(platform_queries(tmp_path)) == [
        "kernels_pallas/k.py:2: .devices", "kernels_pallas/k.py:2: .platform",
        "model/layer.py:4: .default_backend"]


@pytest.mark.parametrize("module", ["serving.gateway.app", "serving.core.sched.scheduler",
                                    "serving.output.output_processor", "serving.routing.router",
                                    "serving.rpc.remote_engine", "serving.cli.main"])
def test_importing_leaves_jax_out(module):
    code = (f"import sys, {module}\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'jaxlib', 'flax', 'model', 'kernels_pallas', 'kernels_cpu', 'sharding'))\n"
            "assert not bad, bad\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]

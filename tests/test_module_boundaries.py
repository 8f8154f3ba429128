"""The module boundaries of the architecture, held by a test.

Every import statement of every module of ours is read with ``ast.walk``, so an
import inside a function body counts as much as one at the top. A rule forbids
a module (and, through the imports of ours it makes, every module it reaches)
from importing certain packages:

    serving.gateway             ↛ jax, flax, model, kernels_pallas, sharding
    serving.core.sched.scheduler,
    serving.core.kv.kv_cache_manager,
    serving.core.kv.kv_events,
    serving.core.kv.host_kv_cache       ↛ jax, flax
    serving.rpc.remote_engine,
    serving.rpc.convert         ↛ jax, flax, model, kernels_pallas, sharding (the gateway's side of gRPC)
    model                       ↛ serving, sharding
    kernels_pallas              ↛ model, serving
    sharding                    ↛ serving
    serving                     ↛ benchmarks

and the model and kernels never ask JAX which platform they run on (the
engine's backend policy decides, ``serving.engine.backend_policy``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "kernels_pallas", "sharding", "serving", "benchmarks")

RULES = [
    ("serving.gateway", ("jax", "jaxlib", "flax", "model", "kernels_pallas", "sharding")),
    ("serving.core.sched.scheduler", ("jax", "jaxlib", "flax")),
    ("serving.core.kv.kv_cache_manager", ("jax", "jaxlib", "flax")),
    ("serving.core.kv.kv_events", ("jax", "jaxlib", "flax")),
    ("serving.core.kv.host_kv_cache", ("jax", "jaxlib", "flax")),
    ("serving.rpc.remote_engine", ("jax", "jaxlib", "flax", "model", "kernels_pallas", "sharding")),
    ("serving.rpc.convert", ("jax", "jaxlib", "flax", "model", "kernels_pallas", "sharding")),
    ("model", ("serving", "sharding")),
    ("kernels_pallas", ("model", "serving")),
    ("sharding", ("serving",)),
    ("serving", ("benchmarks",)),
]

PLATFORM_QUERIES = ("default_backend", "devices", "local_devices", "platform", "device_count",
                    "local_device_count")
"""Attribute names that ask JAX (or a device) which platform this is."""


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, name: str) -> set[str]:
    """Every module an import statement anywhere in ``source`` names (function bodies
    included), relative imports resolved against module ``name``."""
    out = set()
    package = name if name.count(".") == 0 else name.rsplit(".", 1)[0]
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
            graph[name] = imports_of(path.read_text(), name)
    return graph


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


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


def violations(graph: dict[str, set[str]], rules=RULES) -> list[str]:
    """Every (module, forbidden import) pair, with the chain of imports that reaches it."""
    out = []
    for scope, forbidden in rules:
        for start in [m for m in graph if _within(m, scope)]:
            via = reachable(graph, start)
            for mod in via:
                for imp in graph[mod]:
                    if any(_within(imp, f) for f in forbidden):
                        chain = [mod]
                        while via[chain[-1]]:
                            chain.append(via[chain[-1]])
                        out.append(f"{scope} ↛ {imp}: {' <- '.join(chain)}")
    return sorted(set(out))


def platform_queries(root: Path = ROOT) -> list[str]:
    """``jax.default_backend()``, ``.platform``, ``jax.devices()``... in model/ or kernels_pallas/."""
    out = []
    for pkg in ("model", "kernels_pallas"):
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in PLATFORM_QUERIES:
                    out.append(f"{path.relative_to(root)}:{node.lineno}: .{node.attr}")
    return out


def test_no_module_crosses_a_boundary():
    graph = our_modules()
    assert len(graph) > 50 and "serving.gateway.app" in graph
    assert violations(graph) == []


def test_model_and_kernels_never_ask_the_platform():
    assert platform_queries() == []


def test_an_import_inside_a_function_body_is_caught(tmp_path):
    """The checker fails on a violating import hidden in a function body, directly or
    through a module of ours that the gateway imports."""
    graph = our_modules()
    hidden = "def handler():\n    import jax.numpy as jnp\n    return jnp.zeros(1)\n"
    graph["serving.gateway.hidden"] = imports_of(hidden, "serving.gateway.hidden")
    assert any("serving.gateway ↛ jax.numpy" in v for v in violations(graph))

    graph = our_modules()
    graph["serving.gateway.app"] = graph["serving.gateway.app"] | {"serving.helper"}
    graph["serving.helper"] = imports_of("def f():\n    from sharding import mesh\n", "serving.helper")
    found = violations(graph)
    assert any("serving.gateway ↛ sharding" in v and "serving.helper <- serving.gateway.app" in v
               for v in found), found

    graph = our_modules()
    graph["model.hidden"] = imports_of("class M:\n    def f(self):\n        from serving import engine\n",
                                       "model.hidden")
    assert any("model ↛ serving" in v for v in violations(graph))


def test_a_platform_query_in_the_model_is_caught(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "kernels_pallas").mkdir()
    (tmp_path / "model" / "layer.py").write_text(
        "import jax\n\ndef dot(a):\n    if jax.default_backend() == 'cpu':\n        return a\n")
    (tmp_path / "kernels_pallas" / "k.py").write_text("def f(x):\n    return x.devices()[0].platform\n")
    assert sorted(platform_queries(tmp_path)) == [
        "kernels_pallas/k.py:2: .devices", "kernels_pallas/k.py:2: .platform",
        "model/layer.py:4: .default_backend"]


@pytest.mark.parametrize("module", ["serving.gateway.app", "serving.core.sched.scheduler", "serving.output.output_processor",
                                    "serving.routing.router", "serving.rpc.remote_engine"])
def test_importing_leaves_jax_out(module):
    code = (f"import sys, {module}\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'jaxlib', 'flax', 'model', 'kernels_pallas', 'sharding'))\n"
            "assert not bad, bad\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]

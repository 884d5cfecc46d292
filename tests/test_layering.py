"""Imports point down only (docs/design.md, "Layers"), and there are no import circles among qjax's modules.

Read from the source with `ast` (nothing is imported): every `import` / `from ... import` anywhere in a module, at top
level or inside a function, counts. Importing `qjax.a.b` also runs the package `qjax.a` (its `__init__`), so that
counts as an import of `qjax.a` too, except from inside `qjax.a` itself (already being imported then) and for the
root `qjax`, the public façade.
"""

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "qjax"

# (pattern on the dotted module name, group, rank), first match wins. A module may import modules of a lower rank
# and of its own group; groups of one rank do not import each other (kernels are leaves beside the references).
LAYERS = [
    (r"qjax\.(formats|numerics|stochastic|qtensor|codebooks)", "numerics", 0),
    (r"qjax\.kernels\.scaled_matmul", "references", 1),
    (r"qjax\.quantize", "references", 1),
    (r"qjax\.kernels(\..*_mgpu)?", "kernels", 1),
    (r"qjax\.data(\..*)?", "data", 1),
    (r"qjax\.dispatch", "dispatch", 2),
    (r"qjax\.(recipes|weight_sharding|dot_general|prologue|ragged_dot|flax|health)", "ops", 3),
    (r"qjax\.optim(\..*)?", "ops", 3),
    (r"qjax\.(gemm_rules|convert|gemm_report)", "convert", 3.5),  # quantize_model: above the ops it wraps
    (r"qjax", "api", 4),
    (r"qjax\.models(\..*)?", "models", 5),
    (r"qjax\.train(\..*)?", "train", 6),
    (r"qjax\.generate", "train", 6),  # the generation CLI: restores train.py checkpoints
]


def layer_of(module: str):
    for pattern, group, rank in LAYERS:
        if re.fullmatch(pattern, module):
            return group, rank
    return None


def module_names(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted name -> file for every module of the package at `root` (packages by their __init__.py)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(module: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package modules `module` imports, anywhere in its source, with the packages that run on the way."""
    is_package = path.name == "__init__.py"
    named = set()  # modules named by an import statement
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".")[:len(module.split(".")) - node.level + is_package]
                base = ".".join(package + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            named |= submodules
            if len(submodules) < len(node.names):  # names defined in `base` itself
                named.add(base)
    targets = {name for name in named if name in known}
    for name in named:  # the packages that run on the way: not the root façade, not this module's own packages
        parts = name.split(".")
        for i in range(2, len(parts)):
            parent = ".".join(parts[:i])
            if parent in known and not (module + ".").startswith(parent + "."):
                targets.add(parent)
    targets.discard(module)
    return targets


def problems(root: pathlib.Path) -> list[str]:
    """Every unlayered module, upward or sideways import, and import circle in the package at `root`."""
    names = module_names(root)
    graph = {module: imports_of(module, path, set(names)) for module, path in names.items()}
    found = [f"{module}: not in any layer (add it to LAYERS)" for module in names if layer_of(module) is None]
    for module, targets in sorted(graph.items()):
        if layer_of(module) is None:
            continue
        group, rank = layer_of(module)
        for target in sorted(targets):
            target_group, target_rank = layer_of(target) or ("?", 99)
            if target_group != group and target_rank >= rank:
                found.append(f"{module} ({group}) imports {target} ({target_group}), which is not below it")
    found += [f"import circle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each module that is on one (depth-first search)."""
    cycles, done, stack = [], set(), []

    def visit(module):
        if module in stack:
            cycles.append(stack[stack.index(module):] + [module])
            return
        if module in done:
            return
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            visit(target)
        stack.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    return cycles


def test_imports_point_down_and_there_are_no_circles():
    assert problems(PACKAGE) == []


def test_every_kernel_file_is_a_leaf():
    """Kernel files import only the numerics layer, other kernel files' helpers, jax and jaxlib (and the stdlib)."""
    names = module_names(PACKAGE)
    for module, path in names.items():
        if layer_of(module) != ("kernels", 1):
            continue
        for target in imports_of(module, path, set(names)):
            assert layer_of(target) in (("numerics", 0), ("kernels", 1)), (module, target)
        tree = ast.parse(path.read_text())
        roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
        roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert roots <= {"qjax", "jax", "jaxlib", "numpy", "dataclasses", "functools", "typing"}, (module, roots)


def _write(root, files):
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)


def test_the_checker_finds_upward_imports_and_circles(tmp_path):
    """On a small package: an upward import inside a function, a sideways one (kernel -> reference), and a circle
    through a package's __init__."""
    root = tmp_path / "qjax"
    _write(root, {
        "__init__.py": "",
        "numerics.py": "def f():\n    from qjax import dispatch\n",
        "quantize.py": "from qjax import numerics\n",
        "kernels/__init__.py": "",
        "kernels/quantize_mgpu.py": "from qjax.quantize import f\n",
        "dispatch.py": "from qjax.optim import adam\n",
        "optim/__init__.py": "from qjax.optim import adam\n",
        "optim/adam.py": "import qjax.optim.fused_adam\n",
        "optim/fused_adam.py": "from qjax.optim import adam\n",
    })
    found = problems(root)
    assert "qjax.numerics (numerics) imports qjax.dispatch (dispatch), which is not below it" in found
    assert "qjax.kernels.quantize_mgpu (kernels) imports qjax.quantize (references), which is not below it" in found
    assert "qjax.dispatch (dispatch) imports qjax.optim (ops), which is not below it" in found
    assert any(p.startswith("import circle:") and "qjax.optim.adam" in p and "qjax.optim.fused_adam" in p
               for p in found)
    assert not any("qjax.optim.adam (ops) imports qjax.optim " in p for p in found)  # its own package: fine


@pytest.mark.parametrize("module,layer", [("qjax.kernels.adam_step_mgpu", "kernels"), ("qjax.kernels", "kernels"),
                                          ("qjax.kernels.scaled_matmul", "references"), ("qjax", "api"),
                                          ("qjax.optim.fused_adam", "ops"), ("qjax.data.text", "data")])
def test_layer_names(module, layer):
    assert layer_of(module)[0] == layer

"""Imports point down only (docs/design.md, "Layers"), and there are no import circles among qjax's modules.

Read from the source with `ast` (nothing is imported): every `import` / `from ... import` anywhere in a module, at top
level or inside a function, counts, and so does a string naming a package module (a lazy import through importlib,
as `qjax.optim`'s `__getattr__` makes). Importing `qjax.a.b` also runs the package `qjax.a` (its `__init__`), so that
counts as an import of `qjax.a` too, except from inside `qjax.a` itself (already being imported then), for the root
`qjax`, the public façade, and for a package whose `__init__` has no import statement of a package module (it runs
nothing: its names load on first use).
"""

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "qjax"

# (pattern on the dotted module name, group, rank), first match wins. A module may import modules of a lower rank
# and of its own group; groups of one rank do not import each other (kernels are leaves beside the references,
# recipes are pure data beside them, the optimizer and the models stay apart).
LAYERS = [
    (r"qjax\.(formats|numerics|stochastic|qtensor)", "numerics", 0),
    (r"qjax\.optim\.(adam_math|codebooks)", "numerics", 0),  # the low-bit Adam formulas its kernel shares
    (r"qjax\.kernels\.scaled_matmul", "references", 1),
    (r"qjax\.quantize", "references", 1),
    (r"qjax\.kernels(\..*_mgpu)?", "kernels", 1),
    (r"qjax\.data(\..*)?", "data", 1),
    (r"qjax\.recipes", "recipes", 1),  # pure data: imports the numerics layer only
    (r"qjax\.weight_sharding", "weight sharding", 1),
    (r"qjax\.dispatch", "dispatch", 2),
    (r"qjax\.int8_params", "int8 params", 2),  # the int8 weight type: below the layers that read it
    (r"qjax\.linear_core", "linear core", 3),
    (r"qjax\.(dot_general|prologue|ragged_dot|health)", "ops", 4),
    (r"qjax\.flax", "flax", 5),
    (r"qjax\.(gemm_rules|convert|gemm_report)", "convert", 5.5),  # quantize_model: above the layers it wraps
    (r"qjax", "api", 6),
    (r"qjax\.models(\..*)?", "models", 7),
    (r"qjax\.optim(\..*)?", "optim", 7),
    (r"qjax\.train(\..*)?", "train", 8),
    (r"qjax\.generate", "train", 8),  # the generation CLI: restores train.py checkpoints
]
MAX_LINES = 400


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


def imports_of(module: str, path: pathlib.Path, known: set[str], inert: frozenset[str] = frozenset()) -> set[str]:
    """The package modules `module` imports, anywhere in its source, with the packages that run on the way (but
    not the `inert` ones, whose `__init__` imports nothing)."""
    is_package = path.name == "__init__.py"
    named = set()  # modules named by an import statement or a string
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
            named.add(node.value)
        elif isinstance(node, ast.Import):
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
            if parent in known and parent not in inert and not (module + ".").startswith(parent + "."):
                targets.add(parent)
    targets.discard(module)
    return targets


def inert_packages(names: dict[str, pathlib.Path]) -> frozenset[str]:
    """The packages whose `__init__` has no import statement naming a package module: importing one of their
    modules runs no other code of the package."""

    def imports_package_code(path):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "qjax" for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "qjax"):
                return True
        return False

    return frozenset(m for m, p in names.items() if p.name == "__init__.py" and not imports_package_code(p))


def graph_of(root: pathlib.Path) -> dict[str, set[str]]:
    names = module_names(root)
    inert = inert_packages(names)
    return {module: imports_of(module, path, set(names), inert) for module, path in names.items()}


def private_imports(root: pathlib.Path) -> list[str]:
    """`from qjax.a import _name` in a module other than qjax.a: a helper shared across modules needs a public name
    in the module both build on."""
    found = []
    for module, path in module_names(root).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qjax") and node.module != module:
                found += [f"{module} imports {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return found


def problems(root: pathlib.Path) -> list[str]:
    """Every unlayered module, upward or sideways import, private import across modules and import circle in the
    package at `root`."""
    names = module_names(root)
    graph = graph_of(root)
    found = [f"{module}: not in any layer (add it to LAYERS)" for module in names if layer_of(module) is None]
    for module, targets in sorted(graph.items()):
        if layer_of(module) is None:
            continue
        group, rank = layer_of(module)
        for target in sorted(targets):
            target_group, target_rank = layer_of(target) or ("?", 99)
            if target_group != group and target_rank >= rank:
                found.append(f"{module} ({group}) imports {target} ({target_group}), which is not below it")
    found += private_imports(root)
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
    graph = graph_of(PACKAGE)
    for module, path in names.items():
        if layer_of(module) != ("kernels", 1):
            continue
        for target in graph[module]:
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
    assert "qjax.dispatch (dispatch) imports qjax.optim (optim), which is not below it" in found
    assert any(p.startswith("import circle:") and "qjax.optim.adam" in p and "qjax.optim.fused_adam" in p
               for p in found)
    assert not any("qjax.optim.adam (optim) imports qjax.optim " in p for p in found)  # its own package: fine


def test_the_checker_keeps_concepts_apart(tmp_path):
    """Each edge issue 47 removed fails the check: recipes -> dispatch (recipes are pure data), models -> optim and
    flax -> optim (the optimizer sits beside the models, above the layers), a private helper imported across modules,
    and a kernel reaching the optimizer's code through an eager package `__init__`; a kernel importing the optimizer's
    numerics-level modules through a lazy `__init__` passes."""
    root = tmp_path / "qjax"
    _write(root, {
        "__init__.py": "",
        "numerics.py": "",
        "dispatch.py": "",
        "recipes.py": "from qjax.dispatch import BACKENDS\n",
        "linear_core.py": "",
        "dot_general.py": "from qjax.linear_core import layout_from\n",
        "prologue.py": "from qjax.dot_general import _seeds\n",
        "flax.py": "from qjax.optim import int8_params\n",
        "models/__init__.py": "",
        "models/lm_head.py": "from qjax.optim.int8_params import Int8Param\n",
        "optim/__init__.py": "_MODULES = ('qjax.optim.adamw',)\n",  # lazy: names load on first use
        "optim/adam_math.py": "from qjax import numerics\n",
        "optim/adamw.py": "from qjax.kernels import adam_step_mgpu\n",
        "optim/int8_params.py": "",
        "kernels/__init__.py": "",
        "kernels/adam_step_mgpu.py": "from qjax.optim import adam_math\n",
    })
    found = problems(root)
    assert "qjax.recipes (recipes) imports qjax.dispatch (dispatch), which is not below it" in found
    assert "qjax.models.lm_head (models) imports qjax.optim.int8_params (optim), which is not below it" in found
    assert "qjax.flax (flax) imports qjax.optim.int8_params (optim), which is not below it" in found
    assert "qjax.prologue imports qjax.dot_general._seeds" in found
    assert not any(p.startswith("qjax.kernels.adam_step_mgpu") for p in found), found
    assert not any(p.startswith("import circle:") for p in found), found  # kernel -> adam_math: not the package
    assert graph_of(root)["qjax.optim"] == {"qjax.optim.adamw"}  # a lazy import still counts for the package

    (root / "optim/__init__.py").write_text("from qjax.optim.adamw import *\n")  # eager: runs the kernel's caller
    found = problems(root)
    assert "qjax.kernels.adam_step_mgpu (kernels) imports qjax.optim (optim), which is not below it" in found
    assert any(p.startswith("import circle:") and "qjax.kernels.adam_step_mgpu" in p for p in found)


def test_no_module_exceeds_the_line_limit():
    """One concept per module, each readable in one sitting (the project's style guide)."""
    long = {m: n for m, p in module_names(PACKAGE).items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("module,layer", [("qjax.kernels.adam_step_mgpu", "kernels"), ("qjax.kernels", "kernels"),
                                          ("qjax.kernels.scaled_matmul", "references"), ("qjax", "api"),
                                          ("qjax.optim.fused_adam", "optim"), ("qjax.optim.codebooks", "numerics"),
                                          ("qjax.optim.adam_math", "numerics"), ("qjax.recipes", "recipes"),
                                          ("qjax.int8_params", "int8 params"), ("qjax.linear_core", "linear core"),
                                          ("qjax.data.text", "data")])
def test_layer_names(module, layer):
    assert layer_of(module)[0] == layer

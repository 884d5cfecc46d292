"""The package façade: `import qjax` is light, every public name resolves, and the version matches pyproject.toml."""

import pathlib
import re
import subprocess
import sys

import qjax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_import_qjax_loads_no_framework():
    code = ("import sys, qjax; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'jax', 'flax', 'optax', 'orbax'}), sorted(m for m in sys.modules if m.startswith('qjax.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] []", out


def test_every_public_name_resolves():
    for name in qjax.__all__:
        assert getattr(qjax, name) is not None, name
    from qjax import quantize_model, report  # noqa: F401  (module __getattr__ serves `from qjax import ...` too)


def test_version_matches_pyproject():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, flags=re.M).group(1) == qjax.__version__
    assert f"## {qjax.__version__} " in (ROOT / "CHANGELOG.md").read_text()

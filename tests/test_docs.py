"""Every ```python block of the pages in docs/ runs as written, each as its own script on the CPU (the README's are
run by tests/test_readme.py). Blocks added to the pages later are picked up the same way."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCKS = [(page.name, i, block) for page in sorted((ROOT / "docs").glob("*.md"))
          for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL))]


def test_docs_have_python_blocks():
    assert any(page == "quantize_model.md" for page, _, _ in BLOCKS)


@pytest.mark.parametrize("page,index,block", BLOCKS, ids=[f"{page}-{i}" for page, i, _ in BLOCKS])
def test_docs_python_block_runs(page, index, block, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(block)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"{page} block {index}:\n{block}\n{result.stderr[-3000:]}"

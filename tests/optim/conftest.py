"""The fused AdamW kernel under the interpreter takes several tiles per program wherever a tensor has several tiles
(`adam_step_mgpu._MIN_PROGRAMS` = 1), so the small interpreted tensors cover the multi-tile programs that large
tensors get on a GPU; compiled GPU runs keep the real threshold."""

import jax
import pytest

from qjax.kernels import adam_step_mgpu


@pytest.fixture(autouse=True)
def _multi_tile_programs(monkeypatch):
    if jax.default_backend() != "gpu":
        monkeypatch.setattr(adam_step_mgpu, "_MIN_PROGRAMS", 1)

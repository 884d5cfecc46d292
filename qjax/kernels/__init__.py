"""Pallas (Mosaic GPU) kernels for Hopper, and the jnp reference of the scaled GEMM.

  scaled_matmul.py        jnp reference of the quantized GEMM (row / tensor / block scales)
  scaled_matmul_mgpu.py   the Mosaic GPU GEMM kernel: int8 / fp8 wgmma, scales in the epilogue or per 128 of K
  gemm_config_mgpu.py     its tilings, kernel modes and their shared-memory / register checks
  quantize_mgpu.py        fused quantization (both GEMM layouts from one read); reference: qjax.quantize
  rmsnorm_mgpu.py         RMSNorm with its saved 8-bit copy (data flow; the backward is XLA's); reference: models.ops
  tile_pipeline_mgpu.py   the TMA pipeline over 128 x 128 tiles that the quantize kernels run on
  adam_step_mgpu.py       the fused AdamW step on e4m3 / 8-bit states; reference: qjax.optim.fused_adam
  swiglu_mgpu.py          SwiGLU with its saved 8-bit copy (data flow), and its backward; reference: models.ops
  grouped_matmul_mgpu.py  grouped (MoE ragged_dot) scaled GEMMs, rows ragged; reference: qjax.ragged_dot._grouped_gemm
  grouped_contract_mgpu.py  the grouped scaled GEMM contracting over each group's rows (the wgrad); same reference
  grouped_config_mgpu.py  the grouped kernels' tilings, shared-memory checks and defaults
  grouped_pipeline_mgpu.py  the grouped kernels' TMA pipeline with two compute warpgroups
  grouped_bf16_mgpu.py    JAX's own bf16 grouped kernels, wrapped for qjax.ragged_dot; reference: lax.ragged_dot

Kernel files are leaves: they import the numerics layer (`qjax.numerics`, `qjax.stochastic`, `qjax.formats`,
`qjax.qtensor`, and the optimizer's `qjax.optim.adam_math` and `qjax.optim.codebooks`), each other's tile helpers and
jax, nothing above. Which of a kernel and its
reference runs is decided in `qjax.dispatch` (docs/design.md, "Layers").
"""

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu


def resolve_interpret(interpret):
    """A kernel's `interpret` argument -> plgpu.kernel's: None / False -> compiled Mosaic GPU; True -> the CPU
    interpreter's default params; `plgpu.InterpretGPUParams` pass through."""
    if interpret is True:
        return plgpu.InterpretGPUParams()
    if interpret is False:
        return None
    return interpret


def persistent_ctas(requested: int | None, interpret) -> int:
    """A persistent kernel's grid size: `requested`, else 2 under the interpreter, else one CTA per SM."""
    return requested or (2 if interpret else jax.devices()[0].core_count)


def load_from_gmem(ref, layout):
    """A GMEM ref read straight into registers in `layout`. optimized=False: Mosaic GPU's "optimized"
    (bank-conflict-free) transfers are for SMEM; from GMEM each register is one vector load, and a warp's loads are
    contiguous."""
    return plgpu.load(ref, layout=layout, optimized=False)


# For kernels where no thread can overwrite a GMEM or SMEM location before every other thread that reads it has
# read it: AdamW's (a row's scale is read by its warp's lanes, and written back after the row's amax shuffles, which
# order them), SwiGLU's (fresh outputs) and RMSNorm's (a staged scale every warp writes with the same values, then
# reads back its own write). Pallas otherwise brackets every store with a bar.sync of the program's threads, against
# others still reading what the store overwrites, which these kernels do not need.
NO_AUTO_BARRIERS = plgpu.CompilerParams(unsafe_no_auto_barriers=True)

"""Recipes: how each of the three GEMMs of a linear layer is quantized, and the registry of named recipes.

For y = dot_general(x, w): the forward GEMM (x . w), dgrad (g . w, the gradient of x) and wgrad (g^T . x, the
gradient of w). Each is a `GemmSpec` (how its lhs and rhs are quantized) or None for high precision. Every operand
is quantized in the layout its GEMM reads, contracting dimension last, so "row" always means "one scale per row,
taken along that GEMM's contracting dimension":

  GEMM    lhs (rows, K)           rhs (rows, K)           contracting dim
  fwd     x  (M, K)               w  (N, K)               K, the input features
  dgrad   g  (M, N)               w  (K, N)               N, the output features
  wgrad   g  (N, M)               x  (K, M)               M, the tokens

Change a recipe with `dataclasses.replace`, e.g. int8 in the forward GEMM only:
  dataclasses.replace(qjax.recipe("int8_rowwise"), name="int8_fwd", dgrad=None, wgrad=None)
"""

import dataclasses

from qjax.qtensor import QuantSpec

BACKENDS = ("auto", "xla", "pallas")  # the values of `Recipe.backend` (`qjax.dispatch` runs them)


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """Quantization of one GEMM's two operands (see the table in the module docstring)."""

    lhs: QuantSpec
    rhs: QuantSpec

    def __post_init__(self):
        if self.lhs.format.is_integer != self.rhs.format.is_integer:
            raise ValueError(f"a GEMM cannot mix int8 and fp8 operands: {self.lhs.dtype} x {self.rhs.dtype}")
        if self.lhs.is_block_scaled != self.rhs.is_block_scaled:
            raise ValueError("a block-scaled GEMM needs both operands block-scaled (1x128 or 128x128), got "
                             f"{self.lhs.granularity} x {self.rhs.granularity}")

    @property
    def is_block_scaled(self) -> bool:
        return self.lhs.is_block_scaled  # both operands are, or neither

    @property
    def stochastic(self) -> bool:
        return self.lhs.stochastic or self.rhs.stochastic


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Per-GEMM quantization of a linear layer; None means that GEMM runs in high precision.

    backend: how the quantized GEMMs (and their quantization) execute. "auto": the Pallas Mosaic GPU kernels on a
    Hopper GPU where they support the case, XLA elsewhere; with several GPUs only where `qjax.dot_general` runs the
    GEMMs per device (under a context mesh; the kernels have no partitioning rule); "xla": always XLA (the jnp
    reference path); "pallas": the kernels always (under the Mosaic GPU interpreter off a GPU: slow,
    for tests); an unsupported GEMM raises ValueError, while quantizations the fused kernel does not cover
    (batched operands, a single layout, a tensorwise quantization reused by transposition) run the reference.
    Quantized codes are identical on every backend; GEMM outputs agree up to float32 rounding (fp8: up to Hopper's
    reduced-precision fp8 accumulation inside each 128-long block).

    saved, saved_group: the data-flow recipes' 8-bit activations. The inputs a norm or an activation function
    saves for its backward (the norm's input, SwiGLU's gate and up) are saved quantized per `saved` (a "row"
    QuantSpec), one float32 scale per `saved_group` consecutive features (0: per row), where the model fuses that
    op with the linear layer after it (`qjax.prologue`). None: saved in the compute dtype.

    recompute_prologue_output: where such a fused layer runs (needs `saved`), its backward recomputes the op's output
    y from the saved 8-bit input and quantizes it for wgrad (the recipe's wgrad spec and seed), instead of saving y's
    8-bit wgrad copy from the forward (DeepSeek-V3 recomputes SwiGLU's output so): one 8-bit copy of each fused op's
    output fewer per token, for an elementwise op (and a norm's statistics) rerun and a quantize pass in the backward,
    and a wgrad that reads a second rounding of y. Off by default.

    recompute_weight_codes: dgrad re-quantizes the weight in the backward (the recipe's dgrad spec and seed: the same
    codes, bit for bit) instead of saving its (K, N) 8-bit codes from the forward. The float weight is a param, live
    anyway, so the saved codes are pure extra memory: 1 byte per weight of every layer outside remat. Costs one
    weight quantize per GEMM in the backward and, under FSDP, a second all-gather of the codes (FSDP's usual
    reshard after forward). Needs a quantized dgrad. Pays only where the GEMM's rhs is the param itself, not a
    cast or dequantized copy (which would be saved instead, 2 bytes a weight): `qjax.models` layers pass the
    kernel uncast under this flag, and an int8 weight-only param keeps its codes saved. Off by default.
    """

    name: str
    fwd: GemmSpec | None = None
    dgrad: GemmSpec | None = None
    wgrad: GemmSpec | None = None
    backend: str = "auto"
    saved: QuantSpec | None = None
    saved_group: int = 0
    recompute_prologue_output: bool = False
    recompute_weight_codes: bool = False

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; use one of {BACKENDS}")
        if self.saved is not None and (self.saved.granularity != "row" or self.saved.stochastic):
            raise ValueError(f"Recipe.saved quantizes saved activations per row (or per group of saved_group "
                             f"features) with nearest rounding; got {self.saved}")
        if isinstance(self.saved_group, bool) or not isinstance(self.saved_group, int) or self.saved_group < 0:
            raise ValueError(f"Recipe.saved_group must be an int >= 0 (0: one scale per row), got "
                             f"{self.saved_group!r}")
        for flag in ("recompute_prologue_output", "recompute_weight_codes"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"Recipe.{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.recompute_weight_codes and self.dgrad is None:
            raise ValueError(f"Recipe.recompute_weight_codes=True needs a quantized dgrad that quantizes the weight "
                             f"itself; recipe {self.name!r} has none: leave it False")
        if self.recompute_prologue_output and self.saved is None:
            raise ValueError("Recipe.recompute_prologue_output=True applies to the fused norm / activation layers, "
                             "which run only where the recipe saves 8-bit activations: set Recipe.saved (e.g. "
                             "replace int8_dataflow or fp8_dataflow) or leave it False")

    @property
    def is_high_precision(self) -> bool:
        return self.fwd is None and self.dgrad is None and self.wgrad is None

    @property
    def is_block_scaled(self) -> bool:
        """Whether any of its GEMMs is block-scaled (needs its dimensions in multiples of 128)."""
        return any(g is not None and g.is_block_scaled for g in (self.fwd, self.dgrad, self.wgrad))

    @property
    def dgrad_reads_forward_weight(self) -> bool:
        """Whether dgrad, left in high precision, multiplies by the weight the forward GEMM multiplied by (its codes
        times its scale, in the weight's dtype) instead of the float weight: where that weight is ternary (BitNet
        b1.58, whose model is the ternary one: dx = g . Q(w), as its reference BitLinear differentiates). int8 and fp8
        forwards approximate the float weight, and a high-precision dgrad reads that (the straight-through
        convention of their recipes)."""
        return self.dgrad is None and self.fwd is not None and self.fwd.rhs.dtype == "ternary"

    @property
    def needs_key(self) -> bool:
        return any(g is not None and g.stochastic for g in (self.fwd, self.dgrad, self.wgrad))


def _gemm(lhs_dtype, lhs_granularity, rhs_dtype, rhs_granularity, pow2_scale=False):
    return GemmSpec(QuantSpec(lhs_dtype, lhs_granularity, pow2_scale=pow2_scale),
                    QuantSpec(rhs_dtype, rhs_granularity, pow2_scale=pow2_scale))


def _gemm_sr_lhs(gemm):
    """gemm with stochastic rounding of its lhs (the gradient, in dgrad and wgrad)."""
    return dataclasses.replace(gemm, lhs=dataclasses.replace(gemm.lhs, stochastic=True))


def _same_three(name, gemm, **fields):
    return Recipe(name, fwd=gemm, dgrad=gemm, wgrad=gemm, **fields)


_INT8_ROW = _gemm("int8", "row", "int8", "row")
# BitNet b1.58: int8 activations per token x ternary weights (codes -1/0/1, scale mean |w|), on the int8 GEMM. dgrad
# multiplies the gradient by the same ternary weight the forward did, as the reference BitLinear's
# w + (Q(w) - w).detach() does: dx is the gradient of the function the forward computed (the float w there trains
# worse); a high-precision dgrad would read that ternary weight too, dequantized
# (`Recipe.dgrad_reads_forward_weight`). wgrad reaches the float weight as if the rounding were the
# identity (the straight-through estimator).
_BITNET_FWD = GemmSpec(QuantSpec("int8", "row"), QuantSpec("ternary", "tensor"))
_E4M3_ROW = _gemm("e4m3", "row", "e4m3", "row", pow2_scale=True)

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("bf16"),
    _same_three("int8_rowwise", _INT8_ROW),
    Recipe("fp8_tensorwise",
           fwd=_gemm("e4m3", "tensor", "e4m3", "tensor"),
           dgrad=_gemm("e5m2", "tensor", "e4m3", "tensor"),
           wgrad=_gemm("e5m2", "tensor", "e4m3", "tensor")),
    _same_three("fp8_rowwise", _E4M3_ROW),
    # DeepSeek-V3: activations and gradients 1x128 along K, weights 128x128. In wgrad both operands contract over
    # the tokens, so x's (K, M) layout with 1x128 blocks is x's 128x1 blocking.
    Recipe("fp8_blockwise",
           fwd=_gemm("e4m3", "1x128", "e4m3", "128x128"),
           dgrad=_gemm("e4m3", "1x128", "e4m3", "128x128"),
           wgrad=_gemm("e4m3", "1x128", "e4m3", "1x128")),
    Recipe("bitnet_b158", fwd=_BITNET_FWD, dgrad=_BITNET_FWD, wgrad=_INT8_ROW),
    # OCP MXFP8 (torchao's mxfp8): e4m3 codes, E8M0 scales per 32 of each GEMM's contracting dim, every operand.
    # Scales in RCEIL mode (NVIDIA's), not torchao's FLOOR, which saturates block maxima above 448 * 2^k
    # (QuantSpec.mx_scale selects). Hopper has no MX GEMM: codes times power-of-two scales are exact in bf16.
    _same_three("mxfp8", _gemm("e4m3", "1x32", "e4m3", "1x32", pow2_scale=True)),
    # The data-flow recipes (docs/design.md, "Data flow"): the linear layers as fp8_tensorwise / int8_rowwise, and
    # the norm and SwiGLU / GELU inputs saved in 8 bits: COAT's e4m3 1x16 groups; Jetfire's int8 with 1x32 groups
    # (its 32 x 32 blocks along the features only: the saving op's backward works row by row). Gradients round to
    # nearest, not stochastically as Jetfire's: SR converged worse in our runs (docs/design.md);
    # qjax.with_stochastic_gradients(recipe) gives Jetfire's rounding back.
    Recipe("fp8_dataflow",
           fwd=_gemm("e4m3", "tensor", "e4m3", "tensor"),
           dgrad=_gemm("e5m2", "tensor", "e4m3", "tensor"),
           wgrad=_gemm("e5m2", "tensor", "e4m3", "tensor"),
           saved=QuantSpec("e4m3", "row"), saved_group=16),
    _same_three("int8_dataflow", _INT8_ROW, saved=QuantSpec("int8", "row"), saved_group=32),
)}


def recipe(name: str) -> Recipe:
    """The named recipe (see `RECIPES` and the README's table). Raises ValueError for unknown names."""
    if isinstance(name, Recipe):
        return name
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; valid names: {', '.join(RECIPES)}")
    return RECIPES[name]


def with_stochastic_gradients(r: Recipe | str) -> Recipe:
    """`r` (a Recipe or its name) with stochastic rounding on the gradient operand (lhs) of dgrad and wgrad, as in
    gau-nernst's SR runs."""
    r = recipe(r)

    sr_lhs = lambda gemm: None if gemm is None else _gemm_sr_lhs(gemm)
    return dataclasses.replace(r, name=r.name + "_sr", dgrad=sr_lhs(r.dgrad), wgrad=sr_lhs(r.wgrad))

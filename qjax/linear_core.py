"""The quantized linear GEMM that `qjax.dot_general`, `qjax.prologue` and `qjax.ragged_dot` build on: operand
layouts, the forward / backward GEMM halves, per-operand seeds and the per-device (mesh) path.

Any dot_general is first viewed as a batched "TN" GEMM, both operands laid out contracting-dimension-last:
  lhs -> (B?, M, K), rhs -> (B?, N, K), out (B?, M, N)      (B? present only when there are batch dims)
which is the layout cuBLAS runs 8-bit GEMMs fastest in (docs/design.md, "Recipes"). Each operand is quantized in
the layout its GEMM reads (see `qjax.recipes`), the GEMM runs on the 8-bit codes (int8 -> int32, fp8 -> f32), and
the scales are applied after it. The custom VJP saves only the quantized operands the backward GEMMs need, already
in their layout: w as (K, N) for dgrad and x as (K, M) for wgrad. Each input is quantized once for both GEMMs that
read it (`qjax.dispatch.quantize_pair`), and every GEMM goes through `qjax.dispatch.quantized_matmul`: the Pallas
kernels where the recipe's backend selects them, XLA otherwise (block-scaled recipes then run the reference
dequantize + f32 GEMM: exact, slow).

Under a mesh (set while tracing: `jax.set_mesh(mesh)` or `jax.sharding.use_abstract_mesh(mesh.abstract_mesh)`; qjax's
train step does it), a GEMM whose lhs leads with a free dimension divisible by the mesh size runs per device: the
custom VJP sits inside `jax.shard_map` with lhs split along that dimension over every mesh axis and rhs whole, so the
kernels (custom calls XLA cannot partition) see device-local arrays. Scales that span tokens (tensor scales, the
per-feature scales of x and g for wgrad) take their amax over all devices (`lax.pmax`), so they equal the unsharded
ones; the weight gradient's partial sums are added over devices by the transpose of the rhs's `lax.pcast`.
Stochastic rounding draws per-device streams (the seed offset by the device index), not the unsharded bits.

A weight stored split over the mesh (FSDP, tensor parallelism) is described by a `WeightSharding` (`sharding=`;
`qjax.DotGeneral` takes it from `qjax.flax.weight_shardings` by layer name). The GEMM then runs per device with the
weight's shard: it is quantized on its shard (amax reduced over the mesh axes a scale spans, so codes and scales are
the unsharded ones), and the 8-bit codes and their scales are all-gathered over the FSDP axis (int8 / float8 in
the HLO, ternary codes packed 4 per byte as uint8; never bf16) before the forward and dgrad GEMMs; the weight
gradient is reduce-scattered back onto the shard.
Along the tensor axis the weight stays split (Megatron): column-parallel layers (`tensor_dim="n"`) produce output
features split over it (the lhs' gradient summed over it), row-parallel ones (`tensor_dim="k"`) read lhs features
split over it and sum their outputs over it. The gathered dgrad-layout codes are saved for the backward GEMM (one
byte per weight element of the layer, as FSDP without resharding after the forward).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from qjax import dispatch, stochastic
from qjax import recipes as recipes_lib
from qjax.kernels.scaled_matmul import contract_last
from qjax.qtensor import QTensor, QuantSpec
from qjax.weight_sharding import WeightSharding, gather, trivial_axes, varying

# Operand slots in the uint32 seed vector: one independent stochastic-rounding stream per quantized operand.
FWD_LHS, FWD_RHS, DGRAD_LHS, DGRAD_RHS, WGRAD_LHS, WGRAD_RHS = range(6)

@dataclasses.dataclass(frozen=True)
class Layout:
    """Static permutations between a dot_general's operands and the canonical (B?, rows, K) views."""

    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    lhs_contract: tuple[int, ...]
    rhs_contract: tuple[int, ...]
    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]

    @property
    def lhs_free(self):
        return tuple(d for d in range(len(self.lhs_shape)) if d not in self.lhs_contract + self.lhs_batch)

    @property
    def rhs_free(self):
        return tuple(d for d in range(len(self.rhs_shape)) if d not in self.rhs_contract + self.rhs_batch)

    def _size(self, shape, dims):
        return math.prod(shape[d] for d in dims)

    @property
    def batch(self):
        return (self._size(self.lhs_shape, self.lhs_batch),) if self.lhs_batch else ()

    @property
    def m(self):
        return self._size(self.lhs_shape, self.lhs_free)

    @property
    def n(self):
        return self._size(self.rhs_shape, self.rhs_free)

    @property
    def k(self):
        return self._size(self.lhs_shape, self.lhs_contract)

    def lhs_mk(self, lhs):
        return lhs.transpose(self.lhs_batch + self.lhs_free + self.lhs_contract).reshape(*self.batch, self.m, self.k)

    def lhs_km(self, lhs):
        return lhs.transpose(self.lhs_batch + self.lhs_contract + self.lhs_free).reshape(*self.batch, self.k, self.m)

    def rhs_nk(self, rhs):
        return rhs.transpose(self.rhs_batch + self.rhs_free + self.rhs_contract).reshape(*self.batch, self.n, self.k)

    def rhs_kn(self, rhs):
        return rhs.transpose(self.rhs_batch + self.rhs_contract + self.rhs_free).reshape(*self.batch, self.k, self.n)

    def out_shape(self):
        return (tuple(self.lhs_shape[d] for d in self.lhs_batch) + tuple(self.lhs_shape[d] for d in self.lhs_free)
                + tuple(self.rhs_shape[d] for d in self.rhs_free))

    def out_mn(self, out):
        return out.reshape(*self.batch, self.m, self.n)

    def _unview(self, x, shape, perm):
        x = x.reshape(tuple(shape[d] for d in perm))
        return x.transpose(tuple(perm.index(d) for d in range(len(shape))))

    def lhs_from_mk(self, x):
        return self._unview(x, self.lhs_shape, self.lhs_batch + self.lhs_free + self.lhs_contract)

    def rhs_from_kn(self, x):
        return self._unview(x, self.rhs_shape, self.rhs_batch + self.rhs_contract + self.rhs_free)

    def split_rows(self, devices: int) -> "Layout":
        """This layout with lhs dim 0 divided over `devices`: the GEMM each device runs inside `per_device`."""
        return dataclasses.replace(self, lhs_shape=(self.lhs_shape[0] // devices, *self.lhs_shape[1:]))



def _swap_last(x):
    return jnp.swapaxes(x, -1, -2)


def _high_precision_matmul(a, b, out_dtype, precision):
    """(B?, M, K) x (B?, N, K) -> (B?, M, N) in the operands' (promoted) dtype, no quantization."""
    dtype = jnp.promote_types(a.dtype, b.dtype)
    return lax.dot_general(a.astype(dtype), b.astype(dtype), contract_last(a.ndim), precision,
                           preferred_element_type=out_dtype)


def operand_spec(gemm: recipes_lib.GemmSpec | None, side: str) -> QuantSpec | None:
    return None if gemm is None else getattr(gemm, side)


def _is_ternary(spec: QuantSpec | None) -> bool:
    return spec is not None and spec.dtype == "ternary"


@functools.lru_cache(maxsize=None)
def linear_parts(layout: Layout, recipe: recipes_lib.Recipe, out_dtype, lhs_dtype, rhs_dtype, precision,
                 token_axes: tuple[str, ...] = (), sharding: WeightSharding | None = None):
    """The quantized GEMM's two halves for one static configuration, for custom VJPs built around it:

      forward(lhs, rhs, seeds, rhs_q, with_residuals) -> (out, (w_res, x_res))   the forward GEMM, and (with
                 residuals) what the backward GEMMs read, quantized in their layouts; rhs_q: None, or the forward
                 GEMM's rhs already quantized (`dot_general`'s rhs_quantized; not with an FSDP `sharding`)
      backward((w_res, x_res, seeds), g) -> (dlhs, drhs)                  dgrad and wgrad; x_res: forward's, or
                 lhs itself where a caller recomputed it instead of saving its wgrad codes (`qjax.prologue`),
                 which backward then quantizes for wgrad as forward does (same specs and seeds)

    token_axes: inside `per_device`, the mesh axes the token rows (M) of x and g are split over (module docstring).
    sharding: inside `weight_sharding.per_device_sharded`, how rhs (then its 2-D local shard) is split; `layout`
    describes the per-device GEMM (lhs local, rhs gathered over `sharding.fsdp`).
    """
    gemm = functools.partial(dispatch.quantized_matmul, backend=recipe.backend)
    quantize_both = functools.partial(dispatch.quantize_pair, backend=recipe.backend)
    fwd, dgrad, wgrad = recipe.fwd, recipe.dgrad, recipe.wgrad
    sharding = sharding or WeightSharding(token_axes)
    x_k_axes, g_n_axes = sharding.lhs_k_axes(), sharding.out_n_axes()
    w_n_axes, w_k_axes = sharding.axes("n"), sharding.axes("k")
    fsdp_n = 0 if sharding.fsdp_dim == "n" else 1  # the gathered dim of w as (N, K); as (K, N) it is 1 - fsdp_n
    vma = tuple(token_axes) + ((sharding.tensor,) if sharding.tensor else ())

    def rhs_nk(rhs):
        return layout.rhs_nk(rhs) if sharding.fsdp is None else (rhs if layout.rhs_contract == (1,) else rhs.T)

    def quantize_lhs(x, seeds, x_spec_t):
        """x as (M, K) -> (forward codes, wgrad codes as (K, M) per x_spec_t or None), from one read of x."""
        return quantize_both(x, operand_spec(fwd, "lhs"), x_spec_t, seeds[FWD_LHS], seeds[WGRAD_RHS],
                             operands=("forward lhs x as (M, K)", "wgrad rhs x as (K, M), M = tokens"),
                             row_axes=token_axes, col_axes=x_k_axes)

    def quantize_w(w, w_spec, w_spec_t, seeds):
        """w as (N, K) -> (forward codes per w_spec, dgrad codes as (K, N) per w_spec_t), either None."""
        return quantize_both(w, w_spec, w_spec_t, seeds[FWD_RHS], seeds[DGRAD_RHS],
                             operands=("forward rhs w as (N, K)", "dgrad rhs w as (K, N)"),
                             row_axes=w_n_axes, col_axes=w_k_axes)

    def forward_gemm(lhs, rhs, seeds, rhs_q, with_residuals):
        """out, and (with_residuals) what the backward GEMMs read of w and x: quantized in their layouts, or the
        originals for GEMMs in high precision. Each input is quantized once for both GEMMs that read it."""
        x, w = layout.lhs_mk(lhs), rhs_nk(rhs)
        x_spec_t = operand_spec(wgrad, "rhs") if with_residuals else None
        w_spec_t = operand_spec(dgrad, "rhs") if with_residuals else None
        xq, x_res = quantize_lhs(x, seeds, x_spec_t)
        w_spec = operand_spec(fwd, "rhs") if rhs_q is None else None
        recompute_w = recipe.recompute_weight_codes and rhs_q is None
        wq, w_res = quantize_w(w, w_spec, None if recompute_w else w_spec_t, seeds)
        wq = wq if rhs_q is None else rhs_q
        # FSDP: the codes (or, for a GEMM in high precision, the weight itself) are gathered, not the float weight.
        wq = gather(w if fwd is None else wq, sharding.fsdp, fsdp_n, ternary=_is_ternary(operand_spec(fwd, "rhs")))
        if fwd is None:
            out = _high_precision_matmul(x, wq, out_dtype, precision)
        else:
            out = varying(gemm(xq, wq, out_dtype), vma)
        if recipe.dgrad_reads_forward_weight:  # the forward's (gathered) ternary codes, dequantized in backward
            w_res = wq
        elif recompute_w and with_residuals:  # the param itself, live anyway: backward quantizes it again
            w_res = rhs
        elif w_spec_t is None:  # dgrad in high precision reads w as (K, N): the weight itself, gathered under FSDP
            w_res = rhs if sharding.fsdp is None else gather(_swap_last(w), sharding.fsdp, 1 - fsdp_n)
        else:
            w_res = gather(w_res, sharding.fsdp, 1 - fsdp_n, ternary=_is_ternary(w_spec_t))
        residuals = (w_res, lhs if x_spec_t is None else x_res)
        return out.reshape(layout.out_shape()), residuals

    def backward(residuals, g):
        w_res, x_res, seeds = residuals
        g_mn = layout.out_mn(g)
        gq_dgrad, gq_wgrad = quantize_both(g_mn, operand_spec(dgrad, "lhs"), operand_spec(wgrad, "lhs"),
                                           seeds[DGRAD_LHS], seeds[WGRAD_LHS],
                                           operands=("dgrad lhs g as (M, N)", "wgrad lhs g as (N, M)"),
                                           row_axes=token_axes, col_axes=g_n_axes)
        if recipe.dgrad_reads_forward_weight:  # (B?, N, K) forward codes -> (B?, K, N) weight in rhs' dtype
            dx = _high_precision_matmul(g_mn, _swap_last(w_res.dequantize(rhs_dtype)), lhs_dtype, precision)
        elif dgrad is None:
            w_kn = layout.rhs_kn(w_res) if sharding.fsdp is None else w_res
            dx = _high_precision_matmul(g_mn, w_kn, lhs_dtype, precision)
        else:
            if not isinstance(w_res, QTensor):  # the param (Recipe.recompute_weight_codes): its dgrad codes now
                w_res = quantize_w(rhs_nk(w_res), None, operand_spec(dgrad, "rhs"), seeds)[1]
                w_res = gather(w_res, sharding.fsdp, 1 - fsdp_n, ternary=_is_ternary(operand_spec(dgrad, "rhs")))
            dx = gemm(gq_dgrad, w_res, lhs_dtype, precise_accumulation=True)
        # wgrad as dw^T = x^T g, (K, M) x (N, M) -> (K, N): a Dense kernel's (in, out) layout, so the optimizer
        # reads the gradient untransposed (the GEMM's two operands play symmetric roles).
        if wgrad is None:
            dw = _high_precision_matmul(layout.lhs_km(x_res), _swap_last(g_mn), rhs_dtype, precision)
        else:
            if not isinstance(x_res, QTensor):  # lhs itself, recomputed by the caller: its wgrad codes now. Both
                # layouts from one read, the forward's dropped: the transposed layout alone has no fused kernel.
                x_res = quantize_lhs(layout.lhs_mk(x_res), seeds, operand_spec(wgrad, "rhs"))[1]
            dw = gemm(x_res, gq_wgrad, rhs_dtype, precise_accumulation=True)
        dx = layout.lhs_from_mk(varying(dx, vma))
        if sharding.fsdp is None:
            return dx, layout.rhs_from_kn(varying(dw, vma))
        # FSDP: each device keeps its shard of the weight gradient summed over the devices of the gather
        dw = lax.psum_scatter(dw, sharding.fsdp, scatter_dimension=1 - fsdp_n, tiled=True)
        dw = varying(dw if layout.rhs_contract == (0,) else dw.T, vma)
        # dx waits for the reduce-scatter: nothing the backward pass still has to do needs dw, so a scheduler may
        # otherwise defer this layer's wgrad GEMM and reduce-scatter to the end of the backward, holding every
        # layer's full (K, N) gradient at once.
        return lax.optimization_barrier((dx, dw))

    return forward_gemm, backward


def layout_from(lhs_shape, rhs_shape, dimension_numbers) -> Layout:
    """Validates dimension_numbers against the shapes (ValueError naming the problem) and builds the layout."""
    try:
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
        lhs_contract, rhs_contract, lhs_batch, rhs_batch = (
            tuple(int(d) for d in dims) for dims in (lhs_contract, rhs_contract, lhs_batch, rhs_batch))
    except (TypeError, ValueError):
        raise ValueError("dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), "
                         f"got {dimension_numbers!r}") from None
    for name, shape, contract, batch in (("lhs", lhs_shape, lhs_contract, lhs_batch),
                                         ("rhs", rhs_shape, rhs_contract, rhs_batch)):
        dims = contract + batch
        if any(d < 0 or d >= len(shape) for d in dims) or len(set(dims)) != len(dims):
            raise ValueError(f"{name} contracting {contract} / batch {batch} dims must be distinct dims of its "
                             f"shape {shape}")
    for kind, lhs_dims, rhs_dims in (("contracting", lhs_contract, rhs_contract), ("batch", lhs_batch, rhs_batch)):
        if len(lhs_dims) != len(rhs_dims):
            raise ValueError(f"lhs has {len(lhs_dims)} {kind} dims but rhs has {len(rhs_dims)}")
        for ld, rd in zip(lhs_dims, rhs_dims):
            if lhs_shape[ld] != rhs_shape[rd]:
                raise ValueError(f"{kind} dimension sizes differ: lhs dim {ld} of shape {lhs_shape} has "
                                 f"{lhs_shape[ld]}, rhs dim {rd} of shape {rhs_shape} has {rhs_shape[rd]}")
    return Layout(tuple(lhs_shape), tuple(rhs_shape), lhs_contract, rhs_contract, lhs_batch, rhs_batch)


def device_axes(recipe: recipes_lib.Recipe, layout: Layout) -> tuple[str, ...]:
    """The context mesh's axes to run this GEMM per device over (module docstring), or () to leave it to XLA: no
    mesh or one device, the XLA backend, already inside a shard_map, batch dims, a lhs whose dim 0 is contracted or
    not divisible by the mesh size, or per-device token counts that would split 128-row scale blocks."""
    mesh = jax.sharding.get_abstract_mesh()
    if recipe.backend == "xla" or mesh.empty or mesh.size == 1 or mesh.manual_axes or layout.lhs_batch:
        return ()
    if 0 in layout.lhs_contract or layout.lhs_shape[0] % mesh.size:
        return ()
    if recipe.is_block_scaled and (layout.m // mesh.size) % 128:
        return ()
    return tuple(a for a in mesh.axis_names if a not in trivial_axes())  # a collective over a size-1 axis: no-op


def per_device(fn, axes: tuple[str, ...], n_extra: int = 0):
    """fn (lhs, *weights, seeds, *extra) -> out, run inside `jax.shard_map` over the context mesh: lhs and out
    split along dim 0 over `axes`; the weights, seeds and the last `n_extra` arguments (e.g. `dot_general`'s
    rhs_quantized, no gradient) whole (module docstring)."""

    def body(lhs, *args):
        n_weights = len(args) - n_extra - 1
        weights, seeds, extra = args[:n_weights], args[n_weights], args[n_weights + 1:]
        device = lax.axis_index(axes).astype(jnp.uint32)
        seeds = seeds + device * jnp.uint32(0x9E3779B9)  # distinct stochastic-rounding streams per device
        # The weights vary per device inside: their cotangents (per-device partial gradients) are summed by the
        # transpose of this cast.
        return fn(lhs, *[lax.pcast(w, axes, to="varying") for w in weights], seeds, *extra)

    split = jax.sharding.PartitionSpec(axes)
    whole = jax.sharding.PartitionSpec()
    return lambda *args: jax.shard_map(body, in_specs=(split,) + (whole,) * (len(args) - 1), out_specs=split)(*args)


def operand_seeds(recipe: recipes_lib.Recipe, key) -> jax.Array:
    """uint32 (6,): one stochastic-rounding seed per quantized operand (slots FWD_LHS .. WGRAD_RHS), zeros for a
    recipe that rounds to nearest; ValueError when the recipe rounds stochastically and no key is given."""
    if key is not None:
        stochastic.key_to_seed(key)  # validates the key type even where the recipe does not use it
    if not recipe.needs_key:
        return jnp.zeros((6,), jnp.uint32)
    if key is None:
        raise ValueError(f"recipe {recipe.name!r} uses stochastic rounding: pass key=jax.random.key(...) "
                         "(a fresh key per step), or use a recipe without stochastic rounding")
    return jax.random.bits(key, (6,), jnp.uint32)


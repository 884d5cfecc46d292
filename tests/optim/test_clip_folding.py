"""Clipping by the global norm folded into the fused AdamW step (`qjax.optim.clipping`): the same results as optax's
clip followed by the same AdamW, the real train path's peak memory, and the fused kernel's in-register clip.

Bit for bit in the jnp step: `adam_math.clip_gradient` performs optax's ops (a select between g and g divided by the
norm, times max_norm), each rounded to the gradient's dtype as optax's op in that dtype specifies. Rounding to
bfloat16 is a `reduce_precision`, which XLA cannot drop as excess precision (it dropped a pair of casts), and the
division stays under the select as in optax's HLO (XLA:CPU turns a bare x / broadcast(norm) into x * (1 / norm)).
So the folded step equals optax's clip + the same AdamW step exactly, for float32 and bfloat16 gradients, whether the
clip acts or not. The interpreted kernel (which divides by a materialized divisor, for the same reason) equals the
kernel step on optax's clipped gradients bit for bit.
"""

import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import mosaic_gpu_kernel_texts
from ml_collections import ConfigDict

from qjax import dispatch, optim
from qjax.dispatch import on_hopper_gpu
from qjax.optim import adam, adam_math, blockwise, clipping, fused_adam
from qjax.train import make_optimizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from optim import llama_shapes, step_memory  # noqa: E402

SHAPES = {"embed": (100, 256), "w": (64, 64), "norm": (64,), "odd": (33, 64)}  # quantized, small, float32 states
MAKERS = {
    "8bit": lambda: optim.adamw_8bit(optax.linear_schedule(1e-3, 1e-4, 5), weight_decay=0.1,
                                     min_quantized_size=1024, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    "4bit": lambda: optim.adamw_4bit(1e-3, weight_decay=0.1, min_quantized_size=1024),
    "fp8": lambda: optim.adamw_fp8(1e-3, weight_decay=0.1, min_quantized_size=1024),
    "fp32": lambda: optax.adamw(1e-3, weight_decay=0.1),
}
CLIPS = {"acts": 0.05, "idle": 100.0}  # the gradients' global norm is ~1.3


def _bits(x):
    return np.ascontiguousarray(np.atleast_1d(np.asarray(x))).view(np.uint8)


def _assert_bit_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(_bits(x), _bits(y))


def _tree(dtype, seed=0, scale=0.1):
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    return {n: (jax.random.normal(k, s) * scale).astype(dtype) for k, (n, s) in zip(keys, SHAPES.items())}


def _train(tx, params, grads, key=None):
    step = jax.jit(lambda g, s, p, k: optim.apply_gradients(tx, g, s, p, k))
    p, s = params, tx.init(params)
    for i, g in enumerate(grads):
        p, s = step(g, s, p, None if key is None else jax.random.fold_in(key, i))
    return p, s


def test_clip_by_global_norm_is_optax_and_checks_max_norm():
    grads = _tree(jnp.float32)
    ours, theirs = optim.clip_by_global_norm(0.05), optax.clip_by_global_norm(0.05)
    assert isinstance(ours, clipping.ClipByGlobalNorm) and isinstance(ours, optax.GradientTransformation)
    assert ours.max_norm == 0.05
    assert ours.init(grads) == theirs.init(grads)
    _assert_bit_equal(jax.jit(ours.update)(grads, ours.init(grads)), jax.jit(theirs.update)(grads, theirs.init(grads)))
    for bad in (0, -1.0, float("inf"), float("nan"), True, jnp.float32(1.0), "1"):
        with pytest.raises(ValueError, match="positive finite Python number max_norm"):
            optim.clip_by_global_norm(bad)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("max_norm", [0.05, 0.3, 1.0, 1e-30])
def test_clip_gradient_is_optax_arithmetic(dtype, max_norm):
    """The per-tensor formula on gradients spread over 33 decades (subnormal results included) equals optax's clip,
    and its ops evaluated exactly in numpy (float64, rounded once per op to the dtype) where the result is normal."""
    k = jax.random.split(jax.random.key(1), 3)
    magnitude = 10.0 ** jax.random.uniform(k[0], (4096,), minval=-30, maxval=3)
    grads = {"a": (jax.random.normal(k[1], (4096,)) * magnitude).astype(dtype),
             "b": jax.random.normal(k[2], (300,)).astype(dtype)}

    @jax.jit
    def both(grads):
        norm = optax.tree.norm(grads)
        ours = jax.tree.map(lambda g: adam_math.clip_gradient(
            g.astype(jnp.float32), *adam_math.clip_factors(norm, max_norm, g.dtype), g.dtype).astype(g.dtype), grads)
        return ours, optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())[0], norm

    ours, theirs, norm = both(grads)
    _assert_bit_equal(ours, theirs)
    np_dtype = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float32
    norm = np.asarray(norm).astype(np_dtype).astype(np.float64)
    assert norm > max_norm  # the clip acts
    for name, g in grads.items():
        x = np.asarray(g).astype(np.float64)
        exact = ((x / norm).astype(np_dtype).astype(np.float64) * np.float64(np_dtype(max_norm))).astype(np_dtype)
        normal = np.abs(exact.astype(np.float64)) >= np.finfo(np.float32).tiny  # XLA:CPU flushes subnormals
        assert normal.sum() >= 100
        np.testing.assert_array_equal(np.asarray(ours[name])[normal].view(np.uint8), exact[normal].view(np.uint8))


@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_folded_step_equals_optax_clip_then_adamw(name, clip):
    """chain_fused(qjax clip, AdamW).step on float32 params: bit for bit optax.chain(optax clip, AdamW)'s update +
    apply_updates, three steps (params and states). `update` is optax.chain's too."""
    params, grads = _tree(jnp.float32), [_tree(jnp.float32, seed=i + 1, scale=0.02) for i in range(3)]
    folded = optim.chain_fused(optim.clip_by_global_norm(CLIPS[clip]), MAKERS[name]())
    chained = optax.chain(optax.clip_by_global_norm(CLIPS[clip]), MAKERS[name]())
    _assert_bit_equal(_train(folded, params, grads), _train(chained, params, grads))
    state = folded.init(params)
    _assert_bit_equal(jax.jit(folded.update)(grads[0], state, params), jax.jit(chained.update)(grads[0], state, params))


@pytest.mark.parametrize("clip", sorted(CLIPS))
@pytest.mark.parametrize("name", ["8bit", "4bit", "fp8"])
def test_folded_bf16_sr_step_equals_the_step_on_clipped_gradients(name, clip):
    """bfloat16 params and gradients with stochastic rounding: the folded step equals the same fused step given
    optax's clipped gradients (chain_fused with optax's clip, which runs the clip as an update), bit for bit."""
    params, grads = _tree(jnp.bfloat16), [_tree(jnp.bfloat16, seed=i + 1, scale=0.02) for i in range(3)]
    folded = optim.chain_fused(optim.clip_by_global_norm(CLIPS[clip]), MAKERS[name]())
    unfolded = optim.chain_fused(optax.clip_by_global_norm(CLIPS[clip]), MAKERS[name]())
    key = jax.random.key(5)
    p, s = _train(folded, params, grads, key)
    assert p["embed"].dtype == jnp.bfloat16
    _assert_bit_equal((p, s), _train(unfolded, params, grads, key))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_nan_and_inf_gradients_stay_non_finite(dtype):
    """A NaN gradient makes the norm NaN and every update NaN, as optax's clip does; an Inf one makes the norm Inf:
    optax then zeroes the finite gradients and turns the Inf into NaN. The folded step gives the same non-finite
    params (the same NaN positions, the other values bit for bit)."""
    params = _tree(dtype)
    key = jax.random.key(2) if dtype == jnp.bfloat16 else None
    for bad in (jnp.nan, jnp.inf):
        grads = [jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(bad) if g.ndim == 2 else g,
                              _tree(dtype, seed=3, scale=0.02))]
        folded = optim.chain_fused(optim.clip_by_global_norm(1.0), MAKERS["8bit"]())
        unfolded = optim.chain_fused(optax.clip_by_global_norm(1.0), MAKERS["8bit"]())
        (p, _), (p_ref, _) = _train(folded, params, grads, key), _train(unfolded, params, grads, key)
        for name in SHAPES:
            got, want = np.asarray(p[name], np.float32), np.asarray(p_ref[name], np.float32)
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            np.testing.assert_array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
            if bad != bad:  # NaN: every param NaN
                assert np.isnan(got).all(), name
        assert np.isnan(np.asarray(p["embed"], np.float32)[0, 0])  # Inf / Inf


def test_train_path_with_clipping_stays_under_5_bytes_per_param():
    """make_optimizer(grad_clip=1.0, adamw_8bit, stochastic rounding) on bfloat16 params of one 125m Llama layer
    with its embedding and LM head: the step's state + temporaries per param (`step_memory`, as
    test_step_memory.py accounts them) stay <= 5 (a clipped copy of the gradients took 6.1)."""
    opt = ConfigDict(dict(name="adamw_8bit", lr=1e-3, warmup_steps=4, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8,
                          weight_decay=0.1, grad_clip=1.0, stochastic_rounding=True))
    optimizer = make_optimizer(opt, total_steps=100)
    shapes = llama_shapes(d=768, layers=1, heads=12, kv_heads=12, ffn=2048, vocab=32000)
    tree = {name: jax.ShapeDtypeStruct(shape, jnp.bfloat16) for name, shape in shapes.items()}
    memory = step_memory(optimizer.tx, tree, stochastic_rounding=True)
    assert memory["total"] <= 5.0, memory


# ---- the fused kernel's clip (Mosaic GPU interpreter on CPU; compiled on a Hopper GPU) ----

B1, B2, EPS = 0.9, 0.999, 1e-8
FORMATS = {"e4m3": ("e4m3", "e4m3"), "8bit": ("dynamic_signed_8bit", "dynamic_unsigned_8bit"),
           "4bit": ("dynamic_signed_4bit", "linear_unsigned_4bit")}
interpreter_only = pytest.mark.skipif(on_hopper_gpu(), reason="bit-exact only under the CPU interpreter")


def _kernel_inputs(fmt, dtype, nan=False, shape=(32, 256)):
    kp, kg, km, kv = jax.random.split(jax.random.key(4), 4)
    p = (jax.random.normal(kp, shape) * 0.02).astype(dtype)
    g = (jax.random.normal(kg, shape) * 1e-2).astype(dtype)  # global norm ~0.9
    g = g.at[3, 5].set(jnp.nan) if nan else g
    m_format, v_format = FORMATS[fmt]
    block = 128 if fmt == "4bit" else 256
    mu = blockwise.quantize(jax.random.normal(km, shape) * 1e-3, m_format, block)
    nu = blockwise.quantize(jax.random.uniform(kv, shape) ** 4 * 1e-6, v_format, block)
    return p, g, mu, nu, adam.StateConfig(m_format, v_format, block)


COEF = (1 - B1**3, float(np.sqrt(np.float32(1 - B2**3))), -1e-3)


def _kernel(p, g, mu, nu, seed, clip, interpret):
    """One tensor's fused kernel step, jitted, with the clip factors traced (as in the optimizer's step)."""
    step = lambda p, g, mu, nu, seed, clip: fused_adam.fused_step(
        p, g, mu, nu, B1, B2, EPS, *map(jnp.float32, COEF), 0.01, seed=seed, clip=clip, interpret=interpret)
    return jax.jit(step)(p, g, mu, nu, seed, clip)


def _clipped_steps(fmt, dtype, max_norm, nan=False, interpret=True):
    """(kernel step clipping g, kernel step on optax's clipped g, jnp reference step clipping g, unclipped
    reference step), g's global norm ~0.9."""
    p, g, mu, nu, config = _kernel_inputs(fmt, dtype, nan)
    seed = jnp.uint32(99) if dtype == jnp.bfloat16 else None
    clip = adam_math.clip_factors(optax.tree.norm(g), max_norm, dtype)
    clipped = jax.jit(lambda g: optax.clip_by_global_norm(max_norm).update(g, optax.EmptyState())[0])(g)
    reference = jax.jit(lambda p, g, mu, nu, seed, clip: fused_adam.fused_step_reference(
        p, g, mu, nu, config, B1, B2, EPS, *map(jnp.float32, COEF), 0.01, seed, clip=clip))
    return (_kernel(p, g, mu, nu, seed, clip, interpret), _kernel(p, clipped, mu, nu, seed, None, interpret),
            reference(p, g, mu, nu, seed, clip), reference(p, g, mu, nu, seed, None))


@interpreter_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16_sr"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("max_norm,nan", [(0.1, False), (10.0, False), (1.0, True)], ids=["clips", "keeps", "nan"])
def test_kernel_clip_matches_reference(fmt, dtype, max_norm, nan):
    """The kernel clips g in registers (`scale_gradient` with `clip_factors`' scalars) as optax clips it: bit for bit
    the kernel's step on optax's clipped gradient (param, codes, scales); a NaN gradient gives NaN params everywhere.
    Against the jnp reference with the clip: bit for bit, but for float32 gradients that are clipped only to float32
    rounding (XLA:CPU divides by the norm there as a multiply by its reciprocal when the reference is jitted
    alone; in the optimizer's step it divides, test_folded_step_equals_optax_clip_then_adamw)."""
    out, on_clipped, ref, unclipped = _clipped_steps(fmt, dtype, max_norm, nan)
    _assert_bit_equal(out, on_clipped)
    if nan:
        assert np.isnan(np.asarray(out[0], np.float32)).all()
    if dtype == jnp.float32 and max_norm < 1:
        # an ulp of the clipped g moves the step (lr 1e-3) by ~1e-5 of itself: within 1e-4 of it
        np.testing.assert_allclose(np.asarray(out[0]), np.asarray(ref[0]), rtol=0, atol=1e-7)
    else:
        _assert_bit_equal(out, ref)
    if not nan:  # kept: the unclipped step exactly; clipped: another first moment
        assert np.array_equal(_bits(unclipped[1].codes), _bits(out[1].codes)) == (max_norm > 1)


@interpreter_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16_sr"])
def test_folded_apply_gradients_takes_the_kernel(dtype, monkeypatch):
    """use_kernel=True under the interpreter: the folded step sends the eligible tensor to the kernel with the clip
    scalars, and equals the same kernel step on optax's clipped gradients bit for bit."""
    calls = []
    real = fused_adam.fused_step

    def counted(p, *args, **kwargs):
        calls.append(kwargs.get("clip") is not None)
        return real(p, *args, **kwargs)

    monkeypatch.setattr(fused_adam, "fused_step", counted)
    params = {"w": (jax.random.normal(jax.random.key(0), (32, 256)) * 0.1).astype(dtype), "b": jnp.zeros(256, dtype)}
    grads = [jax.tree.map(lambda p, i=i: (jax.random.normal(jax.random.key(i + 1), p.shape) * 1e-2).astype(p.dtype),
                          params) for i in range(2)]
    make = lambda: optim.adamw_8bit(1e-3, weight_decay=0.01, use_kernel=True)
    key = jax.random.key(7) if dtype == jnp.bfloat16 else None
    with dispatch.force("interpret"):
        folded = _train(optim.chain_fused(optim.clip_by_global_norm(0.05), make()), params, grads, key)
        assert calls and all(calls)
        unfolded = _train(optim.chain_fused(optax.clip_by_global_norm(0.05), make()), params, grads, key)
        assert not all(calls)  # the unfolded step's kernel got clipped gradients, no clip scalars
    _assert_bit_equal(folded, unfolded)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_clipped_kernel_lowers_for_hopper(fmt):
    """The kernel with the clip (float32 and bfloat16 gradients) lowers for sm_90 on any host."""
    for dtype in (jnp.float32, jnp.bfloat16):
        p, g, mu, nu, _ = _kernel_inputs(fmt, dtype)
        seed = jnp.uint32(1) if dtype == jnp.bfloat16 else None
        clip = adam_math.clip_factors(optax.tree.norm(g), 0.1, dtype)
        step = lambda p, g, mu, nu, clip: fused_adam.fused_step(p, g, mu, nu, B1, B2, EPS, *map(jnp.float32, COEF),
                                                                0.01, seed=seed, clip=clip)
        lowered = jax.jit(step).trace(p, g, mu, nu, clip).lower(lowering_platforms=("cuda",))
        assert len(mosaic_gpu_kernel_texts(lowered)) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16_sr"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_gpu_kernel_clip_tracks_optax_clip(fmt, dtype):
    """Compiled: the kernel step clipping g against the compiled kernel step on optax's clipped g. The division may
    round differently in Mosaic GPU and XLA: the clipped g differs by an ulp in places, which moves a state code
    across a boundary now and then, and a param near it by a few grid steps. Measured on an H200 (2026-11-28, two
    runs): params beyond one grid step in <= 0.64% of elements; state codes differ in <= 0.84% with bfloat16
    gradients (why bf16 differs more than float32 is not established). A wrong clip scale would move most elements
    (the states are not zero, so the update is not scale-invariant): the bounds are 2%."""
    assert on_hopper_gpu(), jax.devices()
    (p, mu, nu), (p_ref, mu_ref, nu_ref), _, _ = _clipped_steps(fmt, dtype, 0.1, interpret=None)
    p, p_ref = np.asarray(p, np.float32), np.asarray(p_ref, np.float32)
    step = 2.0**-7 if dtype == jnp.bfloat16 else 2.0**-22  # a bf16 grid step / a few float32 ulps, relative
    beyond = np.abs(p - p_ref) > step * np.abs(p_ref) + 1e-9
    print(f"{fmt} {dtype.__name__}: params beyond a grid step in {beyond.mean():.2e} of elements")
    assert beyond.mean() <= 0.02, beyond.mean()
    for got, want in ((mu, mu_ref), (nu, nu_ref)):
        codes, codes_ref = (np.asarray(x.codes).view(np.uint8) for x in (got, want))
        assert np.mean(codes != codes_ref) <= 0.02, np.mean(codes != codes_ref)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # the blocks' scales: a few ulps of g
            if a.dtype == jnp.float32:
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2.0**-7)
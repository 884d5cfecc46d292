"""The fused Mosaic GPU AdamW step kernel (e4m3 with and without range expansion, 8-bit and 4-bit states) against its
jitted jnp reference, and apply_gradients.

On CPU the kernel runs under the Mosaic GPU interpreter and must equal the reference bit for bit: new param, codes
(compared as uint8) and scales / absmax (NaN where the reference has NaN). The reference is jitted because that is
how the optimizer runs it: XLA:CPU's fused code (FMA contraction) differs from op-by-op execution in the last bits,
and the interpreted kernel equals the fused version. GPU tests (marked) use larger tensors; there XLA and Mosaic GPU may
contract multiply-adds differently, so values may differ by ulps and a few codes by e4m3 steps or neighbouring 8-bit
codes (asserted with the bounds below; the mismatch counts are printed), and bfloat16 params rounded stochastically
by a grid step where their random bits sit within those ulps of the carry.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mosaic_gpu_kernel_texts

from qjax import dispatch, optim, stochastic
from qjax.dispatch import on_hopper_gpu
from qjax.kernels import adam_step_mgpu, load_from_gmem, resolve_interpret
from qjax.optim import adam, adam_math, adamw, blockwise, codebooks, fused_adam, sr_params

B1, B2, EPS = 0.9, 0.999, 1e-8
FORMATS = {"e4m3": ("e4m3", "e4m3"), "8bit": ("dynamic_signed_8bit", "dynamic_unsigned_8bit"),
           "4bit": ("dynamic_signed_4bit", "linear_unsigned_4bit"), "dre": ("e4m3_dre", "e4m3_dre")}
# Most interpreter tests run for these only (4-bit: test_4bit_states, range expansion: test_dre_*, for time).
EIGHT_BIT = ["8bit", "e4m3"]
GPU_TWINS = [*EIGHT_BIT, "dre"]  # GPU tests of the interpreter tests' formats
ADAMW = {"e4m3": optim.adamw_fp8, "8bit": optim.adamw_8bit, "4bit": optim.adamw_4bit,
         "dre": functools.partial(optim.adamw_fp8, dynamic_range_expansion=True)}


def _config(fmt="e4m3", block_size=256):
    return adam.StateConfig(*FORMATS[fmt], block_size)


def _coefficients(step, lr=1e-3):
    return jnp.float32(1 - B1**step), jnp.sqrt(jnp.float32(1 - B2**step)), jnp.float32(-lr)


@functools.partial(jax.jit, static_argnames=("config", "weight_decay"))
def _reference(p, g, mu, nu, bc1, bc2_sqrt, step_size, config=_config(), weight_decay=0.01):
    return fused_adam.fused_step_reference(p, g, mu, nu, config, B1, B2, EPS, bc1, bc2_sqrt, step_size,
                                           weight_decay)


def _kernel(p, g, mu, nu, bc1, bc2_sqrt, step_size, weight_decay=0.01):
    interpret = None if on_hopper_gpu() else True
    # Jitted: run eagerly, interpreted kernels can deadlock with the next eager op (benchmarks/NOTES.md).
    step = lambda p, g, mu, nu, *c: fused_adam.fused_step(p, g, mu, nu, B1, B2, EPS, *c, weight_decay,
                                                          interpret=interpret)
    return jax.jit(step)(p, g, mu, nu, bc1, bc2_sqrt, step_size)


def _inputs(shape, seed=0, block_size=256, zero_states=False, fmt="e4m3", zero_block=None):
    """Param, gradient and quantized moments with Adam-like magnitudes (m ~ g, v ~ g**2, spread over decades).
    zero_block: the index of a block whose gradient and moments are all zero."""
    kp, kg, km, kv, ks = jax.random.split(jax.random.key(seed), 5)
    p = jax.random.normal(kp, shape) * 0.02
    g = jax.random.normal(kg, shape) * 1e-3 * 10.0 ** jax.random.uniform(ks, shape, minval=-2, maxval=1)
    m = jax.random.normal(km, shape) * 1e-3
    v = jax.random.uniform(kv, shape) ** 4 * 1e-6
    if zero_states:
        m, v = jnp.zeros(shape), jnp.zeros(shape)
    if zero_block is not None:
        g, m, v = (x.reshape(-1, block_size).at[zero_block].set(0.0).reshape(shape) for x in (g, m, v))
    m_format, v_format = FORMATS[fmt]
    return p, g, blockwise.quantize(m, m_format, block_size), blockwise.quantize(v, v_format, block_size)


# Bit-exactness holds under the CPU interpreter; the compiled kernel on a GPU is covered by the gpu tests below.
interpreter_only = pytest.mark.skipif(on_hopper_gpu(), reason="bit-exact only under the CPU interpreter")


def _bits(x):
    return np.asarray(x).reshape(-1).view(np.uint8)


def _scale(state):
    """A quantized state's per-block scale (e4m3 formats) or absmax (code books): the first of its per-block arrays."""
    return fused_adam._state_arrays(state)[1]


def _assert_identical(out, ref):
    (p, mu, nu), (p_ref, mu_ref, nu_ref) = out, ref
    assert p.dtype == jnp.float32 and p.shape == p_ref.shape
    np.testing.assert_array_equal(np.asarray(p), np.asarray(p_ref))  # NaN == NaN here
    for got, want in ((mu, mu_ref), (nu, nu_ref)):
        assert type(got) is type(want) and got.shape == want.shape
        assert got.codes.dtype == want.codes.dtype and got.codes.shape == want.codes.shape
        np.testing.assert_array_equal(_bits(got.codes), _bits(want.codes))
        for row, row_ref in zip(fused_adam._state_arrays(got)[1:], fused_adam._state_arrays(want)[1:], strict=True):
            assert row.dtype == row_ref.dtype and row.shape == row_ref.shape
            np.testing.assert_array_equal(np.asarray(row, np.float32), np.asarray(row_ref, np.float32))


@interpreter_only
@pytest.mark.parametrize("fmt", EIGHT_BIT)
@pytest.mark.parametrize("shape,step,weight_decay", [
    ((64, 256), 1, 0.01),       # 64 blocks: 8 programs, one tile of 8 blocks each
    ((24, 256), 7, 0.0),        # 24 blocks: 3 tiles, 3 programs; no weight decay (optax skips the add)
    ((20, 16, 16), 100, 0.1),   # 20 blocks of a 3-d param: 5 programs
])
def test_kernel_matches_reference(fmt, shape, step, weight_decay):
    p, g, mu, nu = _inputs(shape, seed=step, fmt=fmt)
    c = _coefficients(step)
    _assert_identical(_kernel(p, g, mu, nu, *c, weight_decay=weight_decay),
                      _reference(p, g, mu, nu, *c, config=_config(fmt), weight_decay=weight_decay))


@interpreter_only
@pytest.mark.parametrize("fmt", EIGHT_BIT)
@pytest.mark.parametrize("shape", [(40, 128), (44, 128)])  # 8-row tiles; 44 blocks: 4-row tiles (44 % 8 != 0)
def test_block_128(fmt, shape):
    p, g, mu, nu = _inputs(shape, seed=3, block_size=128, fmt=fmt)
    c = _coefficients(3)
    _assert_identical(_kernel(p, g, mu, nu, *c), _reference(p, g, mu, nu, *c, config=_config(fmt, 128)))


@interpreter_only
@pytest.mark.parametrize("fmt", EIGHT_BIT)
def test_zero_gradient(fmt):
    c = _coefficients(1)
    p, g, mu, nu = _inputs((8, 256), zero_states=True, fmt=fmt)
    out = _kernel(p, jnp.zeros_like(g), mu, nu, *c, weight_decay=0.0)
    _assert_identical(out, _reference(p, jnp.zeros_like(g), mu, nu, *c, config=_config(fmt), weight_decay=0.0))
    # 0 / (0 + eps) = 0: the param is unchanged, the states stay zero (e4m3 scale 1, 8-bit absmax 0).
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(p))
    assert np.all(np.asarray(_scale(out[1])) == (1 if fmt == "e4m3" else 0))
    assert not np.any(np.asarray(blockwise.dequantize(out[1]))) and not np.any(np.asarray(blockwise.dequantize(out[2])))
    p, g, mu, nu = _inputs((8, 256), seed=5, fmt=fmt)  # non-zero states decay
    _assert_identical(_kernel(p, jnp.zeros_like(g), mu, nu, *c),
                      _reference(p, jnp.zeros_like(g), mu, nu, *c, config=_config(fmt)))


@interpreter_only
@pytest.mark.parametrize("fmt", EIGHT_BIT)
def test_nan_and_inf_gradients(fmt):
    p, g, mu, nu = _inputs((12, 256), seed=6, fmt=fmt)
    g = g.at[1, 7].set(jnp.nan).at[5, 0].set(jnp.inf).at[9, 255].set(-jnp.inf)
    c = _coefficients(2)
    out = _kernel(p, g, mu, nu, *c)
    _assert_identical(out, _reference(p, g, mu, nu, *c, config=_config(fmt)))
    p_new, mu_new, _ = out
    assert np.isnan(p_new[1, 7]) and np.isfinite(np.delete(np.asarray(p_new[1]), 7)).all()
    scale = np.asarray(_scale(mu_new))
    assert np.isnan(scale[1]) and np.isinf(scale[5]) and np.isfinite(np.delete(scale, [1, 5, 9])).all()


@interpreter_only
@pytest.mark.parametrize("rows", [44, 64])  # 11 tiles of 4 rows; 4 tiles of 16 rows
def test_4bit_states(rows):
    """adamw_4bit's states (two codes per byte, unpacked and packed in registers): bit for bit the reference, with
    tiles of 128-element blocks and NaN / Inf gradients."""
    p, g, mu, nu = _inputs((rows, 128), seed=8, block_size=128, fmt="4bit")
    assert mu.codes.shape == (rows, 64) and fused_adam.kernel_eligible(p, g, mu, nu)
    g = g.at[1, 7].set(jnp.nan).at[5, 0].set(jnp.inf)
    c = _coefficients(4)
    out = _kernel(p, g, mu, nu, *c)
    _assert_identical(out, _reference(p, g, mu, nu, *c, config=_config("4bit", 128)))
    assert np.isnan(np.asarray(_scale(out[1]))[1]) and np.isinf(np.asarray(_scale(out[1]))[5])


@interpreter_only
def test_dre_states():
    """COAT's range-expanded e4m3 states (codes, scale, 16 k, centre): bit for bit the reference, float32 params,
    4-row tiles of blocks of 128 (3 programs), with an all-zero block (it stays exactly zero: scale 1, k 1, centre 1)
    and NaN / Inf gradients (NaN stays visible in the param and spreads to its block's state, never a finite value)."""
    shape, block_size, weight_decay = (12, 128), 128, 0.01
    p, g, mu, nu = _inputs(shape, seed=3, block_size=block_size, fmt="dre", zero_block=1)
    g = g.at[2, 7].set(jnp.nan).at[3, 0].set(jnp.inf)
    c = _coefficients(3)
    out = _kernel(p, g, mu, nu, *c, weight_decay=weight_decay)
    _assert_identical(out, _reference(p, g, mu, nu, *c, config=_config("dre", block_size)))
    p_new, mu_new, nu_new = out
    assert isinstance(mu_new, blockwise.Fp8ExpandedState) and mu_new.expand.dtype == jnp.uint8
    for state in (mu_new, nu_new):
        m = np.asarray(blockwise.dequantize(state)).reshape(-1, block_size)
        assert not np.any(m[1]) and float(state.scale[1]) == 1 and int(state.expand[1]) == 16
        assert float(state.centre[1]) == 1
        assert np.isnan(m[2]).all() and np.isnan(m[3]).all() and np.isfinite(np.delete(m, [2, 3], axis=0)).all()
    flat_p = np.asarray(p_new).reshape(-1, block_size)
    assert np.isnan(flat_p[2, 7]) and np.isfinite(np.delete(flat_p[2], 7)).all()
    # the zero block's direction is 0 / (0 + eps) = 0: only weight decay moves its params
    p_old = np.asarray(p).reshape(-1, block_size)
    np.testing.assert_allclose(flat_p[1], p_old[1] * (1 - 1e-3 * weight_decay), rtol=1e-6)


@interpreter_only
def test_dre_bf16_params_with_stochastic_rounding():
    """bfloat16 param and gradient with a seed and range-expanded states in blocks of 256: bit for bit the
    reference's stochastic rounding and states, with a zero block and a NaN gradient (one program of 8 blocks)."""
    p, g, mu, nu = _inputs((4, 512), seed=4, fmt="dre", zero_block=1)
    p, g = p.astype(jnp.bfloat16), g.at[2, 3].set(jnp.nan).astype(jnp.bfloat16)
    c, seed = _coefficients(2), jnp.uint32(777)
    kernel = jax.jit(lambda p, g, mu, nu, seed, *c: fused_adam.fused_step(p, g, mu, nu, B1, B2, EPS, *c, 0.01,
                                                                          seed=seed, interpret=True))
    reference = jax.jit(lambda p, g, mu, nu, seed, *c: fused_adam.fused_step_reference(
        p, g, mu, nu, _config("dre"), B1, B2, EPS, *c, 0.01, seed))
    (p_k, mu_k, nu_k), (p_r, mu_r, nu_r) = kernel(p, g, mu, nu, seed, *c), reference(p, g, mu, nu, seed, *c)
    assert p_k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(p_k), _bits(p_r))
    _assert_identical((p_k.astype(jnp.float32), mu_k, nu_k), (p_r.astype(jnp.float32), mu_r, nu_r))
    assert np.isnan(np.asarray(p_k[2, 3], np.float32)) and np.isnan(np.asarray(_scale(mu_k))[4])
    assert not np.any(np.asarray(blockwise.dequantize(mu_k)).reshape(-1, 256)[1])


@interpreter_only
@pytest.mark.parametrize("fmt", EIGHT_BIT)
@pytest.mark.parametrize("shape,block_size", [((24, 256), 256), ((44, 128), 128), ((64, 256), 256)])
def test_bf16_params_with_stochastic_rounding(fmt, shape, block_size):
    """bfloat16 param and gradient with a seed: the kernel rounds the float32 new param stochastically with the
    reference's bits (`sr_params.round_param`), bit for bit, NaN and Inf gradients included; the states as for
    float32 params."""
    p, g, mu, nu = _inputs(shape, seed=4, block_size=block_size, fmt=fmt)
    p, g = p.astype(jnp.bfloat16), g.at[1, 7].set(jnp.nan).at[5, 0].set(jnp.inf).astype(jnp.bfloat16)
    c, seed = _coefficients(2), jnp.uint32(12345)
    interpret = None if on_hopper_gpu() else True
    kernel = jax.jit(lambda p, g, mu, nu, seed, *c: fused_adam.fused_step(p, g, mu, nu, B1, B2, EPS, *c, 0.01,
                                                                          seed=seed, interpret=interpret))
    reference = jax.jit(lambda p, g, mu, nu, seed, *c: fused_adam.fused_step_reference(
        p, g, mu, nu, _config(fmt, block_size), B1, B2, EPS, *c, 0.01, seed))
    (p_k, mu_k, nu_k), (p_r, mu_r, nu_r) = kernel(p, g, mu, nu, seed, *c), reference(p, g, mu, nu, seed, *c)
    assert p_k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(p_k), _bits(p_r))
    _assert_identical((p_k.astype(jnp.float32), mu_k, nu_k), (p_r.astype(jnp.float32), mu_r, nu_r))
    assert np.isnan(np.asarray(p_k[1, 7], np.float32))
    # the rounding is stochastic: rounding to nearest would give other bits for some elements
    nearest = fused_adam.fused_step_reference(p, g, mu, nu, _config(fmt, block_size), B1, B2, EPS, *c, 0.01)[0]
    assert not np.array_equal(_bits(nearest), _bits(p_k))


def _train(use_kernel, params, grads, lr=1e-3, mask=None, weight_decay=0.01, fmt="e4m3"):
    make = ADAMW[fmt]
    tx = make(lr, weight_decay=weight_decay, mask=mask, use_kernel=use_kernel)
    p, state = params, tx.init(params)
    step = jax.jit(lambda p, s, g: optim.apply_gradients(tx, g, s, p))
    for g in grads:
        p, state = step(p, state, g)
    return p, state


@pytest.fixture
def kernel_calls(monkeypatch):
    """Runs use_kernel=True steps through the interpreted kernel (`dispatch.force`) and records each fused_step
    call's shape."""
    calls = []
    real = fused_adam.fused_step

    def counted(p, *args, **kwargs):
        calls.append(p.shape)
        return real(p, *args, **kwargs)

    monkeypatch.setattr(fused_adam, "fused_step", counted)
    with dispatch.force("interpret"):
        yield calls


@interpreter_only
@pytest.mark.parametrize("lr,mask,fmt", [
    (optax.linear_schedule(1e-3, 5e-4, 10), {"w": True, "u": False, "h": True, "b": False, "r": True}, "e4m3"),
    (1e-3, lambda params: jax.tree.map(lambda p: p.ndim >= 2, params), "e4m3"),  # callable mask (train.py's)
    (optax.linear_schedule(1e-3, 5e-4, 10), {"w": True, "u": False, "h": True, "b": False, "r": True}, "8bit"),
])
def test_apply_gradients_kernel_equals_optax_path(kernel_calls, lr, mask, fmt):
    """Three steps through apply_gradients with the kernel vs without it (tx.update + optax.apply_updates, one jit):
    quantized (kernel) tensors with and without weight decay, a bf16 one, a small float32-state one and a quantized
    one with 18 blocks (not a multiple of 4: optax path). States are equal bit for bit. Params of the kernel tensors
    differ by float32 rounding: in the optax path XLA fuses the direction into `p + lr * (d + wd * p)` and contracts
    other multiply-adds into FMAs than it does for `fused_step_reference` alone (which the kernel equals exactly)."""
    k = jax.random.split(jax.random.key(0), 5)
    params = {"w": jax.random.normal(k[0], (32, 256)) * 0.1, "u": jax.random.normal(k[1], (16, 256)) * 0.1,
              "h": (jax.random.normal(k[2], (16, 256)) * 0.1).astype(jnp.bfloat16), "b": jnp.zeros(256),
              "r": jax.random.normal(k[3], (18, 256)) * 0.1}
    grads = [jax.tree.map(lambda p, i=i: (jax.random.normal(jax.random.key(i + 1), p.shape) * 1e-2).astype(p.dtype),
                          params) for i in range(3)]
    p_kernel, s_kernel = _train(True, params, grads, lr, mask, fmt=fmt)
    assert set(kernel_calls) == {(32, 256), (16, 256)}  # traced once per kernel tensor: w, u (in the jit)
    (p_optax, s_optax), n_calls = _train(False, params, grads, lr, mask, fmt=fmt), len(kernel_calls)
    assert len(kernel_calls) == n_calls  # use_kernel=False never calls it
    state_type = blockwise.Fp8State if fmt == "e4m3" else blockwise.CodebookState
    assert all(isinstance(s_kernel.mu[n], state_type) for n in ("w", "u", "h", "r"))
    same = jax.tree.map(lambda a, b: np.array_equal(_bits(a), _bits(b)), s_kernel, s_optax)
    assert all(jax.tree.leaves(same)), same
    for name in ("h", "b", "r"):  # not eligible: the optax path itself
        np.testing.assert_array_equal(_bits(p_kernel[name]), _bits(p_optax[name]))
    for name in ("w", "u"):  # |p| <= ~0.4: a float32 ulp there is <= 3e-8
        np.testing.assert_allclose(np.asarray(p_kernel[name]), np.asarray(p_optax[name]), rtol=0, atol=6e-8)


@interpreter_only
def test_apply_gradients_bf16_sr_takes_the_kernel(kernel_calls):
    """bfloat16 params and gradients with a key: apply_gradients sends each eligible tensor to the kernel (with its
    leaf seed), and two steps equal use_kernel=False's streamed jnp step bit for bit (interpreter); without a key
    bfloat16 params stay on the jnp step (rounded to nearest)."""
    params = {"w": (jax.random.normal(jax.random.key(1), (32, 256)) * 0.1).astype(jnp.bfloat16),
              "b": jnp.zeros(256, jnp.bfloat16)}
    grads = [jax.tree.map(lambda p, i=i: (jax.random.normal(jax.random.key(i + 1), p.shape) * 1e-2).astype(p.dtype),
                          params) for i in range(2)]

    def train(use_kernel, key):
        tx = optim.adamw_8bit(1e-3, weight_decay=0.01, use_kernel=use_kernel)
        p, state = params, tx.init(params)
        step = jax.jit(lambda p, s, g, k: optim.apply_gradients(tx, g, s, p, k))
        for i, g in enumerate(grads):
            p, state = step(p, state, g, None if key is None else jax.random.fold_in(key, i))
        return p, state

    with_kernel = train(True, jax.random.key(7))
    assert set(kernel_calls) == {(32, 256)}  # w
    n_calls = len(kernel_calls)
    without = train(False, jax.random.key(7))
    assert with_kernel[0]["w"].dtype == jnp.bfloat16
    for a, b in zip(jax.tree.leaves(with_kernel), jax.tree.leaves(without)):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    train(True, None)
    assert len(kernel_calls) == n_calls  # no new call


@interpreter_only
def test_dre_apply_gradients_takes_the_kernel(kernel_calls):
    """adamw_fp8(dynamic_range_expansion=True, use_kernel=True): apply_gradients sends the eligible tensor to the
    kernel; two steps equal use_kernel=False's streamed jnp step: states bit for bit, params to float32 rounding (as
    in test_apply_gradients_kernel_equals_optax_path)."""
    params = {"w": jax.random.normal(jax.random.key(0), (32, 128)) * 0.1, "b": jnp.zeros(128)}
    grads = [jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.key(i + 1), p.shape) * 1e-2, params)
             for i in range(2)]
    p_kernel, s_kernel = _train(True, params, grads, fmt="dre")
    assert set(kernel_calls) == {(32, 128)}
    p_jnp, s_jnp = _train(False, params, grads, fmt="dre")
    assert isinstance(s_kernel.mu["w"], blockwise.Fp8ExpandedState)
    for a, b in zip(jax.tree.leaves(s_kernel), jax.tree.leaves(s_jnp)):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    np.testing.assert_array_equal(_bits(p_kernel["b"]), _bits(p_jnp["b"]))
    np.testing.assert_allclose(np.asarray(p_kernel["w"]), np.asarray(p_jnp["w"]), rtol=0, atol=6e-8)


def test_use_kernel_off_hopper_takes_the_optax_path():
    params = {"w": jnp.ones((16, 256))}
    if on_hopper_gpu():
        pytest.skip("on a Hopper GPU the kernel runs")
    assert dispatch.kernel_mode() == (False, False)
    tx = optim.adamw_fp8(1e-3, use_kernel=True)
    text = jax.jit(lambda p, s, g: optim.apply_gradients(tx, g, s, p)).lower(params, tx.init(params), params).as_text()
    assert "mosaic" not in text.lower()


@interpreter_only
@pytest.mark.parametrize("fmt", EIGHT_BIT)
def test_chain_fused_clips_then_takes_the_kernel(kernel_calls, fmt):
    """chain_fused(clip, adamw) steps through the kernel with the clipped gradients: bit for bit the bare adamw's
    kernel step on gradients clipped by hand. Wrapped in optax.chain it is the optax path (no kernel call)."""
    params = {"w": jax.random.normal(jax.random.key(0), (32, 256)) * 0.1, "b": jnp.zeros(256)}
    grads = [jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.key(i + 1), p.shape) * 1e-2, params)
             for i in range(3)]
    make = lambda: ADAMW[fmt](
        optax.linear_schedule(1e-3, 5e-4, 10), weight_decay=0.01, use_kernel=True)
    clip = optax.clip_by_global_norm(0.1)  # global norm ~0.9: clipping acts
    tx, bare = optim.chain_fused(clip, make()), make()
    step = jax.jit(lambda p, s, g: optim.apply_gradients(tx, g, s, p))
    by_hand = jax.jit(lambda p, s, g: optim.apply_gradients(bare, clip.update(g, optax.EmptyState())[0], s, p))
    (p, s), (p_hand, s_hand) = (params, tx.init(params)), (params, bare.init(params))
    for g in grads:
        (p, s), (p_hand, s_hand) = step(p, s, g), by_hand(p_hand, s_hand, g)
        assert jax.tree.structure((p, s[1])) == jax.tree.structure((p_hand, s_hand))
        for a, b in zip(jax.tree.leaves((p, s[1])), jax.tree.leaves((p_hand, s_hand))):
            np.testing.assert_array_equal(_bits(a), _bits(b))
    # traced in each jit, the chain's step and the bare one (a full-suite run once saw a jit retrace at step 2)
    assert set(kernel_calls) == {(32, 256)} and len(kernel_calls) >= 2
    n_calls, chained = len(kernel_calls), optax.chain(clip, make())
    jax.jit(lambda p, s, g: optim.apply_gradients(chained, g, s, p))(params, chained.init(params), grads[0])
    assert len(kernel_calls) == n_calls


def test_apply_gradients_any_optax_transformation():
    params = {"w": jnp.ones((4, 3))}
    grads = {"w": jnp.full((4, 3), 0.5)}
    tx = optax.sgd(0.1)
    p, state = optim.apply_gradients(tx, grads, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(p["w"]), 0.95)
    assert isinstance(optim.adamw_fp8(1e-3), adamw.FusedTransformation)


def test_errors():
    with pytest.raises(ValueError, match="use_kernel=True: the fused kernel supports e4m3"):
        optim.adamw_fp8(1e-3, block_size=64, use_kernel=True)
    assert isinstance(optim.adamw_fp8(1e-3, dynamic_range_expansion=True, use_kernel=True), adamw.FusedTransformation)
    with pytest.raises(ValueError, match="use_kernel=True: the fused kernel supports e4m3"):
        optim.adamw_fp8(1e-3, dynamic_range_expansion=True, block_size=64, use_kernel=True)
    p, g, mu, nu = _inputs((4, 256))
    c = _coefficients(1)
    assert fused_adam.kernel_eligible(p, g, mu, nu)
    with pytest.raises(ValueError, match="float32 p and g"):
        fused_adam.fused_step(p, g.astype(jnp.bfloat16), mu, nu, B1, B2, EPS, *c, 0.0, interpret=True)
    with pytest.raises(ValueError, match="moments in"):
        fused_adam.fused_step(p, g, mu, blockwise.dequantize(nu), B1, B2, EPS, *c, 0.0, interpret=True)
    *_, nu8 = _inputs((4, 256), fmt="8bit")  # m e4m3 with v 8-bit: not a kernel pair
    assert fused_adam.kernel_eligible(*_inputs((4, 256), fmt="8bit")) and not fused_adam.kernel_eligible(p, g, mu, nu8)
    with pytest.raises(ValueError, match="use_kernel=True"):
        adamw.quantized_adamw(adam.StateConfig("dynamic_signed_4bit", "linear_unsigned_4bit", 64), 1e-3,
                              use_kernel=True)
    assert isinstance(optim.adamw_4bit(1e-3, use_kernel=True), adamw.FusedTransformation)
    p6, g6, mu6, nu6 = _inputs((6, 256))  # 6 blocks: not a multiple of 4 -> not eligible (optax path)
    assert not fused_adam.kernel_eligible(p6, g6, mu6, nu6)
    with pytest.raises(ValueError, match="shapes differ"):
        fused_adam.fused_step(p.reshape(-1), g, mu, nu, B1, B2, EPS, *c, 0.0, interpret=True)


def _codec_in_kernel(codes, x, map_name, interpret):
    """The fused step's 8-bit codec inside a Mosaic GPU kernel, with its register layout and table lookups: decoded
    `codes` and `codebooks.encode_unit(x)`; codes uint8 (n, 256), x float32 (n, 256), n % 4 == 0 -> (float32, uint8)."""
    assert codes.shape == x.shape and codes.shape[0] % 4 == 0, (codes.shape, x.shape)
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    qmap = codebooks.get_map(map_name)
    params = resolve_interpret(interpret)

    def body(table_ref, codes_ref, x_ref, values_ref, encoded_ref):
        tile = pl.ds(lax.axis_index("program") * 4, 4)
        table = functools.partial(adam_step_mgpu._lookup, table_ref, interpret=params is not None)
        codes = load_from_gmem(codes_ref.at[tile], adam_step_mgpu._LAYOUT)
        values_ref.at[tile][...] = adam_step_mgpu._dequantize_rows(codes, (jnp.ones(4, jnp.float32),), map_name,
                                                                   table)
        encoded_ref.at[tile][...] = codebooks.encode_unit(
            load_from_gmem(x_ref.at[tile], adam_step_mgpu._LAYOUT), qmap, table)

    out = (jax.ShapeDtypeStruct(codes.shape, jnp.float32), jax.ShapeDtypeStruct(x.shape, jnp.uint8))
    run = plgpu.kernel(body, out_type=out, grid=(codes.shape[0] // 4,), grid_names=("program",), interpret=params)
    return jax.jit(run)(adam_step_mgpu.code_table(map_name), codes, x)


def _check_codec_in_kernel(map_name, interpret):
    """The kernel's codec is exact, interpreted or compiled (lookups, comparisons and float32 arithmetic that is
    exact or the same in XLA and Mosaic GPU): decoded codes are bit-equal to the table, and encoded probes (every map
    value and decision midpoint +- 3 ulps, zeros, +-1, NaN) equal brute force."""
    qmap = codebooks.get_map(map_name)
    mids = ((qmap[:-1].astype(np.float64) + qmap[1:]) / 2).astype(np.float32)
    near = [qmap, mids]
    for _ in range(3):  # +- 3 ulps around every map value and decision midpoint
        near += [np.nextafter(near[-2], np.float32(np.inf)), np.nextafter(near[-1], np.float32(-np.inf))]
    probes = np.concatenate(near + [np.array([0.0, -0.0, 1.0, -1.0, np.nan], np.float32)])
    probes = np.concatenate([probes, -probes])
    probes = probes[np.isnan(probes) | (np.abs(probes) <= np.nextafter(np.float32(1), np.float32(2)))]
    x = np.zeros(-(-probes.size // 1024) * 1024, np.float32)
    x[:probes.size] = probes
    rows = x.size // 256
    codes = np.tile(np.arange(256, dtype=np.uint8), (rows, 1))  # every code in every row
    values, encoded = _codec_in_kernel(jnp.asarray(codes), jnp.asarray(x.reshape(rows, 256)), map_name, interpret)
    values, encoded = np.asarray(values), np.asarray(encoded).reshape(-1)
    np.testing.assert_array_equal(values.view(np.int32), np.tile(qmap, (rows, 1)).view(np.int32))
    np.testing.assert_array_equal(encoded, np.asarray(codebooks.encode_brute_force(jnp.asarray(x), qmap)))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_lowers_for_hopper(fmt):
    """The Mosaic GPU lowering succeeds for sm_90 on any host (the 8-bit path with its SMEM tables and lookups),
    with no CTA-wide barrier around the stores (`qjax.kernels.NO_AUTO_BARRIERS`)."""
    p, g, mu, nu = _inputs((16, 256), fmt=fmt)
    step = lambda p, g, mu, nu: fused_adam.fused_step(p, g, mu, nu, B1, B2, EPS, *_coefficients(3), 0.01)
    lowered = jax.jit(step).trace(p, g, mu, nu).lower(lowering_platforms=("cuda",))
    (kernel,) = mosaic_gpu_kernel_texts(lowered)
    assert "mbarrier.init" in kernel or fmt in ("e4m3", "dre")  # the code tables' TMA barriers: the module is read
    assert "bar.sync" not in kernel


def _check_nibbles_in_kernel(block, interpret):
    """The kernel's 4-bit code (un)packing in registers, interpreted or compiled: every byte value, unpacked in
    `_LAYOUT`, equals `codebooks.unpack_4bit`, and packed back equals the input."""
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    packed = np.tile(np.arange(256, dtype=np.uint8), 8 * block // 2 // 256 + 1)[:8 * block // 2].reshape(8, -1)
    params = resolve_interpret(interpret)

    def body(packed_ref, codes_ref, repacked_ref):
        tile = pl.ds(lax.axis_index("program") * 4, 4)
        codes = adam_step_mgpu._unpack(load_from_gmem(packed_ref.at[tile], adam_step_mgpu._PACKED_LAYOUT),
                                       params is not None)
        codes_ref.at[tile][...] = codes
        repacked_ref.at[tile][...] = adam_step_mgpu._pack(codes, params is not None)

    out = (jax.ShapeDtypeStruct((8, block), jnp.uint8), jax.ShapeDtypeStruct((8, block // 2), jnp.uint8))
    codes, repacked = jax.jit(plgpu.kernel(body, out_type=out, grid=(2,), grid_names=("program",),
                                           interpret=params))(jnp.asarray(packed))
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(codebooks.unpack_4bit(jnp.asarray(packed))))
    np.testing.assert_array_equal(np.asarray(repacked), packed)


def _check_bf16_words_in_kernel(interpret):
    """The kernel's split of hash words into bfloat16 rounding bits in registers, interpreted or compiled: words of
    (8, 128) in `_PACKED_LAYOUT` give the (8, 256) bits in `_LAYOUT` that `stochastic.bf16_bits` draws for the
    elements 2j and 2j + 1 of word j."""
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    index = np.arange(8 * 256, dtype=np.uint32).reshape(8, 256)
    words = np.asarray(stochastic.hash_uint32(jnp.uint32(5), jnp.asarray(index[:, ::2] >> 1)))
    params = resolve_interpret(interpret)

    def body(words_ref, bits_ref):
        tile = pl.ds(lax.axis_index("program") * 4, 4)
        bits_ref.at[tile][...] = adam_step_mgpu._split_words(
            load_from_gmem(words_ref.at[tile], adam_step_mgpu._PACKED_LAYOUT), params is not None)

    bits = jax.jit(plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8, 256), jnp.uint32), grid=(2,),
                                grid_names=("program",), interpret=params))(jnp.asarray(words))
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(stochastic.bf16_bits(jnp.uint32(5), index)))


@interpreter_only
def test_nibbles_in_kernel():
    _check_nibbles_in_kernel(128, interpret=True)


@interpreter_only
def test_bf16_words_in_kernel():
    _check_bf16_words_in_kernel(interpret=True)


@interpreter_only
@pytest.mark.parametrize("map_name", ["dynamic_signed_8bit", "dynamic_unsigned_8bit"])
def test_codec_in_kernel(map_name):
    _check_codec_in_kernel(map_name, interpret=True)


# ---------------------------------------------------------------- GPU (H100/H200): compiled kernel vs XLA:GPU jnp

def _ulps(a, b):
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def _code_steps(state):
    """A state's codes as integers whose differences count steps between neighbouring values: code book codes index
    a sorted map (4-bit ones unpacked); e4m3 codes (sign-magnitude) become signed step counts from zero, so +0 and -0
    are both 0."""
    codes = state.codes
    if isinstance(state, blockwise.CodebookState):
        codes = codebooks.unpack_4bit(codes) if blockwise.CODEBOOK_FORMATS[state.qmap] == 4 else codes
        return np.asarray(codes).astype(np.int32)
    bits = np.asarray(codes).view(np.uint8).astype(np.int32)
    return np.where(bits & 0x80, -(bits & 0x7F), bits & 0x7F)


def _same(a, b):
    """Elementwise equality of two arrays as float32, NaN equal to NaN."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return (a == b) | (np.isnan(a) & np.isnan(b))


def _assert_close_gpu(out, ref, label):
    """Kernel vs XLA:GPU reference: FMA contraction may differ (module docstring), so allow ulp-level differences.
    Range-expanded states (e4m3_dre) also take exp and log per element, which may differ by ulps between XLA:GPU
    and Mosaic GPU: looser bounds for them. Their k and centre are integer functions of the block's max and min |x|
    (`adam_math.expansion_params`, bit for bit on the same blocks: `test_gpu_dre_diagnosis`), so they differ only
    where FMA contraction moved that max or min (a CPU simulation of FMA vs none on these inputs: ~1e-4 of blocks);
    such blocks are counted apart."""
    (p, mu, nu), (p_ref, mu_ref, nu_ref) = out, ref
    dre = isinstance(mu_ref, blockwise.Fp8ExpandedState)
    p, p_ref = np.asarray(p), np.asarray(p_ref)
    np.testing.assert_array_equal(np.isnan(p), np.isnan(p_ref))
    # Nearly all params agree to 2 ulps plus ~1e-5 relative of the update lr * |d + wd * p|. Where v decoded to
    # (almost) zero, d = m / (sqrt(v) + eps) is ill-conditioned (up to ~1e5) and FMA rounding shows at ~1e-4 relative.
    finite = np.isfinite(p_ref)
    off = np.abs(p - p_ref)[finite] > (2e-6 if dre else 2.4e-7) * np.abs(p_ref[finite]) + 1e-8
    assert off.mean() <= 1e-3, (label, off.mean())
    np.testing.assert_allclose(p, p_ref, rtol=1e-3, atol=1e-8, err_msg=label)
    report = [f"{label}: params exact {np.mean(p == p_ref) if p.size else 1:.6f}, beyond 2 ulps {off.mean():.2e}"]
    for name, got, want in (("m", mu, mu_ref), ("v", nu, nu_ref)):
        scale, scale_ref = np.asarray(_scale(got)), np.asarray(_scale(want))
        np.testing.assert_array_equal(np.isnan(scale), np.isnan(scale_ref))
        same_params = np.ones(scale.shape, bool)
        if dre:  # 16 k and the centre: exact functions of the block's max and min |x|
            same_params = _same(got.expand, want.expand) & _same(got.centre, want.centre)
            assert np.mean(~same_params) <= 1e-3, (name, np.mean(~same_params))
        finite = np.isfinite(scale_ref) & same_params
        ulps = _ulps(scale[finite], scale_ref[finite])
        # m and v = old + (1 - b) * (new - old) may each round differently under FMA contraction (an ulp or two),
        # and absmax / 448 can land in the binade below absmax's, where ulps are half as large (3 seen on an H100).
        # With range expansion the scale is exp(k log(max / centre)) / 448, k log(.) <= ~12 (ulps of it are ulps of
        # the scale, times up to 12) where exp and log differ between XLA:GPU and Mosaic GPU.
        assert ulps.max(initial=0) <= (32 if dre else 4), (name, ulps.max())
        codes, codes_ref = _code_steps(got), _code_steps(want)
        diff = (codes != codes_ref) & same_params[:, None]
        fine = finite[:, None] & diff
        # A few ulps of m or of the scale move a code to its neighbour, two steps where the value sits near a
        # rounding boundary on both sides (bounded here, and by the fraction below).
        assert np.abs(codes - codes_ref)[fine].max(initial=0) <= 2, name
        assert diff.mean() <= 1e-3, (name, diff.mean())
        report.append(f"{name}: codes differ {int(diff.sum())}/{diff.size}, scales differ {int((ulps > 0).sum())}"
                      + (f", k or centre differ in {int((~same_params).sum())} blocks" if dre else ""))
    print("; ".join(report))


@pytest.mark.gpu
@pytest.mark.parametrize("shape,step,block", [((2048, 5632), 1, 256), ((4096, 2048), 50, 256),
                                              ((1000, 256 + 256 * 3), 10, 256), ((7, 1024, 256), 3, 256),
                                              ((4096, 1024), 5, 128), ((1100, 128), 2, 128)])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_gpu_kernel_matches_reference(shape, step, block, fmt):
    assert on_hopper_gpu(), jax.devices()
    p, g, mu, nu = _inputs(shape, seed=step, block_size=block, fmt=fmt)
    c = _coefficients(step)
    out = jax.jit(_kernel)(p, g, mu, nu, *c)
    _assert_close_gpu(out, _reference(p, g, mu, nu, *c, config=_config(fmt, block)),
                      f"{fmt} {shape} block {block} step {step}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GPU_TWINS)
def test_gpu_zero_nan_and_no_decay(fmt):
    c = _coefficients(2)
    p, g, mu, nu = _inputs((1024, 1024), seed=9, zero_states=True, fmt=fmt)
    out = _kernel(p, jnp.zeros_like(g), mu, nu, *c, weight_decay=0.0)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(p))
    assert not np.any(np.asarray(blockwise.dequantize(out[1]))) and not np.any(np.asarray(blockwise.dequantize(out[2])))
    p, g, mu, nu = _inputs((1024, 1024), seed=10, fmt=fmt)
    g = g.at[3, 7].set(jnp.nan).at[500, 0].set(jnp.inf)
    config = _config(fmt)
    _assert_close_gpu(_kernel(p, g, mu, nu, *c), _reference(p, g, mu, nu, *c, config=config), f"{fmt} nan/inf")
    _assert_close_gpu(_kernel(p, g, mu, nu, *c, weight_decay=0.0),
                      _reference(p, g, mu, nu, *c, config=config, weight_decay=0.0), f"{fmt} no decay")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GPU_TWINS)
def test_gpu_apply_gradients_uses_kernel_and_tracks_optax(fmt):
    params = {"w": jax.random.normal(jax.random.key(0), (2048, 2048)), "b": jnp.zeros(2048)}
    grads = [jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.key(i + 1), p.shape) * 1e-3, params)
             for i in range(5)]
    tx = ADAMW[fmt](1e-3, weight_decay=0.1, use_kernel=True)
    text = jax.jit(lambda p, s, g: optim.apply_gradients(tx, g, s, p)).lower(params, tx.init(params),
                                                                             grads[0]).as_text()
    assert "mosaic_gpu" in text
    # weight_decay 0.1 on |p| ~ 1: 5 steps of decay move p by ~5e-4, above the e4m3 bound below and at the 8-bit
    # one; a lost decay would also move nearly every param, far beyond the fraction bound.
    (p_kernel, _), (p_ref, _) = (_train(use, params, grads, weight_decay=0.1, fmt=fmt) for use in (True, False))
    diff = np.abs(np.asarray(p_kernel["w"]) - np.asarray(p_ref["w"]))
    # Params move by up to lr * 5 steps = 5e-3. A state code one step off (FMA rounding, rare) changes later
    # directions: by up to ~6% for e4m3 (a few params differ by ~1e-5), more for 8-bit codes, whose neighbours at
    # the low end of a map level are up to ~20% apart (1.3e-4 seen on an H100). Nearly all agree to float32 rounding.
    bound = 1e-4 if fmt == "e4m3" else 5e-4
    # Range expansion's exp and log may round differently in every element (an ulp of the decoded m and v, so of
    # the direction): more params an ulp apart (not yet measured on a GPU).
    fraction = 0.1 if fmt == "dre" else 1e-2
    print(f"{fmt} apply_gradients vs optax path after 5 steps: max |dp| {diff.max():.3g}, "
          f"fraction > 1e-8: {np.mean(diff > 1e-8):.2e}")
    assert np.mean(diff > 1e-8) <= fraction and diff.max() <= bound, (np.mean(diff > 1e-8), diff.max())


@pytest.mark.gpu
@pytest.mark.parametrize("block", [128, 256])
def test_gpu_nibbles_in_kernel(block):
    assert on_hopper_gpu(), jax.devices()
    _check_nibbles_in_kernel(block, interpret=None)


@pytest.mark.gpu
def test_gpu_bf16_words_in_kernel():
    assert on_hopper_gpu(), jax.devices()
    _check_bf16_words_in_kernel(interpret=None)


@pytest.mark.gpu
@pytest.mark.parametrize("map_name", ["dynamic_signed_8bit", "dynamic_unsigned_8bit"])
def test_gpu_codec_in_kernel(map_name):
    assert on_hopper_gpu(), jax.devices()
    _check_codec_in_kernel(map_name, interpret=None)


def _sr_bound_holds(p_k, p_r, p):
    """Kernel vs reference bf16 + SR params, float32 (values): SR maps float32 values differing by delta, with the
    same random bits, to grid points at most delta + one bf16 ulp apart (it is monotone and moves a value by less
    than an ulp). delta is float32 rounding: ulps of the result, or where p + lr * u cancels to near zero, a few
    ulps of the input param p (2**-20 |p|; ~6x what a CPU simulation of FMA vs no FMA needed on this data)."""
    return np.abs(p_k - p_r) <= 2.0**-7 * np.maximum(np.abs(p_k), np.abs(p_r)) + 2.0**-20 * np.abs(p)


def _sr_case(fmt):
    p, g, mu, nu = _inputs((2048, 4096), seed=11, fmt=fmt)
    return p.astype(jnp.bfloat16), g.astype(jnp.bfloat16), mu, nu, _coefficients(3), jnp.uint32(99)


def _sr_steps(fmt, seed):
    kernel = jax.jit(lambda *a: fused_adam.fused_step(*a[:4], B1, B2, EPS, *a[4:], 0.01, seed=seed))
    reference = jax.jit(lambda *a: fused_adam.fused_step_reference(*a[:4], _config(fmt), B1, B2, EPS, *a[4:], 0.01,
                                                                   seed))
    return kernel, reference


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", GPU_TWINS)
def test_gpu_bf16_stochastic_rounding_matches_reference(fmt):
    """Compiled, bfloat16 params + SR: XLA contracts multiply-adds into FMAs where Mosaic GPU may not, so the float32
    new param differs by ulps (as for float32 params), and a stochastic rounding whose random bits sit within that
    of the carry lands on the neighbouring bf16 grid point: ~1e-5 of params (2**-16 per float32 ulp). Near zero,
    where p + lr * u cancels, a float32 ulp of p is many bf16 ulps of the result (the H100's "more than one ulp")."""
    assert on_hopper_gpu(), jax.devices()
    p, g, mu, nu, c, seed = _sr_case(fmt)
    kernel, reference = _sr_steps(fmt, seed)
    (p_k, mu_k, nu_k), (p_r, mu_r, nu_r) = kernel(p, g, mu, nu, *c), reference(p, g, mu, nu, *c)
    p_k, p_r, p32 = np.asarray(p_k, np.float32), np.asarray(p_r, np.float32), np.asarray(p, np.float32)
    np.testing.assert_array_equal(np.isnan(p_k), np.isnan(p_r))
    differ = p_k != p_r
    print(f"{fmt} bf16 + SR: params differing {differ.mean():.2e}")
    assert differ.mean() <= 1e-4
    assert _sr_bound_holds(p_k, p_r, p32).all()
    _assert_close_gpu((p_r, mu_k, nu_k), (p_r, mu_r, nu_r), f"{fmt} bf16 + SR states")
    tx = ADAMW[fmt](1e-3, use_kernel=True)
    params = {"w": p}
    text = jax.jit(lambda p, s, g, k: optim.apply_gradients(tx, g, s, p, k)).lower(
        params, tx.init(params), {"w": g}, jax.random.key(0)).as_text()
    assert "mosaic_gpu" in text


def _intermediates_in_kernel(p, g, mu, nu, coef, fmt, interpret):
    """The fused step's float32 intermediates computed in a Mosaic GPU kernel with the step kernel's layout and helpers
    (`adam_step_mgpu`): p, g (n, B) bf16 or f32, moments in `fmt`, coef f32 (3,) -> (m, v, direction, new param
    before rounding), each float32 (n, B). Weight decay 0.01."""
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    formats, params = FORMATS[fmt], resolve_interpret(interpret)
    m_arrays, v_arrays = fused_adam._state_arrays(mu), fused_adam._state_arrays(nu)  # (codes, *per-row arrays)

    def body(coef_ref, m_table_ref, v_table_ref, p_ref, g_ref, *refs):
        state_refs, out_refs = refs[:len(m_arrays) + len(v_arrays)], refs[len(m_arrays) + len(v_arrays):]
        tile = pl.ds(lax.axis_index("program") * 4, 4)
        load = lambda ref, layout=adam_step_mgpu._LAYOUT: load_from_gmem(ref.at[tile], layout)
        tables = [functools.partial(adam_step_mgpu._lookup, t, interpret=params is not None)
                  for t in (m_table_ref, v_table_ref)]
        m_old, v_old = (adam_step_mgpu._dequantize_rows(load(codes), tuple(load(r, adam_step_mgpu._ROW_LAYOUT)
                                                                             for r in rows), f, t)
                        for (codes, *rows), f, t in ((state_refs[:len(m_arrays)], formats[0], tables[0]),
                                                     (state_refs[len(m_arrays):], formats[1], tables[1])))
        direction, m, v = adam_math.adam_math(load(g_ref).astype(jnp.float32), m_old, v_old, B1, B2, EPS,
                                             coef_ref[0], coef_ref[1])
        new_p = adam_math.param_update(load(p_ref).astype(jnp.float32), direction, coef_ref[2], 0.01)
        for ref, x in zip(out_refs, (m, v, direction, new_p)):
            ref.at[tile][...] = x

    n, block = mu.codes.shape
    out = tuple(jax.ShapeDtypeStruct((n, block), jnp.float32) for _ in range(4))
    run = plgpu.kernel(body, out_type=out, grid=(n // 4,), grid_names=("program",), interpret=params)
    return jax.jit(run)(coef, *(adam_step_mgpu.code_table(f) for f in formats), p.reshape(n, block),
                        g.reshape(n, block), *m_arrays, *v_arrays)


@jax.jit
def _reference_intermediates(p, g, mu, nu, bc1, bc2_sqrt, step_size):
    """`fused_step_reference`'s float32 intermediates (jnp): (m, v, direction, new param before rounding)."""
    direction, m, v = adam_math.adam_math(g, blockwise.dequantize(mu), blockwise.dequantize(nu), B1, B2, EPS, bc1,
                                         bc2_sqrt)
    return m, v, direction, adam_math.param_update(p.astype(jnp.float32), direction, step_size, 0.01)


@interpreter_only
def test_intermediates_in_kernel(fmt="8bit"):
    """The diagnosis kernel below computes what the step kernel does: its new param is the step kernel's (float32
    params), and its intermediates equal the reference's, under the interpreter (8-bit states: tables and lookups;
    e4m3 runs on the GPU)."""
    p, g, mu, nu = _inputs((8, 256), seed=2, fmt=fmt)
    c = _coefficients(2)
    got = _intermediates_in_kernel(p, g, mu, nu, jnp.stack(c), fmt, interpret=True)
    want = _reference_intermediates(p, g, mu, nu, *c)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1))
    np.testing.assert_array_equal(np.asarray(got[3]).reshape(p.shape), np.asarray(_kernel(p, g, mu, nu, *c)[0]))


def _ptx_op_counts():
    """Float32 instruction counts in the PTX that Mosaic GPU (files in MOSAIC_GPU_DUMP_TO) and XLA (under
    --xla_dump_to) dumped, per file that has any: whether either side uses FMAs, approximate division or roots."""
    import os
    import pathlib
    import re

    xla_dirs = re.findall(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    files = [*(pathlib.Path(os.environ.get("MOSAIC_GPU_DUMP_TO", "/nonexistent")).glob("*ptx*")),
             *(path for d in xla_dirs for path in pathlib.Path(d).rglob("*.ptx"))]
    ops = ("fma.rn.f32", "mul.rn.f32", "mul.f32", "add.rn.f32", "add.f32", "sub.rn.f32", "sub.f32", "div.rn.f32",
           "div.full.f32", "div.approx", "sqrt.rn.f32", "sqrt.approx", "rsqrt.approx", "rcp.", ".ftz.")
    for path in sorted(files):
        if path.is_file():
            text = path.read_text(errors="replace")
            counts = {op: text.count(op) for op in ops if op in text}
            if counts:
                print(f"PTX {path.name[:90]}: {counts}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", EIGHT_BIT)
def test_gpu_bf16_sr_diagnosis(fmt):
    """Where the compiled kernel's bf16 + SR params differ from the reference's, prints both sides' float32
    intermediates (m, v, direction, new param before rounding) and the random bits; asserts that the kernel's bf16
    param is the reference's rounding (`sr_params.round_param`, its bits) of the kernel's float32 new param (its
    float32-param run), so a difference comes from float32 arithmetic alone. `device_run.sh adam-sr-diag` runs it
    and dumps the PTX."""
    assert on_hopper_gpu(), jax.devices()
    p, g, mu, nu, c, seed = _sr_case(fmt)
    kernel, reference = _sr_steps(fmt, seed)
    p_k, p_r = (np.asarray(f(p, g, mu, nu, *c)[0], np.float32).reshape(-1) for f in (kernel, reference))
    k_vals = [np.asarray(x).reshape(-1) for x in _intermediates_in_kernel(p, g, mu, nu, jnp.stack(c), fmt, None)]
    r_vals = [np.asarray(x).reshape(-1) for x in _reference_intermediates(p, g, mu, nu, *c)]
    step_f32 = jax.jit(lambda p, g, mu, nu, *c: fused_adam.fused_step(p, g, mu, nu, B1, B2, EPS, *c, 0.01)[0])
    y_step = np.asarray(step_f32(p.astype(jnp.float32), g.astype(jnp.float32), mu, nu, *c)).reshape(-1)
    rounded = jax.jit(lambda y: sr_params.round_param(y, jnp.bfloat16, seed))
    sr_k, sr_r, sr_step = (np.asarray(rounded(jnp.asarray(y)), np.float32) for y in (k_vals[3], r_vals[3], y_step))
    bits = np.asarray(stochastic.element_bits(seed, (p.size,))) & 0xFFFF
    p32, g32 = np.asarray(p, np.float32).reshape(-1), np.asarray(g, np.float32).reshape(-1)
    _ptx_op_counts()
    print(f"{fmt}: kernel's f32 new param == step kernel's f32 path: {np.mean(k_vals[3] == y_step):.6f}; "
          f"SR(kernel f32) == kernel bf16: {np.mean(sr_k == p_k):.6f}, SR(step kernel f32): "
          f"{np.mean(sr_step == p_k):.6f}; "
          f"SR(reference f32) == reference bf16: {np.mean(sr_r == p_r):.6f}")
    for name, a, b in zip(("m", "v", "direction", "new p f32"), k_vals, r_vals):
        ulps = _ulps(a, b)
        print(f"{fmt} {name}: differ {np.mean(a != b):.2e}, max {ulps.max()} ulps")
    differ = np.flatnonzero(p_k != p_r)
    beyond = np.flatnonzero(~_sr_bound_holds(p_k, p_r, p32))
    far = np.flatnonzero(np.abs(p_k - p_r) > 2.0**-7 * np.abs(p_r))  # the old relative-only bound
    print(f"{fmt}: bf16 params differ {differ.size}/{p_k.size}; beyond 1 bf16 ulp (relative) {far.size}, beyond "
          "the bound with float32 rounding " + str(beyond.size))
    print("index p g | m kernel ref | v kernel ref | direction kernel ref | f32 new p kernel ref (ulps) | bits16 | "
          "bf16 kernel ref")
    for i in np.unique(np.concatenate([differ[:12], far[:20], beyond[:20]])):
        print(f"{i} {p32[i]:.6g} {g32[i]:.6g} | {k_vals[0][i]:.9g} {r_vals[0][i]:.9g} | {k_vals[1][i]:.9g} "
              f"{r_vals[1][i]:.9g} | {k_vals[2][i]:.9g} {r_vals[2][i]:.9g} | {k_vals[3][i]:.9g} {r_vals[3][i]:.9g} "
              f"({_ulps(k_vals[3][i:i + 1], r_vals[3][i:i + 1])[0]}) | {bits[i]:#06x} | {p_k[i]:.9g} {p_r[i]:.9g}")
    np.testing.assert_array_equal(sr_step, p_k)  # the kernel rounds its float32 value exactly as the reference would
    assert beyond.size == 0


def _expansion_in_kernel(x, interpret):
    """The step kernel's range-expanded state quantization (`adam_step_mgpu._quantize_rows`, "e4m3_dre") of float32
    blocks x (n, B), n % 4 == 0, in a Mosaic GPU kernel with the step kernel's layouts -> (codes float8_e4m3fn (n, B),
    scale f32, expand uint8, centre bf16, and `adam_math.expansion_params`' steps int32, centre f32, amax f32 before
    the stores' casts, and the smallest non-zero |x| (f32, from its int32 min reduction)), each (n,) but the codes."""
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_ref, *out_refs):
        tile = pl.ds(lax.axis_index("program") * 4, 4)
        blocks = load_from_gmem(x_ref.at[tile], adam_step_mgpu._LAYOUT)
        codes, rows = adam_step_mgpu._quantize_rows(blocks, "e4m3_dre", None)
        for ref, value in zip(out_refs, (codes, *rows, *adam_math.expansion_params(blocks), _smallest(blocks)),
                              strict=True):
            ref.at[tile][...] = value

    n, block = x.shape
    out = (jax.ShapeDtypeStruct((n, block), jnp.float8_e4m3fn),
           *(jax.ShapeDtypeStruct((n,), dtype) for dtype in (jnp.float32, jnp.uint8, jnp.bfloat16, jnp.int32,
                                                                 jnp.float32, jnp.float32, jnp.float32)))
    run = plgpu.kernel(body, out_type=out, grid=(n // 4,), grid_names=("program",),
                       interpret=resolve_interpret(interpret))
    return jax.jit(run)(x)


@jax.jit
def _expansion_reference(x):
    """`_expansion_in_kernel`'s outputs computed by jnp (the reference's formula)."""
    return (*adam_math.quantize_e4m3_expanded_blocks(x), *adam_math.expansion_params(x), _smallest(x))


def _smallest(blocks):
    """f32 (n, B) -> f32 (n,): the smallest non-zero |x| per block as `adam_math.expansion_params` reduces it."""
    bits = jax.lax.bitcast_convert_type(blocks, jnp.int32) & jnp.int32(0x7FFFFFFF)
    return jax.lax.bitcast_convert_type(jnp.min(jnp.where(bits == 0, jnp.int32(0x7F800000), bits), axis=-1),
                                        jnp.float32)


def _expansion_cases(n, block, seed):
    """float32 (n, B) blocks spread over decades, with the edge cases in the first rows: an all-zero block, NaN, Inf,
    a subnormal minimum, a block of one non-zero value, equal magnitudes (max / min = 1), a range wider than e4m3's."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    x = np.array(jax.random.normal(k1, (n, block)) * 10.0 ** jax.random.uniform(k2, (n, 1), minval=-12, maxval=2)
                  * 10.0 ** jax.random.uniform(k3, (n, block), minval=-3, maxval=0), np.float32)
    x[0] = 0
    x[1, 5], x[2, 7], x[3, 3], x[4] = np.nan, np.inf, 1e-40, 0
    x[4, 9], x[5], x[6] = -3e-5, 0.25, np.geomspace(1e-37, 1e37, block, dtype=np.float32)
    x[5, ::2] = -0.25
    return jnp.asarray(x)


_EXPANSION_NAMES = ("codes", "scale", "expand", "centre", "steps", "centre f32", "amax", "min")


def _expansion_mismatch(got, want):
    """Per output of `_expansion_in_kernel`: a boolean array of where got and want differ bitwise (codes: per row)."""
    return [np.any(_bits_rows(a) != _bits_rows(b), axis=-1) for a, b in zip(got, want, strict=True)]


def _bits_rows(x):
    """An array's bit patterns as unsigned integers, one row per block (codes (n, B)) or a column (n,) -> (n, 1)."""
    x = np.asarray(x)
    bits = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])
    return bits.reshape(x.shape[0], -1)


@interpreter_only
def test_expansion_in_kernel():
    """The kernel's range-expansion quantization (k, centre, scale, codes) equals the jnp formula bit for bit on the
    same blocks, edge cases included (interpreter; `test_gpu_dre_diagnosis` runs it compiled)."""
    x = _expansion_cases(16, 128, seed=0)
    got, want = _expansion_in_kernel(x, interpret=True), _expansion_reference(x)
    for name, differ in zip(_EXPANSION_NAMES, _expansion_mismatch(got, want)):
        assert not differ.any(), (name, np.flatnonzero(differ))
    steps, centre = np.asarray(want[4]), np.asarray(want[5])
    assert steps[0] == 16 and centre[0] == 1  # all zero
    assert np.isnan(centre[1]) and np.isinf(centre[2]) and np.isnan(np.asarray(want[1])[[1, 2]]).all()
    assert steps[5] == 255 and steps[6] == 1  # max / min = 1: k clipped at 255 / 16; range 1e74: k = 1 / 16


def _hex(values):
    return " ".join(f"{int(b):0{2 * np.asarray(values).dtype.itemsize}x}" for b in _bits_rows(values)[:, 0])


@pytest.mark.gpu
def test_gpu_dre_diagnosis():
    """Range-expanded (e4m3_dre) states compiled, in two parts (`device_run.sh dre-diag`, -s prints):
    1. the kernel's expansion (`_expansion_in_kernel`) on the very blocks jnp gets: k and centre must be equal bit
       for bit (integer arithmetic on the max / min bit patterns); printed per output: blocks differing and, for the
       first few, both sides' values as float32 and hex, and the block's max / min |x|;
    2. the fused step against its reference: blocks whose k or centre differ, and where the kernel's new m or v
       (computed in a kernel as the step does) differ from the reference's in a block's max or min |x| (FMA
       contraction), which is then the only cause left."""
    assert on_hopper_gpu(), jax.devices()
    x = _expansion_cases(8192, 128, seed=1)
    got, want = _expansion_in_kernel(x, interpret=None), _expansion_reference(x)
    a = np.abs(np.asarray(x))
    big, small = a.max(axis=1), np.where(a == 0, np.inf, a).min(axis=1)
    mismatch = _expansion_mismatch(got, want)
    for name, differ, k_out, r_out in zip(_EXPANSION_NAMES, mismatch, got, want):
        print(f"dre expansion, same input, {name}: {int(differ.sum())}/{differ.size} blocks differ")
        for i in np.flatnonzero(differ)[:6]:
            k_row, r_row = np.asarray(k_out)[i:i + 1], np.asarray(r_out)[i:i + 1]
            shown = lambda v: f"{np.asarray(v, np.float32)[0]:.9g} ({_hex(v)})"
            values = (f"{int(np.sum(_bits_rows(k_row) != _bits_rows(r_row)))} codes differ" if k_row.ndim > 1
                      else f"kernel {shown(k_row)}, reference {shown(r_row)}")
            print(f"  block {i}: {values}; max {big[i]:.9g} ({_hex(big[i:i + 1])}), min {small[i]:.9g} "
                  f"({_hex(small[i:i + 1])})")
    shape, step, block = (4096, 1024), 5, 128
    p, g, mu, nu = _inputs(shape, seed=step, block_size=block, fmt="dre")
    c = _coefficients(step)
    (_, mu_k, nu_k), (_, mu_r, nu_r) = jax.jit(_kernel)(p, g, mu, nu, *c), _reference(
        p, g, mu, nu, *c, config=_config("dre", block))
    m_k, v_k = _intermediates_in_kernel(p, g, mu, nu, jnp.stack(c), "dre", None)[:2]
    m_r, v_r = _reference_intermediates(p, g, mu, nu, *c)[:2]
    for name, got_s, want_s, x_k, x_r in (("m", mu_k, mu_r, m_k, m_r), ("v", nu_k, nu_r, v_k, v_r)):
        params_differ = ~(_same(got_s.expand, want_s.expand) & _same(got_s.centre, want_s.centre))
        x_k, x_r = (np.abs(np.asarray(v).reshape(-1, block)) for v in (x_k, x_r))
        extremes_differ = (x_k.max(1) != x_r.max(1)) | (np.where(x_k == 0, np.inf, x_k).min(1)
                                                         != np.where(x_r == 0, np.inf, x_r).min(1))
        print(f"dre step, {name}: k or centre differ in {int(params_differ.sum())}/{params_differ.size} blocks, "
              f"{int((params_differ & ~extremes_differ).sum())} of them with the same max and min |{name}|; "
              f"elements of {name} differ {np.mean(x_k != x_r):.2e}, blocks' max or min differ "
              f"{np.mean(extremes_differ):.2e}")
        for i in np.flatnonzero(params_differ)[:4]:
            print(f"  block {i}: 16k {int(got_s.expand[i])} / {int(want_s.expand[i])}, centre "
                  f"{float(got_s.centre[i]):.6g} / {float(want_s.centre[i]):.6g}; max {x_k[i].max():.9g} / "
                  f"{x_r[i].max():.9g}, min {np.min(x_k[i][x_k[i] > 0]):.9g} / {np.min(x_r[i][x_r[i] > 0]):.9g}")
    for name, differ in zip(_EXPANSION_NAMES[2:], mismatch[2:]):
        assert not differ.any(), f"the kernel's {name} differs from jnp's on the same blocks"

"""adamw_8bit / adamw_4bit / adamw_fp8: the optax chain's updates bit for bit; track fp32 optax.adamw; memory;
composition (chain, chain_fused, MultiSteps); non-finite gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qjax import optim
from qjax.optim import adam, adamw, blockwise

OPTIMIZERS = {
    "8bit": lambda lr, **kw: optim.adamw_8bit(lr, **kw),
    "4bit": lambda lr, **kw: optim.adamw_4bit(lr, **kw),
    "fp8": lambda lr, **kw: optim.adamw_fp8(lr, **kw),
    "fp8_dre": lambda lr, **kw: optim.adamw_fp8(lr, dynamic_range_expansion=True, **kw),
}


def _run(tx, params, grads_seq):
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
    for g in grads_seq:
        params, state = step(params, state, g)
    return params, state


def _moments(state):
    """Dequantized (mu, nu) pytrees from a QuantizedAdamState."""
    load = lambda t: jax.tree.map(lambda x: blockwise.dequantize(x) if blockwise.is_quantized(x) else x, t,
                                  is_leaf=blockwise.is_quantized)
    return load(state.mu), load(state.nu)


def test_state_bytes_ratio():
    params = {"w1": jnp.zeros((1024, 512)), "w2": jnp.zeros((512, 256)), "norm": jnp.zeros(512)}
    fp32 = blockwise.nbytes(jax.eval_shape(optax.adamw(1e-3).init, params))
    ratios = {name: blockwise.nbytes(jax.eval_shape(make(1e-3).init, params)) / fp32
              for name, make in OPTIMIZERS.items()}
    assert ratios["8bit"] <= 0.27 and ratios["fp8"] <= 0.27 and ratios["fp8_dre"] <= 0.27, ratios
    assert ratios["4bit"] <= 0.14, ratios


@pytest.mark.parametrize("fmt", blockwise.STATE_FORMATS)
def test_zero_state_equals_quantized_zeros(fmt):
    """init builds the state from one quantized zero block (no compile-time folding): the same as quantizing zeros."""
    config = adam.StateConfig("e4m3", fmt, 128)  # the format under test as nu's (any format may store v)
    param = jnp.ones((48, 256))
    state = adam.init_moment(param, fmt, config)
    expected = blockwise.quantize(jnp.zeros(param.shape), fmt, 128)
    assert jax.tree.structure(state) == jax.tree.structure(expected) and state.shape == param.shape
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expected)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_small_and_ragged_tensors_keep_fp32_state():
    params = {"small": jnp.zeros(4095), "ragged": jnp.zeros((65, 100)), "big": jnp.zeros((64, 64))}
    state = optim.adamw_8bit(1e-3).init(params)
    assert state.mu["small"].dtype == jnp.float32 and state.mu["ragged"].dtype == jnp.float32
    assert isinstance(state.mu["big"], blockwise.CodebookState) and state.mu["big"].codes.shape == (16, 256)


@pytest.mark.parametrize("name,max_not_close,max_mean_dparam", [
    ("8bit", 0.001, 2e-4), ("fp8", 0.001, 4e-4), ("fp8_dre", 0.001, 4e-4), ("4bit", 0.05, 2.5e-3)])
def test_tracks_fp32_adamw(name, max_not_close, max_mean_dparam):
    """bitsandbytes-style: 50 steps on the same gradients as fp32 AdamW; states and params stay close."""
    shape = (128, 256)
    params = {"w": jax.random.normal(jax.random.key(0), shape) * 0.1}
    grads = [{"w": jax.random.normal(jax.random.key(i + 1), shape) * 0.01} for i in range(50)]
    ref_params, ref_state = _run(optax.adamw(1e-3, weight_decay=0.01), params, grads)
    got_params, got_state = _run(OPTIMIZERS[name](1e-3, weight_decay=0.01), params, grads)
    mu, nu = _moments(got_state)
    for got, ref in ((mu["w"], ref_state[0].mu["w"]), (nu["w"], ref_state[0].nu["w"])):
        not_close = ~np.isclose(got, ref, atol=3e-3, rtol=1e-3)
        assert not_close.mean() <= max_not_close, not_close.mean()
    # The first moment is what quantization perturbs most: its SNR against fp32 must stay high.
    snr = 20 * np.log10(np.linalg.norm(ref_state[0].mu["w"]) / np.linalg.norm(mu["w"] - ref_state[0].mu["w"]))
    assert snr > {"4bit": 8, "8bit": 25}.get(name, 20), snr
    dparam = float(jnp.mean(jnp.abs(got_params["w"] - ref_params["w"])))
    assert dparam <= max_mean_dparam, dparam
    moved = float(jnp.mean(jnp.abs(ref_params["w"] - params["w"])))
    assert moved > (3 if name == "4bit" else 10) * dparam, (moved, dparam)  # deviation small vs the movement


def _mlp_loss(params, x, y):
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_mlp_training_tracks_fp32(name):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(7), 4)
    params = {"w1": jax.random.normal(k1, (64, 128)) / 8, "b1": jnp.zeros(128),
              "w2": jax.random.normal(k2, (128, 64)) / 11, "b2": jnp.zeros(64)}
    x = jax.random.normal(k3, (256, 64))
    y = jnp.sin(x @ jax.random.normal(k4, (64, 64)) / 8)

    def train(tx, steps=12):
        state, p, losses = tx.init(params), params, []
        step = jax.jit(lambda p, s: (lambda l, g: (l, *tx.update(g, s, p)))(*jax.value_and_grad(_mlp_loss)(p, x, y)))
        for _ in range(steps):
            loss, updates, state = step(p, state)
            p = optax.apply_updates(p, updates)
            losses.append(float(loss))
        return np.array(losses)

    ref = train(optax.adamw(3e-3, weight_decay=0.01))
    got = train(OPTIMIZERS[name](3e-3, weight_decay=0.01, min_quantized_size=1024))
    assert ref[-1] < 0.5 * ref[0]
    if name == "4bit":
        # 4-bit v (linear map without zero) rounds small second moments up to absmax/16 per block, which shrinks
        # those elements' steps: the loss still falls steadily but lags fp32 (as with torchao's 4-bit AdamW).
        assert np.all(np.diff(got) < 0) and got[-1] < 0.5 * got[0] and got[-1] < 1.5 * ref[-1]
        np.testing.assert_allclose(got[:4], ref[:4], rtol=0.05)
    else:
        np.testing.assert_allclose(got, ref, rtol=0.02)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_all_zero_gradients(name):
    params = {"w": jax.random.normal(jax.random.key(0), (64, 128))}
    tx = OPTIMIZERS[name](1e-2, weight_decay=0.0)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), state, params)
    np.testing.assert_array_equal(updates["w"], 0.0)
    mu, nu = _moments(state)
    np.testing.assert_array_equal(mu["w"], 0.0)
    np.testing.assert_array_equal(nu["w"], 0.0)


@pytest.mark.parametrize("fmt", [f for f in blockwise.STATE_FORMATS if f != "e4m3_dre"])
def test_blocks_whose_scale_has_no_normal_reciprocal(fmt):
    """States are quantized as x * (1 / absmax) (`numerics.invertible_scale`). A block whose absmax (code books) or
    scale (e4m3: absmax / 448) is below 2**-126, where that reciprocal overflows, stores a zero scale or absmax and
    decodes to zeros; a code-book block whose absmax is above 2**126 (a subnormal reciprocal, flushed by XLA:CPU)
    stores +Inf and decodes non-finite; blocks just inside both limits keep their values. The inputs are built in
    NumPy, which keeps subnormals (XLA would flush them before the quantizer sees them)."""
    rng = np.random.default_rng(0)
    magnitudes = rng.uniform(0.5, 1.0, (4, 256)).astype(np.float32)
    signs = np.float32(1) if "unsigned" in fmt else np.where(np.arange(256) % 2 == 0, 1, -1).astype(np.float32)
    tiny = np.float32(2.0**-126) * np.float32(448 if fmt == "e4m3" else 1)
    rows = np.array([[tiny / 4], [tiny * 4], [np.float32(2.0**125)], [np.float32(2.0**127)]], np.float32)
    x = magnitudes * signs * rows  # subnormal scale, normal, large but invertible, beyond 2**126 (code books)
    assert x[0, 0] != 0  # a subnormal, not flushed
    q = blockwise.quantize(jnp.asarray(x), fmt, 256)
    scale = np.asarray(q.scale if fmt == "e4m3" else q.absmax)
    decoded = np.asarray(blockwise.dequantize(q))
    assert scale[0] == (1 if fmt == "e4m3" else 0)  # e4m3 stores an all-zero block's scale as 1
    np.testing.assert_array_equal(decoded[0], 0.0)
    step = 0.25 if fmt == "linear_unsigned_4bit" else 0.2  # the coarsest map's spacing near the top, relative
    for row in (1, 2):
        np.testing.assert_allclose(decoded[row], x[row], rtol=step, atol=float(rows[row, 0]) * step * 4)
    if fmt == "e4m3":  # scale = absmax / 448 <= float32 max / 448: always invertible
        np.testing.assert_allclose(decoded[3], x[3], rtol=step)
    else:
        assert scale[3] == np.inf and not np.isfinite(decoded[3]).any()


def test_range_expanded_blocks_near_float32_max():
    """Range expansion's centre stays within [2**-126, 2**126], whose reciprocal is normal: blocks of values up to
    3e38 (centre 2**127 before) keep their values instead of flushing to zero codes."""
    rng = np.random.default_rng(1)
    x = (rng.uniform(0.5, 1.0, (3, 128)) * np.array([[1e37], [2e38], [3e38]])).astype(np.float32)
    decoded = np.asarray(blockwise.dequantize(blockwise.quantize(jnp.asarray(x), "e4m3_dre", 128)))
    np.testing.assert_allclose(decoded, x, rtol=0.07)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_nan_gradient_never_becomes_finite(name):
    params = {"w": jax.random.normal(jax.random.key(0), (64, 128))}
    tx = OPTIMIZERS[name](1e-2)
    block = tx.init(params).mu["w"].codes.shape[1] * (2 if name == "4bit" else 1)
    update = jax.jit(tx.update)
    state = tx.init(params)
    g = jax.random.normal(jax.random.key(1), (64, 128)).at[0, 5].set(jnp.nan)
    u1, state = update({"w": g}, state, params)
    assert bool(jnp.isnan(u1["w"][0, 5])) and int(jnp.isnan(u1["w"]).sum()) == 1  # only that element, at once
    u2, state = update({"w": jnp.ones((64, 128))}, state, params)
    flat = u2["w"].reshape(-1)
    assert bool(jnp.all(jnp.isnan(flat[:block])))  # the NaN's state block is poisoned from then on (documented)
    assert bool(jnp.all(jnp.isfinite(flat[block:])))


def _bits(tree):
    return [np.asarray(x).reshape(-1).view(np.uint8) for x in jax.tree.leaves(tree)]


def _assert_bit_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
    for a, b in zip(_bits(got), _bits(want)):
        np.testing.assert_array_equal(a, b)


def _mixed_params_and_grads(steps=3):
    """Quantized tensors (one nested, one bfloat16), a ragged and a small one (float32 states); grads in their dtypes."""
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w": jax.random.normal(k[0], (32, 256)) * 0.1, "b": jnp.zeros(256),
              "h": (jax.random.normal(k[1], (16, 256)) * 0.1).astype(jnp.bfloat16),
              "s": jax.random.normal(k[2], (40, 40)), "nest": {"u": jax.random.normal(k[3], (16, 256)) * 0.1}}
    grads = [jax.tree.map(lambda p, i=i: (jax.random.normal(jax.random.key(i + 1), p.shape) * 1e-2).astype(p.dtype),
                          params) for i in range(steps)]
    return params, grads


CONFIGS = {"8bit": ("dynamic_signed_8bit", "dynamic_unsigned_8bit", 256),
           "4bit": ("dynamic_signed_4bit", "linear_unsigned_4bit", 128), "fp8": ("e4m3", "e4m3", 256),
           "fp8_dre": ("e4m3_dre", "e4m3_dre", 128)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("lr", [1e-3, optax.linear_schedule(1e-3, 5e-4, 10)], ids=["const", "schedule"])
@pytest.mark.parametrize("mask,weight_decay", [
    (None, 0.01), (None, 0.0), ({"w": True, "b": False, "h": True, "s": False, "nest": True}, 0.01),
    (lambda p: jax.tree.map(lambda x: x.ndim >= 2, p), 0.01)], ids=["all", "no_decay", "tree_mask", "fn_mask"])
def test_update_equals_the_optax_chain_bit_for_bit(name, lr, mask, weight_decay):
    """quantized_adamw's update is optax.chain(scale_by_quantized_adam, add_decayed_weights, scale_by_learning_rate)
    (what adamw_* returned before it was one transformation): updates and moments bit for bit, three jitted steps,
    its one count equal to the chain's counts (the schedule's step included)."""
    config = adam.StateConfig(*CONFIGS[name], min_quantized_size=1024)
    tx = adamw.quantized_adamw(config, lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay, mask=mask)
    ref = optax.chain(adam.scale_by_quantized_adam(config, 0.9, 0.95, 1e-8),
                      optax.add_decayed_weights(weight_decay, mask), optax.scale_by_learning_rate(lr))
    params, grads = _mixed_params_and_grads()
    (p, s), (p_ref, s_ref) = (params, tx.init(params)), (params, ref.init(params))
    update, update_ref = jax.jit(tx.update), jax.jit(ref.update)
    for g in grads:
        (u, s), (u_ref, s_ref) = update(g, s, p), update_ref(g, s_ref, p_ref)
        _assert_bit_equal(u, u_ref)
        assert isinstance(s, adam.QuantizedAdamState)
        _assert_bit_equal(s, s_ref[0])
        if callable(lr):
            assert int(s.count) == int(s_ref[2].count)
        p, p_ref = optax.apply_updates(p, u), optax.apply_updates(p_ref, u_ref)
    assert int(s.count) == len(grads)


def test_step_without_kernel_is_update_plus_apply_updates():
    """float32 params and states: the step is update + apply_updates bit for bit. The bfloat16 param "h" gets its
    update in float32 and one rounding (apply_updates adds a bfloat16 update): within a bf16 ulp of the param."""
    params, grads = _mixed_params_and_grads()
    tx = optim.adamw_8bit(optax.linear_schedule(1e-3, 5e-4, 10), weight_decay=0.01, min_quantized_size=1024)
    p, s = params, tx.init(params)
    step = jax.jit(lambda p, s, g: optim.apply_gradients(tx, g, s, p))
    reference = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
    for g in grads:
        (p_new, s_new), (p_ref, s_ref) = step(p, s, g), reference(p, s, g)  # one step from the same start
        h, h_ref = p_new.pop("h"), p_ref.pop("h")
        _assert_bit_equal((p_new, s_new), (p_ref, s_ref))
        h, h_ref, h_old = (np.asarray(x, np.float32) for x in (h, h_ref, p["h"]))
        # a bf16 ulp of the old param or of the update (<= lr = 1e-3 here): the two roundings differ by less
        assert np.all(np.abs(h - h_ref) <= 2.0**-7 * (np.abs(h_old) + 1e-3))
        p, s = {**p_new, "h": h}, s_new


@pytest.mark.parametrize("name", ["8bit", "fp8", "4bit"])
def test_inside_optax_chain_after_clipping(name):
    """optax.chain(clip, adamw), chain_fused(clip, adamw) (update and apply_gradients) and clipping by hand before
    the bare adamw: the same params and states bit for bit; the chains' states have optax.chain's layout."""
    params, grads = _mixed_params_and_grads()
    make = lambda: OPTIMIZERS[name](optax.linear_schedule(1e-3, 5e-4, 10), weight_decay=0.01, min_quantized_size=1024)
    clip = optax.clip_by_global_norm(0.05)  # the gradients' global norm is ~1.3: clipping acts
    chained, fused, bare = optax.chain(clip, make()), optim.chain_fused(clip, make()), make()
    assert isinstance(fused, adamw.FusedTransformation) and isinstance(fused, optax.GradientTransformation)
    assert jax.tree.structure(fused.init(params)) == jax.tree.structure(chained.init(params))

    def run_steps(tx, step):
        p, state = params, tx.init(params)
        for g in grads:
            p, state = step(p, state, g)
        return p, state

    fused_step = jax.jit(lambda p, s, g: optim.apply_gradients(fused, g, s, p))
    by_hand = jax.jit(lambda p, s, g: optim.apply_gradients(bare, clip.update(g, optax.EmptyState())[0], s, p))
    p_hand, s_hand = run_steps(bare, by_hand)
    assert float(optax.tree.norm(jax.tree.map(lambda a, b: a.astype(jnp.float32) - b, p_hand, params))) > 0
    by_update = _run(chained, params, grads)
    _assert_bit_equal(_run(fused, params, grads), by_update)
    for p, state in (by_update, run_steps(fused, fused_step)):
        _assert_bit_equal(state[1], s_hand)  # the states do not depend on the params
    _assert_bit_equal(run_steps(fused, fused_step)[0], p_hand)
    # the bfloat16 param "h" differs between the step (float32 update, one rounding) and update + apply_updates
    _assert_bit_equal({**by_update[0], "h": None}, {**p_hand, "h": None})


def test_composes_with_chain_schedule_and_multisteps():
    for tx in (optim.adamw_8bit(1e-3), optim.adamw_4bit(1e-3), optim.adamw_fp8(1e-3)):
        assert isinstance(tx, optax.GradientTransformation) and callable(tx.step)
        assert tuple(tx) == (tx.init, tx.update)  # unpacks like any optax transformation
    params = {"w": jax.random.normal(jax.random.key(0), (64, 128))}
    schedule = optax.linear_schedule(1e-3, 1e-4, 10)
    grads = [{"w": jax.random.normal(jax.random.key(i), (64, 128))} for i in (1, 2)]
    # MultiSteps(k=2) on two micro-batches equals one step on their mean gradient, around optax.chain or chain_fused.
    for inner in (optax.chain(optax.clip_by_global_norm(1.0), optim.adamw_8bit(schedule)),
                  optim.chain_fused(optax.clip_by_global_norm(1.0), optim.adamw_8bit(schedule))):
        multi = optax.MultiSteps(inner, every_k_schedule=2)
        p_multi, _ = _run(multi, params, grads)
        p_once, _ = _run(inner, params, [jax.tree.map(lambda a, b: (a + b) / 2, *grads)])
        np.testing.assert_allclose(p_multi["w"], p_once["w"], rtol=0, atol=5e-7)  # a few ulps
        assert float(jnp.abs(p_once["w"] - params["w"]).max()) > 5e-4  # a real step happened


def test_matches_optax_adamw_on_fp32_path():
    """Small tensors take the float32 path: same math as optax.adamw up to float rounding."""
    params = {"w": jax.random.normal(jax.random.key(0), (32, 32))}
    grads = [{"w": jax.random.normal(jax.random.key(i), (32, 32))} for i in range(1, 6)]
    ref, _ = _run(optax.adamw(1e-2, weight_decay=0.1), params, grads)
    got, _ = _run(optim.adamw_8bit(1e-2, weight_decay=0.1), params, grads)
    np.testing.assert_allclose(got["w"], ref["w"], rtol=1e-5, atol=1e-6)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        optim.adamw_8bit(1e-3, block_size=0)
    with pytest.raises(ValueError, match="b1 and b2"):
        optim.adamw_4bit(1e-3, b1=1.0)
    with pytest.raises(ValueError, match="unsigned"):
        adam.StateConfig("dynamic_unsigned_8bit", "dynamic_unsigned_8bit", 256)
    with pytest.raises(TypeError, match="dynamic_range_expansion"):
        optim.adamw_fp8(1e-3, dynamic_range_expansion="yes")
    with pytest.raises(ValueError, match="use_kernel"):
        optim.adamw_fp8(1e-3, use_kernel="auto")
    with pytest.raises(ValueError, match="needs params"):
        tx = optim.adamw_8bit(1e-3)
        tx.update({"w": jnp.ones(4)}, tx.init({"w": jnp.ones(4)}))
    with pytest.raises(ValueError, match="at least one"):
        optim.chain_fused()

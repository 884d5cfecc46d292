"""Optimizer from config (schedule, decay mask, all four AdamWs) and the metrics helpers (MFU, progress line)."""

import io
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ml_collections import ConfigDict

from qjax import dispatch
from qjax import optim as qoptim
from qjax.optim import blockwise, fused_adam
from qjax.train import ProgressMeter, make_optimizer, peak_flops
from qjax.train.metrics import check_finite, format_progress
from qjax.train import OPTIMIZERS


def _opt(**changes):
    opt = ConfigDict(dict(name="adamw", lr=1e-2, warmup_steps=4, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8,
                          weight_decay=0.1, grad_clip=1.0))
    opt.update(changes)
    return opt


def test_schedule_warms_up_linearly_then_decays_to_the_floor():
    schedule = make_optimizer(_opt(), total_steps=20).schedule
    lrs = np.array([float(schedule(s)) for s in range(20)])
    np.testing.assert_allclose(lrs[:4], 1e-2 * np.arange(1, 5) / 4, rtol=1e-6)  # step 0 already moves
    assert np.all(np.diff(lrs[3:]) < 0)
    np.testing.assert_allclose(lrs[-1], 1e-3, rtol=1e-5)  # lr * min_lr_ratio at the configured last step


def test_default_warmup_is_30_steps_or_a_tenth_of_a_short_run():
    for total, warmup in ((1000, 30), (20, 2)):
        schedule = make_optimizer(_opt(warmup_steps=None), total_steps=total).schedule
        np.testing.assert_allclose(float(schedule(0)), 1e-2 / warmup, rtol=1e-6)  # the update of step 0: lr(1)
        np.testing.assert_allclose(float(schedule(warmup - 1)), 1e-2, rtol=1e-5)
    no_warmup = make_optimizer(_opt(warmup_steps=None), total_steps=5).schedule  # 5 // 10 = 0: cosine from step 0
    assert 0.9e-2 < float(no_warmup(0)) < 1e-2


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_weight_decay_hits_matrices_only(name):
    optimizer = make_optimizer(_opt(name=name), total_steps=10)
    params = {"w": jax.random.normal(jax.random.key(0), (64, 128)), "scale": jnp.ones(128)}
    zeros = jax.tree.map(jnp.zeros_like, params)  # Adam's direction is 0, only decoupled decay remains
    new, _ = jax.jit(optimizer.step)(zeros, optimizer.init(params), params)
    np.testing.assert_array_equal(new["scale"], params["scale"])
    # new - old cancels: exact only to float32 ulps of |w| <= ~5 (<= 5e-7); the decay itself is ~2.5e-4 |w|.
    np.testing.assert_allclose(new["w"] - params["w"], -float(optimizer.schedule(0)) * 0.1 * params["w"],
                               rtol=1e-3, atol=5e-7)


def test_quantized_optimizer_keeps_low_bit_state():
    params = {"w": jnp.ones((64, 128))}
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(make_optimizer(_opt(name="adamw_8bit"), 10).init(params)))
    fp32_tx = make_optimizer(_opt(name="adamw"), total_steps=10)
    fp32_bytes = sum(x.nbytes for x in jax.tree.leaves(fp32_tx.init(params)))
    assert state_bytes < 0.3 * fp32_bytes


def test_dynamic_range_expansion_from_config():
    params = {"w": jnp.ones((64, 128))}
    is_state = lambda x: isinstance(x, (blockwise.Fp8State, blockwise.Fp8ExpandedState))
    for expand, kind in ((False, blockwise.Fp8State), (True, blockwise.Fp8ExpandedState)):
        state = make_optimizer(_opt(name="adamw_fp8", dynamic_range_expansion=expand), 10).init(params)
        kinds = {type(x) for x in jax.tree.leaves(state, is_leaf=is_state) if is_state(x)}
        assert kinds == {kind}
    with pytest.raises(ValueError, match="dynamic_range_expansion applies to adamw_fp8 states only"):
        make_optimizer(_opt(name="adamw_8bit", dynamic_range_expansion=True), 10)


def test_stochastic_rounding_keeps_updates_below_half_a_bf16_ulp():
    # Adam's first step moves every element by lr(0) = 1e-3 (no decay on a vector): under half a bf16 ulp of 1.0
    # (2**-9), so rounding to nearest loses it entirely; stochastic rounding keeps it in expectation.
    params = {"scale": jnp.ones(8192, jnp.bfloat16)}
    grads = {"scale": jnp.ones(8192, jnp.bfloat16)}
    changes = dict(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0, grad_clip=0.0)
    nearest = make_optimizer(_opt(**changes), 10)
    new, _ = nearest.step(grads, nearest.init(params), params)
    np.testing.assert_array_equal(new["scale"], params["scale"])

    sr = make_optimizer(_opt(**changes, stochastic_rounding=True), 10)
    step = jax.jit(sr.step)
    new, _ = step(grads, sr.init(params), params, jax.random.key(1))
    assert new["scale"].dtype == jnp.bfloat16
    # Each element becomes 1 - 2**-8 with p = 0.256, else stays 1: the mean's std is ~2e-5.
    np.testing.assert_allclose(float(jnp.mean(new["scale"].astype(jnp.float32))), 1 - 1e-3, atol=1.5e-4)
    again, _ = step(grads, sr.init(params), params, jax.random.key(1))
    np.testing.assert_array_equal(again["scale"], new["scale"])  # keyed: reproducible
    with pytest.raises(ValueError, match="needs key="):
        sr.step(grads, sr.init(params), params)


def test_grad_clip_bounds_the_clipped_gradient():
    optimizer = make_optimizer(_opt(grad_clip=1.0, b1=0.0, b2=0.0, eps=1e3, weight_decay=0.0), total_steps=10)
    # With b1 = b2 = 0 and a huge eps Adam is ~ g / eps: the update is proportional to the clipped gradient.
    grads = {"w": jnp.full((4, 4), 10.0)}
    params = jax.tree.map(jnp.zeros_like, grads)
    new, _ = optimizer.step(grads, optimizer.init(params), params)
    clipped = optax.tree.norm(new) * 1e3 / 2.5e-3  # undo lr(0) = 1e-2 / 4 and the eps scaling
    np.testing.assert_allclose(float(clipped), 1.0, rtol=1e-3)


@pytest.mark.parametrize("name", ["adamw_fp8", "adamw_8bit"])
def test_low_bit_step_runs_the_fused_kernel_after_clipping(monkeypatch, name):
    """train's adamw_fp8 / adamw_8bit clip first and then take the fused step kernel (forced on here, Mosaic GPU
    interpreter): the same states and, to float32 rounding, the same params as the optax path, both moved by the
    clipped gradient. With b1 = b2 = 0 and eps = 1e3 Adam's direction is g / (|g| + 1e3): proportional to what
    arrives."""
    calls = []
    real = fused_adam.fused_step
    monkeypatch.setattr(fused_adam, "fused_step", lambda p, *a, **k: calls.append(p.shape) or real(p, *a, **k))
    optimizer = make_optimizer(_opt(name=name, grad_clip=0.5, b1=0.0, b2=0.0, eps=1e3, weight_decay=0.0),
                               total_steps=10)
    params = {"w": jnp.zeros((32, 256)), "scale": jnp.zeros(256)}  # zeros: the new params are the update itself
    grads = {"w": jax.random.normal(jax.random.key(0), (32, 256)) * 0.01, "scale": jnp.full(256, 0.01)}
    optax_path = jax.jit(optimizer.step)(grads, optimizer.init(params), params)
    assert calls == []
    with dispatch.force("interpret"):
        fused = jax.jit(optimizer.step)(grads, optimizer.init(params), params)
    assert calls == [(32, 256)]
    for a, b in zip(jax.tree.leaves(fused[1]), jax.tree.leaves(optax_path[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    clipped_w = grads["w"] * (0.5 / float(optax.tree.norm(grads)))  # global norm ~0.92 > 0.5
    expected = -float(optimizer.schedule(0)) * clipped_w / (jnp.abs(clipped_w) + 1e3)
    for new in (fused[0]["w"], optax_path[0]["w"]):
        np.testing.assert_allclose(np.asarray(new), np.asarray(expected), rtol=1e-5)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("kernel", [False, True], ids=["optax", "kernel"])
def test_step_is_clipping_then_the_bare_adamw(name, kernel):
    """make_optimizer's one transformation (clip chained into AdamW) steps exactly as clipping the gradients by hand
    and then applying the bare AdamW (how train stepped before): params and AdamW state bit for bit, with the fused
    kernel forced on (Mosaic GPU interpreter) or not; its state is (clip state, AdamW state)."""
    with dispatch.force("interpret" if kernel else "reference"):
        optimizer = make_optimizer(_opt(name=name, grad_clip=0.05), total_steps=10)
        bare = make_optimizer(_opt(name=name, grad_clip=0.0), total_steps=10).tx  # the same AdamW, alone
        params = {"w": jax.random.normal(jax.random.key(0), (32, 256)) * 0.1, "scale": jnp.ones(256)}
        grads = [jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.key(i + 1), p.shape) * 1e-2, params)
                 for i in range(3)]
        clip = optax.clip_by_global_norm(0.05)
        step = jax.jit(optimizer.step)
        by_hand = jax.jit(lambda p, s, g: qoptim.apply_gradients(bare, clip.update(g, optax.EmptyState())[0], s, p))
        (p, s), (p_hand, s_hand) = (params, optimizer.init(params)), (params, bare.init(params))
        assert isinstance(s[0], optax.EmptyState) and len(s) == 2 and len(s_hand) == 1
        for g in grads:
            (p, s), (p_hand, s_hand) = step(g, s, p), by_hand(p_hand, s_hand, g)
            got, want = jax.tree.leaves((p, s[1])), jax.tree.leaves((p_hand, s_hand[0]))
            assert len(got) == len(want)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                              np.asarray(b).reshape(-1).view(np.uint8))


def test_peak_flops_only_for_known_devices():
    assert peak_flops(types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")) == 989e12
    assert peak_flops(types.SimpleNamespace(device_kind="NVIDIA H200")) == 989e12
    assert peak_flops(types.SimpleNamespace(device_kind="cpu")) is None
    assert peak_flops(jax.devices()[0]) is None  # the CPU running this test


def test_progress_line_and_jsonl(tmp_path):
    h100 = types.SimpleNamespace(device_kind="NVIDIA H100", memory_stats=lambda: {"peak_bytes_in_use": 3 * 2**30})
    out = io.StringIO()
    meter = ProgressMeter(tmp_path, total_steps=100, unit="tokens", units_per_step=1000, flops_per_unit=1e9,
                          devices=[h100, h100], stream=out)
    meter.mark(10)
    record = meter.train(20, {"loss": 2.5, "lr": 1e-3})
    expected_mfu = 1e9 * record["throughput"] / (2 * 989e12)
    np.testing.assert_allclose(record["mfu"], expected_mfu, rtol=1e-12)
    np.testing.assert_allclose(record["eta_s"], 80 * record["seconds_per_step"], rtol=1e-12)
    meter.eval(20, {"loss": 2.0})
    line = out.getvalue().splitlines()[0]
    assert line.startswith("step 20/100 [####----------------]  20% | loss 2.5000 | lr 1.00e-03 |"), line
    assert "MFU" in line and "mem 3.0 GiB" in line
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [20, 20] and rows[1]["eval_loss"] == 2.0
    # No peak FLOP/s or memory statistics (a CPU): said, not left out.
    assert format_progress({"step": 1, "loss": 1.0, "throughput": 5.0}, 10, "images").endswith(
        "| 5 img/s | MFU n/a | mem n/a")


def test_skipped_seconds_are_left_out_of_the_throughput(tmp_path, monkeypatch):
    """A one-off compile (ProgressMeter.skip) does not count as training time: 10 steps in 3 s of which 2 s were a
    compile give 0.1 s per step, not 0.3."""
    clock = iter([100.0, 103.0])
    monkeypatch.setattr("qjax.train.metrics.time.perf_counter", lambda: next(clock))
    meter = ProgressMeter(tmp_path, total_steps=100, unit="tokens", units_per_step=1000, flops_per_unit=None,
                          devices=[], stream=io.StringIO(), tensorboard=False)
    meter.skip(5.0)  # before mark: nothing is being timed yet
    meter.mark(10)
    meter.skip(2.0)
    record = meter.train(20, {"loss": 2.5})
    np.testing.assert_allclose(record["seconds_per_step"], 0.1)
    np.testing.assert_allclose(record["throughput"], 10_000)


def test_non_finite_loss_is_an_error():
    with pytest.raises(FloatingPointError, match="loss is nan at step 7"):
        check_finite(7, "loss", float("nan"))
    check_finite(7, "loss", 1.0)  # finite: no error

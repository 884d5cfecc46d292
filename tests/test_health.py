"""Quantization health (qjax.health): exact stats on hand-built tensors, the g probe, nothing traced when off, the
warnings, the train loop's rows; and the Smooth-SwiGLU guard (qjax.models.layers.SmoothedDense)."""

import io
import json
import math
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qjax
from qjax import health
from qjax.models import Llama, layers, llama_config
from qjax.qtensor import QuantSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_int8_row_stats_count_saturated_and_flushed_codes():
    # row 0: scale 1 -> codes 127, -127, 0 (0.4 flushed), 0 (a zero, not counted as flushed)
    # row 1: scale 4/127 -> codes 32, 64, 95, 127
    x = jnp.array([[127.0, -127.0, 0.4, 0.0], [1.0, 2.0, 3.0, 4.0]])
    amax, saturated, underflow = np.asarray(health.operand_stats(x, QuantSpec("int8", "row")))
    assert amax == 127.0
    assert saturated == 3 / 8
    assert underflow == pytest.approx(1 / 7, rel=1e-6)


def test_e4m3_tensor_stats_count_subnormal_codes_as_flushed():
    # scale 448 / 448 = 1: 2^-7 becomes a subnormal code (e4m3's smallest normal is 2^-6), 2^-10 rounds to zero
    x = jnp.array([448.0, 448.0, 1.0, 2.0**-7, 2.0**-10, 0.0, -448.0, 3.0])
    amax, saturated, underflow = np.asarray(health.operand_stats(x, QuantSpec("e4m3", "tensor")))
    assert (amax, saturated) == (448.0, 3 / 8)
    assert underflow == pytest.approx(2 / 7, rel=1e-6)


def test_stochastic_spec_is_measured_by_its_nearest_codes_and_nan_stays_visible():
    x = jax.random.normal(jax.random.key(0), (16, 64))
    sr, nearest = QuantSpec("e5m2", "row", stochastic=True), QuantSpec("e5m2", "row")
    np.testing.assert_array_equal(health.operand_stats(x, sr), health.operand_stats(x, nearest))
    assert math.isnan(float(health.operand_stats(x.at[3, 5].set(jnp.nan), nearest)[0]))


class _Linear(nn.Module):
    recipe: str

    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, use_bias=False, dot_general_cls=lambda: qjax.DotGeneral(recipe=self.recipe),
                        name="proj")(x)


def test_probe_gradient_is_the_stats_of_the_output_gradient():
    model = _Linear("fp8_tensorwise")
    x = jax.random.normal(jax.random.key(1), (4, 6, 16))
    c = jax.random.normal(jax.random.key(2), (4, 6, 8)) * 1e-3  # the output's cotangent, g
    params = model.init(jax.random.key(0), x)["params"]
    probes = model.apply({"params": params}, x, mutable=[health.COLLECTION, health.PROBES])[1][health.PROBES]

    def loss(probes):
        out, state = model.apply({"params": params, health.PROBES: probes}, x, mutable=[health.COLLECTION])
        return jnp.sum(out * c), state

    probe_grads, state = jax.grad(loss, has_aux=True)(probes)
    stats = health.flatten(state[health.COLLECTION], probe_grads)
    assert sorted(stats) == ["proj/g", "proj/w", "proj/x"]
    recipe = qjax.recipe("fp8_tensorwise")
    np.testing.assert_array_equal(stats["proj/g"], health.operand_stats(c.reshape(-1, 8), recipe.dgrad.lhs))
    np.testing.assert_array_equal(stats["proj/x"], health.operand_stats(x.reshape(-1, 16), recipe.fwd.lhs))
    np.testing.assert_array_equal(stats["proj/w"], health.operand_stats(params["proj"]["kernel"].T,
                                                                        recipe.fwd.rhs))


def _loss_jaxpr(config, tokens):
    model = Llama(config)
    params = model.init(jax.random.key(0), tokens)["params"]
    return str(jax.make_jaxpr(lambda p: jax.grad(lambda q: model.apply({"params": q}, tokens).mean())(p))(params))


def test_nothing_is_traced_when_health_is_off(monkeypatch):
    config = llama_config("tiny", recipe="int8_dataflow", n_layers=1)  # a fused PrologueDense and plain Dense
    tokens = jnp.zeros((2, 8), jnp.int32)
    before = _loss_jaxpr(config, tokens)

    def fail(*args, **kwargs):
        raise AssertionError("qjax.health traced with the health collection off")

    monkeypatch.setattr(health, "observe_gemm", fail)
    monkeypatch.setattr(health, "operand_stats", fail)
    assert _loss_jaxpr(config, tokens) == before  # the same program, and no health code ran while tracing it


def test_monitor_warns_once_on_an_outlier_channel_not_on_clean_data():
    spec = QuantSpec("e4m3", "tensor")
    clean = jax.random.normal(jax.random.key(3), (256, 8))
    outlier = clean.at[:, 5].set(1000.0)  # one channel far above the rest: every one of its codes at 448
    lines = []
    monitor = health.HealthMonitor(saturation_warn=0.05, amax_growth_warn=10.0)
    for step, x in ((1, clean), (2, clean), (3, outlier), (4, outlier)):
        row, warning = monitor.update(step, {"layers_0/mlp/down_proj/x": np.asarray(health.operand_stats(x, spec))})
        lines.append(warning)
    assert lines[:2] == [None, None]
    assert lines[2].startswith("quantization health warning @ step 3: layers_0/mlp/down_proj/x saturation 12.50%")
    assert "amax x" in lines[2]  # the channel's 1000 against a clean amax of about 3.5
    assert lines[3] is None  # still over: said once
    assert row["health_saturation_max"] == 0.125 and row["health/layers_0/mlp/down_proj/x/amax_growth"] > 10


def test_gradient_operands_warn_on_saturation_but_not_on_amax_growth():
    monitor = health.HealthMonitor(saturation_warn=0.05, amax_growth_warn=10.0)
    assert monitor.update(1, {"a/g": np.array([1.0, 0, 0]), "a/x": np.array([1.0, 0, 0])})[1] is None
    row, warning = monitor.update(2, {"a/g": np.array([50.0, 0, 0]), "a/x": np.array([50.0, 0, 0])})
    assert row["health/a/g/amax_growth"] == 50.0  # recorded
    assert warning.endswith("a/x amax x50 since its first measurement > x10 (config.health_saturation_warn / "
                            "health_amax_growth_warn set the thresholds)")
    assert "a/g" not in warning
    warning = monitor.update(3, {"a/g": np.array([50.0, 0.5, 0]), "a/x": np.array([50.0, 0, 0])})[1]
    assert warning == ("quantization health warning @ step 3: a/g saturation 50.00% > 5.00% "
                       "(config.health_saturation_warn / health_amax_growth_warn set the thresholds)")


def test_initial_amax_of_a_resumed_run_is_its_first_measurement():
    rows = [{"step": 2, "loss": 1.0}, {"step": 2, "health/a/x/amax": 3.0}, {"step": 4, "health/a/x/amax": 5.0}]
    assert health.initial_amax(rows) == {"a/x": 3.0}
    row, _ = health.HealthMonitor(0.05, 10.0, health.initial_amax(rows)).update(6, {"a/x": np.array([6.0, 0, 0])})
    assert row["health/a/x/amax_growth"] == 2.0


def test_model_warns_when_an_outlier_channel_is_injected():
    config = llama_config("tiny", recipe="fp8_tensorwise", n_layers=1, compute_dtype="float32")
    model, tokens = Llama(config), jax.random.randint(jax.random.key(4), (2, 32), 0, 256)
    params = model.init(jax.random.key(0), tokens)["params"]

    def stats(params):
        state = model.apply({"params": params}, tokens, mutable=[health.COLLECTION])[1]
        return health.flatten(state[health.COLLECTION])

    monitor = health.HealthMonitor(0.05, 10.0)
    assert monitor.update(1, stats(params))[1] is None
    assert monitor.update(2, stats(params))[1] is None
    # up's channel 3 of the SwiGLU x1000: the down projection's input gets an outlier channel
    kernel = params["layers_0"]["mlp"]["gate_up_proj"]["kernel"]
    injected = jax.tree.map(lambda p: p, params)
    injected["layers_0"]["mlp"]["gate_up_proj"]["kernel"] = kernel.at[:, config.ffn_dim + 3].multiply(1000.0)
    warning = monitor.update(3, stats(injected))[1]
    assert warning is not None and "layers_0/mlp/down_proj/x amax x" in warning


def test_train_writes_health_rows_and_stays_quiet_on_a_clean_run(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "tests" / "train"))
    sys.path.insert(0, str(ROOT))
    from train_helpers import tiny_llama_config  # noqa: PLC0415

    from qjax.data import prepare_text  # noqa: PLC0415
    from qjax.train import train  # noqa: PLC0415

    (tmp_path / "c.txt").write_text("the cat sat on the mat. a dog ran in the park. " * 200)
    prepare_text([tmp_path / "c.txt"], tmp_path / "tokens", val_fraction=0.1)
    config = tiny_llama_config(str(tmp_path / "tokens"), recipe="fp8_tensorwise", health_every=2, steps=4,
                               eval_every=0)
    train(config, str(tmp_path / "run"))
    out = capsys.readouterr().out
    assert "warning" not in out
    progress = [line for line in out.splitlines() if line.startswith("step ")]
    assert progress and all(" sat " in line for line in progress)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    health_rows = [r for r in rows if "health_saturation_max" in r and "loss" not in r]
    assert [r["step"] for r in health_rows] == [2, 4]
    keys = set(health_rows[0])
    for operand in ("x", "w", "g"):
        for stat in (*health.STATS, "amax_growth"):
            assert f"health/layers_0/mlp/down_proj/{operand}/{stat}" in keys
    assert health_rows[0]["health/layers_0/attn/qkv_proj/x/amax_growth"] == 1.0


def test_health_and_eval_steps_compiled_ahead_train_the_same(tmp_path, monkeypatch):
    # On a GPU the health and eval steps compile in threads beside the first step (loop._CompileAhead, for abstract
    # arguments, without autotuning); forced here on the CPU, the run must match the one that compiles each step
    # when first needed: the same params, health rows and eval losses.
    sys.path.insert(0, str(ROOT / "tests" / "train"))
    from train_helpers import tiny_llama_config  # noqa: PLC0415

    from qjax.data import prepare_text  # noqa: PLC0415
    from qjax.train import loop  # noqa: PLC0415

    (tmp_path / "c.txt").write_text("the cat sat on the mat. a dog ran in the park. " * 200)
    prepare_text([tmp_path / "c.txt"], tmp_path / "tokens", val_fraction=0.1)
    config = tiny_llama_config(str(tmp_path / "tokens"), recipe="int8_rowwise", health_every=3, steps=6,
                               eval_every=3)
    made = []

    class Recorded(loop._CompileAhead):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(loop, "_CompileAhead", Recorded)
    results, rows = {}, {}
    for ahead in (False, True):
        monkeypatch.setattr(loop, "_compiles_ahead", lambda mesh, ahead=ahead: ahead)
        results[ahead] = loop.train(config, str(tmp_path / f"run-{ahead}"), stream=io.StringIO())
        lines = (tmp_path / f"run-{ahead}" / "metrics.jsonl").read_text().splitlines()
        rows[ahead] = [{k: v for k, v in json.loads(line).items() if k != "time"} for line in lines
                       if "health_saturation_max" in line and '"loss"' not in line or "eval_loss" in line]
    assert len(made) == 2  # the health and eval steps of the run told to compile ahead
    assert [(r["step"], "eval_loss" in r) for r in rows[True]] == [(3, False), (3, True), (6, False), (6, True)]
    assert rows[True] == rows[False]
    jax.tree.map(np.testing.assert_array_equal, results[True].state.params, results[False].state.params)


def test_compile_ahead_returns_the_compiled_step_or_raises_its_error_in_the_caller():
    from qjax import dispatch  # noqa: PLC0415
    from qjax.train import loop  # noqa: PLC0415

    meter = type("Meter", (), {"skip": lambda self, seconds: None})()
    square = jax.jit(lambda x: x @ x)
    compiled = loop._CompileAhead(square, (jax.ShapeDtypeStruct((2, 2), jnp.float32),), loop.AHEAD_OPTIONS)
    np.testing.assert_array_equal(compiled.get(meter)(jnp.eye(2)), jnp.eye(2))
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions to have the same shape"):
        loop._CompileAhead(square, (jax.ShapeDtypeStruct((2, 3), jnp.float32),)).get(meter)
    seen = []  # the caller's context variables hold in the compiling thread

    def spy(x):
        seen.append(dispatch._forced.get())
        return x * 2

    with dispatch.force("reference"):
        loop._CompileAhead(jax.jit(spy), (jax.ShapeDtypeStruct((2,), jnp.float32),)).get(meter)
    assert seen == ["reference"]


@pytest.mark.parametrize("recipe", ["bf16", "fp8_tensorwise"])
def test_smooth_swiglu_matches_the_unguarded_model(recipe):
    # bf16: the same function up to float rounding, forward and gradients. fp8_tensorwise: the guard changes only
    # how down_proj's operands are quantized, so the outputs stay close.
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, 256)
    kwargs = dict(recipe=recipe, n_layers=1, compute_dtype="float32")
    plain, guarded = Llama(llama_config("tiny", **kwargs)), Llama(llama_config("tiny", smooth_swiglu=True, **kwargs))
    params = plain.init(jax.random.key(0), tokens)["params"]
    assert jax.tree.structure(params) == jax.tree.structure(guarded.init(jax.random.key(0), tokens)["params"])

    def loss(model, p):
        return jnp.mean(model.apply({"params": p}, tokens) ** 2)

    (l0, g0), (l1, g1) = (jax.value_and_grad(lambda p: loss(m, p))(params) for m in (plain, guarded))
    if recipe == "bf16":
        np.testing.assert_allclose(l1, l0, rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max())),
                     g1, g0)
        return
    np.testing.assert_allclose(l1, l0, rtol=2e-2)
    flat0, flat1 = (jnp.concatenate([g.ravel() for g in jax.tree.leaves(g)]) for g in (g0, g1))
    assert float(flat0 @ flat1 / jnp.linalg.norm(flat0) / jnp.linalg.norm(flat1)) > 0.99


def test_smoothed_dense_equals_dense_in_bf16_and_removes_an_outlier_channel():
    x = jax.random.normal(jax.random.key(6), (64, 32), jnp.bfloat16).at[:, 7].multiply(300)
    init = nn.initializers.normal(0.02)

    class Pair(nn.Module):
        recipe: str

        @nn.compact
        def __call__(self, x):
            r = qjax.recipe(self.recipe)
            plain = nn.Dense(16, use_bias=False, dtype=jnp.bfloat16, kernel_init=init,
                             dot_general_cls=lambda: qjax.DotGeneral(recipe=r), name="plain")
            y0 = plain(x)
            y1 = layers.SmoothedDense(16, r, init, jnp.bfloat16, jnp.float32, name="smooth")(x)
            return y0, y1

    model = Pair("bf16")
    params = model.init(jax.random.key(0), x)["params"]
    params["smooth"] = params["plain"]
    y0, y1 = model.apply({"params": params}, x)
    np.testing.assert_allclose(np.float32(y1), np.float32(y0), rtol=2e-2, atol=2e-2 * float(jnp.abs(y0).max()))
    grads = [jax.grad(lambda x_: jnp.sum(model.apply({"params": params}, x_)[i].astype(jnp.float32)))(x)
             for i in (0, 1)]
    np.testing.assert_allclose(np.float32(grads[1]), np.float32(grads[0]), rtol=2e-2, atol=1e-3)
    # under fp8 tensor scales the outlier channel flushes the others' codes; the guard's operand has no outlier
    state = Pair("fp8_tensorwise").apply({"params": params}, x, mutable=[health.COLLECTION])[1]
    stats = health.flatten(state[health.COLLECTION])
    assert stats["plain/x"][2] > 0.01 and stats["smooth/x"][2] == 0.0


def test_worst_names_the_layer_operand_and_step():
    rows = [{"step": 5, "loss": 2.0},
            {"step": 10, "health/l0/x/saturated": 0.01, "health/l0/x/underflow": 0.2, "health/l0/x/amax_growth": 1.0,
             "health/l0/g/amax_growth": 1.0, "health/l1/w/saturated": 0.001, "health/l1/w/underflow": 0.0},
            {"step": 20, "health/l0/x/saturated": 0.02, "health/l0/x/underflow": 0.1, "health/l0/x/amax_growth": 3.0,
             "health/l0/g/amax_growth": 90.0, "health/l1/w/saturated": 0.5, "health/l1/w/underflow": 0.0}]
    assert health.worst(rows) == {"saturated": (0.5, "l1/w", 20), "underflow": (0.2, "l0/x", 10),
                                  "amax_growth": (3.0, "l0/x", 20)}  # the gradient's x90 is not a warning
    rows.append({"step": 30, "health/l1/w/saturated": math.nan})
    value, name, step = health.worst(rows)["saturated"]
    assert math.isnan(value) and (name, step) == ("l1/w", 30)
    assert health.worst(rows[:1]) == {}


def test_health_under_gradient_accumulation_is_the_max_amax_and_the_mean_fractions(tmp_path):
    """With grad_accum_steps=2 each operand's amax is the larger of its two micro-batches' and each fraction their
    mean, the micro-batches measured alone by the same step at half the batch (int8_rowwise: no random rounding)."""
    sys.path.insert(0, str(ROOT / "tests" / "train"))
    from train_helpers import tiny_llama_config  # noqa: PLC0415

    from qjax.train.step import make_train_step  # noqa: PLC0415
    from qjax.train.task import make_task  # noqa: PLC0415

    def stats(batch_size, accum, batch):
        config = tiny_llama_config(str(tmp_path), recipe="int8_rowwise", batch_size=batch_size,
                                   grad_accum_steps=accum)
        init, step = make_train_step(config, make_task(config, vocab_size=64), health=True, check=False)
        metrics = step(init(), batch)[1]["health"]
        return health.flatten(metrics["sown"], metrics["probes"])

    tokens = np.array(jax.random.randint(jax.random.key(5), (4, 33), 0, 64), np.int32)
    tokens[1, 3:9] = 7  # a repeated token in one micro-batch only: its activations differ from the other's
    batch = lambda rows: {"inputs": rows[:, :-1], "targets": rows[:, 1:]}  # noqa: E731
    both = stats(4, 2, batch(tokens))
    halves = [stats(2, 1, batch(tokens[i::2])) for i in (0, 1)]  # micro-batch i: examples i, i + 2
    assert set(both) == set(halves[0]) and any(o.endswith("/g") for o in both)
    for name, value in both.items():
        first, second = halves[0][name], halves[1][name]
        np.testing.assert_allclose(value[0], max(first[0], second[0]), rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(value[1:], (first[1:] + second[1:]) / 2, rtol=1e-5, atol=1e-7, err_msg=name)
    assert any(halves[0][n][0] != halves[1][n][0] for n in both)  # the max picked between different values


def test_ternary_weights_are_recorded_but_not_warned_on_for_saturation():
    """bitnet_b158's ternary weights sit mostly at +-1 by design (absmean scaling): no saturation warning, not in the
    progress line's worst saturation; its activations (int8 per token) still warn."""
    from qjax.models import layer_recipes  # noqa: PLC0415

    config = llama_config("tiny", recipe="bitnet_b158", n_layers=1)
    ternary = health.ternary_operands(layer_recipes(config))
    assert ternary == {f"layers_0/{p}/w" for p in ("attn/qkv_proj", "attn/o_proj", "mlp/gate_up_proj",
                                                    "mlp/down_proj")}  # not lm_head (bf16), not x
    weight = jax.random.normal(jax.random.key(6), (64, 32))
    w_stats = np.asarray(health.operand_stats(weight, QuantSpec("ternary", "tensor")))
    assert 0.6 < w_stats[1] < 0.8  # a Gaussian weight: ~70% of its codes at +-1
    monitor = health.HealthMonitor(0.05, 32.0, ternary=ternary)
    row, warning = monitor.update(1, {"layers_0/attn/qkv_proj/w": w_stats,
                                      "layers_0/attn/qkv_proj/x": np.array([1.0, 0.01, 0.0])})
    assert warning is None and row["health_saturation_max"] == pytest.approx(0.01)
    assert row["health/layers_0/attn/qkv_proj/w/saturated"] == pytest.approx(w_stats[1])  # still recorded
    _, warning = monitor.update(2, {"layers_0/attn/qkv_proj/w": w_stats,
                                    "layers_0/attn/qkv_proj/x": np.array([1.0, 0.5, 0.0])})
    assert warning is not None and "qkv_proj/x saturation 50.00%" in warning and "/w saturation" not in warning
    assert health.ternary_operands(layer_recipes(llama_config("tiny", recipe="int8_rowwise"))) == frozenset()
    rows = [{"step": 1, "health/layers_0/attn/qkv_proj/w/saturated": 0.7, "health/layers_0/attn/qkv_proj/x/saturated":
             0.01}]
    assert health.worst(rows)["saturated"][1] == "layers_0/attn/qkv_proj/w"
    assert health.worst(rows, ternary)["saturated"] == (0.01, "layers_0/attn/qkv_proj/x", 1)

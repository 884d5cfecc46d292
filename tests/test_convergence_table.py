"""benchmarks/convergence.py's table and the recipe names it takes (common.recipe_variant, common.split_options).
The table, of each run's final and lowest eval loss: one seed gives each recipe's difference to bf16; several give
each seed's difference to bf16's run of the same seed and their mean ± standard error."""

import json
import math
import os
import shutil
import types
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import convergence  # noqa: E402
from common import apply_options, recipe_variant, split_options  # noqa: E402


def test_one_seed():
    # int8_dataflow ends 1% above bf16 and its lowest eval (at step 500) 0.5% above bf16's lowest (at step 250)
    rows = convergence.table({"bf16": {0: [(250, 1.9), (500, 1.95), (750, 2.0)]},
                              "int8_dataflow": {0: [(250, 1.92), (500, 1.9095), (750, 2.02)]}})
    assert rows[2] == "| bf16 | 750 | 2.0000 | +0.00% | 1.9000 (250) | +0.00% |"
    assert rows[3] == "| int8_dataflow | 750 | 2.0200 | +1.00% | 1.9095 (500) | +0.50% |"


def test_seeds_are_paired_with_bf16():
    # seed 1's bf16 run is 2% worse; the recipe tracks it: per seed +1% and +0%, mean 0.5%, s.e. 0.5%; bf16's loss
    # row gives the seed spread (s.e. 0.02). The lowest evals (the first point here): bf16 1.9 and 1.9, the recipe
    # 1.919 and 1.881: +1% and -1%
    rows = convergence.table({"bf16": {0: [(5, 1.9), (10, 2.0)], 1: [(5, 1.9), (10, 2.04)]},
                              "fp8_dataflow": {0: [(5, 1.919), (10, 2.02)], 1: [(5, 1.881), (10, 2.04)]}})
    assert rows[2] == ("| bf16 | 0, 1 | 10 | 2.0200 ± 0.0200 | +0.00%, +0.00% | +0.00% ± 0.00% | 1.9000 ± 0.0000 | "
                       "+0.00% ± 0.00% |")
    assert rows[3] == ("| fp8_dataflow | 0, 1 | 10 | 2.0300 ± 0.0100 | +1.00%, +0.00% | +0.50% ± 0.50% | "
                       "1.9000 ± 0.0190 | +0.00% ± 1.00% |")


def test_recipes_with_their_own_seeds():
    # bf16 under three seeds, bitnet under one: paired with bf16's seed 0 alone, no s.e.
    rows = convergence.table({"bf16": {0: [(10, 2.0)], 1: [(10, 2.04)], 2: [(10, 2.02)]},
                              "bitnet_b158": {0: [(10, 2.04)]}})
    assert rows[2] == ("| bf16 | 0, 1, 2 | 10 | 2.0200 ± 0.0115 | +0.00%, +0.00%, +0.00% | +0.00% ± 0.00% | "
                       "2.0200 ± 0.0115 | +0.00% ± 0.00% |")
    assert rows[3] == "| bitnet_b158 | 0 | 10 | 2.0400 | +2.00% | +2.00% | 2.0400 | +2.00% |"


def test_no_bf16_baseline():
    row = convergence.table({"int8_rowwise": {0: [(5, 3.0)], 1: [(5, 3.1)]}})[2]
    assert row == "| int8_rowwise | 0, 1 | 5 | 3.0500 ± 0.0500 | – | – | 3.0500 ± 0.0500 | – |"


def test_a_suite_run_stopped_mid_way_resumes_to_the_same_curve(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "train"))
    from train_helpers import tiny_llama_config  # noqa: PLC0415

    from qjax.data import prepare_text  # noqa: PLC0415
    from qjax.train.metrics import curves  # noqa: PLC0415

    (tmp_path / "c.txt").write_text("the cat sat on the mat. a dog ran in the park. " * 200)
    prepare_text([tmp_path / "c.txt"], tmp_path / "tokens", val_fraction=0.1)
    config = tiny_llama_config(str(tmp_path / "tokens"))  # 6 steps, checkpoints every 2
    assert convergence.train_in_chunks(config, tmp_path / "whole", math.inf)[0]
    # a clock that passes the deadline once the first chunk has run: the run stops at step 2, like a device call
    ticks = iter([0.0, 0.0, 100.0, 100.0])
    assert not convergence.train_in_chunks(config, tmp_path / "split", 50.0, clock=lambda: next(ticks))[0]
    assert curves(str(tmp_path / "split"))[0][-1][0] == 2
    assert convergence.train_in_chunks(config, tmp_path / "split", math.inf)[0]  # the next call resumes
    assert curves(str(tmp_path / "split")) == curves(str(tmp_path / "whole"))
    # a finished run copied back without its checkpoints (the table reads metrics.jsonl) trains no more
    shutil.rmtree(tmp_path / "whole" / "checkpoints")
    assert convergence.train_in_chunks(config, tmp_path / "whole", -math.inf)[0]


def _fake_train(calls, seconds_per_step=None):
    """Stands in for qjax.train.train: logs a train row at stop_at (with the loop's seconds_per_step, if given) and,
    at the last step, the final eval, as the loop does."""
    def train(config, workdir, stop_at):
        calls.append(stop_at)
        row = {"step": stop_at, "loss": 1.0} | ({"seconds_per_step": seconds_per_step} if seconds_per_step else {})
        with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
            if stop_at == config.steps:
                f.write(json.dumps({"step": stop_at, "eval_loss": 2.0}) + "\n")
    return train


def _rows(workdir, rows):
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_a_run_is_complete_once_its_final_eval_is_logged(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(convergence, "train", _fake_train(calls))
    config = types.SimpleNamespace(steps=6, checkpoint_every=2, eval_every=3)
    _rows(tmp_path / "done", [{"step": 6, "loss": 1.0}, {"step": 6, "eval_loss": 2.0}])
    pace = convergence.Pace(step=1.0)
    assert convergence.train_in_chunks(config, tmp_path / "done", -math.inf, pace=pace) == (True, pace)
    assert calls == []
    # killed after its last train row, before the final eval: its last chunk trains again
    _rows(tmp_path / "cut", [{"step": 6, "loss": 1.0}, {"step": 3, "eval_loss": 2.5}])
    assert convergence.train_in_chunks(config, tmp_path / "cut", math.inf)[0]
    assert calls == [6]


def test_a_runs_first_chunk_is_held_to_the_budget_by_the_last_runs_pace(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(convergence, "train", _fake_train(calls))
    config = types.SimpleNamespace(steps=6, checkpoint_every=2, eval_every=3)
    (tmp_path / "run").mkdir()
    # 2 steps at 1 s each would end past a deadline 1.5 s away: nothing trains
    pace = convergence.Pace(step=1.0)
    assert convergence.train_in_chunks(config, tmp_path / "run", 1.5, clock=lambda: 0.0, pace=pace) == (False, pace)
    assert calls == []


def test_once_the_pace_is_known_one_train_call_runs_every_chunk_that_fits(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(convergence, "train", _fake_train(calls))
    config = types.SimpleNamespace(steps=8, checkpoint_every=2, eval_every=4)
    (tmp_path / "run").mkdir()
    # 1 s per step, 4.5 s left: one call to step 4 (chunks 2 and 4), then step 6 would end past the deadline
    ticks = iter([0.0, 0.0, 4.0, 4.0])
    assert convergence.train_in_chunks(config, tmp_path / "run", 4.5, clock=lambda: next(ticks),
                                       pace=convergence.Pace(step=1.0)) == (False, convergence.Pace(1.0, 0.0))
    assert calls == [4]
    # an unknown pace: one chunk measures it, then one call runs the rest
    (tmp_path / "fresh").mkdir()
    assert convergence.train_in_chunks(config, tmp_path / "fresh", math.inf)[0]
    assert calls == [4, 2, 8]


def test_the_pace_counts_each_calls_own_seconds_apart_from_the_steps(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(convergence, "train", _fake_train(calls, seconds_per_step=0.5))
    config = types.SimpleNamespace(steps=8, checkpoint_every=2, eval_every=4)
    (tmp_path / "run").mkdir()
    # the first call: 2 steps in 10 s, of which the loop's 0.5 s per step make 1 s: 9 s per call. With 11 s left,
    # the second call runs to step 6 (9 + 4 x 0.5 = 11 s), not to 8 (12 s)
    ticks = iter([0.0, 0.0, 10.0, 10.0, 10.0, 21.0, 21.0])
    assert convergence.train_in_chunks(config, tmp_path / "run", 21.0, clock=lambda: next(ticks)) == \
        (False, convergence.Pace(0.5, 9.0))
    assert calls == [2, 6]


def test_a_run_has_at_most_8_chunks_and_no_short_tail():
    for steps in (1, 7, 8, 9, 3052, 7629):
        every = convergence.chunk_steps(steps, 0)
        chunks = -(-steps // every)
        last = steps - (chunks - 1) * every
        assert chunks <= 8 and last >= every - 7, (steps, every)  # rounding up shortens the last by at most 7
    assert convergence.chunk_steps(7629, 0) == 954  # 8 chunks; 953 left a 5-step ninth chunk
    assert convergence.chunk_steps(100, 50) == 50  # the config's own interval, where longer


def test_recipe_variant_names():
    # The benchmarks' ablation names: suffixes compose, and an "_sr" that would round nothing is refused.
    r = recipe_variant("int8_dataflow_sr_recompute")
    assert r.recompute_prologue_output and r.dgrad.lhs.stochastic and r.wgrad.lhs.stochastic
    assert not recipe_variant("int8_dataflow_recompute").dgrad.lhs.stochastic
    for name in ("bf16_sr", "int8_fwd_sr", "int8_dataflow_sr_sr"):
        with pytest.raises(ValueError, match="'_sr' would change nothing; drop it"):
            recipe_variant(name)


def test_model_options_after_a_recipe():
    import ml_collections

    assert split_options("fp8_rowwise:smooth_swiglu:lm_head_8bit") == ("fp8_rowwise", ("smooth_swiglu",
                                                                                        "lm_head_8bit"))
    assert split_options("int8_dataflow_sr") == ("int8_dataflow_sr", ())
    with pytest.raises(ValueError, match="unknown option 'smooth' in 'fp8_rowwise:smooth': use any of "
                                         ":recompute_attention, :smooth_swiglu, :lm_head_8bit"):
        split_options("fp8_rowwise:smooth")
    config = ml_collections.ConfigDict({"model": {"recompute_attention": None, "smooth_swiglu": None},
                                        "keep_high_precision": None})
    apply_options(config, ("smooth_swiglu", "lm_head_8bit"))
    assert (config.model.smooth_swiglu, config.model.recompute_attention, config.keep_high_precision) == (
        True, None, ())  # an option not named leaves its field alone (GPT-2's config has neither model field)
    gpt2_like = ml_collections.ConfigDict({"model": {"remat": None}, "keep_high_precision": None})
    apply_options(gpt2_like, ())
    with pytest.raises(ValueError, match="option :smooth_swiglu sets config.model.smooth_swiglu, which this model"):
        apply_options(gpt2_like, ("smooth_swiglu",))


def test_a_run_is_reused_only_under_the_same_recipe_definition(tmp_path):
    nearest, stochastic = recipe_variant("int8_dataflow"), recipe_variant("int8_dataflow_sr")
    run = tmp_path / "int8_dataflow"
    convergence.check_same_recipe(run, nearest)
    convergence.check_same_recipe(run, nearest)  # the same definition: reused
    with pytest.raises(SystemExit, match="another definition of 'int8_dataflow_sr'.*new --workdir"):
        convergence.check_same_recipe(run, stochastic)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="did not record its recipe's definition"):
        convergence.check_same_recipe(tmp_path / "old", nearest)


def test_health_row_names_where_each_stat_was_worst():
    worst = {"saturated": (0.0014, "layers_0/mlp/down_proj/x", 300), "amax_growth": (15.62, "layers_1/attn/o_proj/w",
                                                                                     5700)}
    assert convergence.health_row("int8_rowwise", worst) == (
        "| int8_rowwise | 0.14% layers_0/mlp/down_proj/x @ 300 | – | x15.6 layers_1/attn/o_proj/w @ 5700 |")

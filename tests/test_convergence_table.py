"""benchmarks/convergence.py's table and the recipe names it takes (common.recipe_variant). The table: one seed
gives each recipe's difference to bf16; several give each seed's difference to bf16's run of the same seed and their
mean ± standard error."""

import math
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import convergence  # noqa: E402
from common import recipe_variant  # noqa: E402


def test_one_seed():
    rows = convergence.table({"bf16": {0: (750, 2.0)}, "int8_dataflow": {0: (750, 2.02)}})
    assert rows[2] == "| bf16 | 750 | 2.0000 | +0.00% |"
    assert rows[3] == "| int8_dataflow | 750 | 2.0200 | +1.00% |"


def test_seeds_are_paired_with_bf16():
    # seed 1's bf16 run is 2% worse; the recipe tracks it: per seed +1% and +0%, mean 0.5%, s.e. 0.5%; bf16's loss
    # row gives the seed spread (s.e. 0.02)
    rows = convergence.table({"bf16": {0: (10, 2.0), 1: (10, 2.04)}, "fp8_dataflow": {0: (10, 2.02), 1: (10, 2.04)}})
    assert rows[2] == "| bf16 | 0, 1 | 10 | 2.0200 ± 0.0200 | +0.00%, +0.00% | +0.00% ± 0.00% |"
    assert rows[3] == "| fp8_dataflow | 0, 1 | 10 | 2.0300 ± 0.0100 | +1.00%, +0.00% | +0.50% ± 0.50% |"


def test_recipes_with_their_own_seeds():
    # bf16 under three seeds, bitnet under one: paired with bf16's seed 0 alone, no s.e.
    rows = convergence.table({"bf16": {0: (10, 2.0), 1: (10, 2.04), 2: (10, 2.02)}, "bitnet_b158": {0: (10, 2.04)}})
    assert rows[2] == "| bf16 | 0, 1, 2 | 10 | 2.0200 ± 0.0115 | +0.00%, +0.00%, +0.00% | +0.00% ± 0.00% |"
    assert rows[3] == "| bitnet_b158 | 0 | 10 | 2.0400 | +2.00% | +2.00% |"


def test_no_bf16_baseline():
    row = convergence.table({"int8_rowwise": {0: (5, 3.0), 1: (5, 3.1)}})[2]
    assert row == "| int8_rowwise | 0, 1 | 5 | 3.0500 ± 0.0500 | – | – |"


def test_a_suite_run_stopped_mid_way_resumes_to_the_same_curve(tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "train"))
    from train_helpers import tiny_llama_config  # noqa: PLC0415

    from qjax.data import prepare_text  # noqa: PLC0415
    from qjax.train.metrics import curves  # noqa: PLC0415

    (tmp_path / "c.txt").write_text("the cat sat on the mat. a dog ran in the park. " * 200)
    prepare_text([tmp_path / "c.txt"], tmp_path / "tokens", val_fraction=0.1)
    config = tiny_llama_config(str(tmp_path / "tokens"))  # 6 steps, checkpoints every 2
    assert convergence.train_in_chunks(config, tmp_path / "whole", math.inf)
    # a clock that passes the deadline once the first chunk has run: the run stops at step 2, like a device call
    ticks = iter([0.0, 0.0, 100.0, 100.0])
    assert not convergence.train_in_chunks(config, tmp_path / "split", 50.0, clock=lambda: next(ticks))
    assert curves(str(tmp_path / "split"))[0][-1][0] == 2
    assert convergence.train_in_chunks(config, tmp_path / "split", math.inf)  # the next call resumes
    assert curves(str(tmp_path / "split")) == curves(str(tmp_path / "whole"))
    # a finished run copied back without its checkpoints (the table reads metrics.jsonl) trains no more
    shutil.rmtree(tmp_path / "whole" / "checkpoints")
    assert convergence.train_in_chunks(config, tmp_path / "whole", -math.inf)


def test_recipe_variant_names():
    # The benchmarks' ablation names: suffixes compose, and an "_sr" that would round nothing is refused.
    r = recipe_variant("int8_dataflow_sr_recompute")
    assert r.recompute_prologue_output and r.dgrad.lhs.stochastic and r.wgrad.lhs.stochastic
    assert not recipe_variant("int8_dataflow_recompute").dgrad.lhs.stochastic
    for name in ("bf16_sr", "int8_fwd_sr", "int8_dataflow_sr_sr"):
        with pytest.raises(ValueError, match="'_sr' would change nothing; drop it"):
            recipe_variant(name)


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

"""The recipe registry: names, exact semantics (docs/design.md, "Recipes"), immutability, per-GEMM variation."""

import dataclasses

import pytest

import qjax
from qjax.quantize import QuantSpec


def test_registry_names():
    assert list(qjax.RECIPES) == ["bf16", "int8_rowwise", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise",
                                  "bitnet_b158", "mxfp8", "fp8_dataflow", "int8_dataflow"]
    assert qjax.recipe("bf16").is_high_precision


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown recipe 'int4'.*int8_rowwise.*fp8_blockwise"):
        qjax.recipe("int4")


def test_semantics_match_design_table():
    int8 = qjax.recipe("int8_rowwise")
    for gemm in (int8.fwd, int8.dgrad, int8.wgrad):
        assert gemm.lhs == gemm.rhs == QuantSpec("int8", "row")
    tensorwise = qjax.recipe("fp8_tensorwise")
    assert tensorwise.fwd.lhs == tensorwise.fwd.rhs == QuantSpec("e4m3", "tensor")
    for gemm in (tensorwise.dgrad, tensorwise.wgrad):
        assert gemm.lhs == QuantSpec("e5m2", "tensor") and gemm.rhs == QuantSpec("e4m3", "tensor")
    rowwise = qjax.recipe("fp8_rowwise")
    assert rowwise.wgrad.lhs == QuantSpec("e4m3", "row", pow2_scale=True)
    blockwise = qjax.recipe("fp8_blockwise")
    assert (blockwise.fwd.lhs.granularity, blockwise.fwd.rhs.granularity) == ("1x128", "128x128")
    assert (blockwise.dgrad.lhs.granularity, blockwise.dgrad.rhs.granularity) == ("1x128", "128x128")
    assert (blockwise.wgrad.lhs.granularity, blockwise.wgrad.rhs.granularity) == ("1x128", "1x128")
    # Every named recipe rounds to nearest (int8_dataflow too: Jetfire's stochastic gradients cost it loss, so they
    # are the opt-in with_stochastic_gradients); the data-flow recipes' GEMMs are those of their base recipes.
    assert [name for name, r in qjax.RECIPES.items() if r.needs_key] == []
    for name, base in (("fp8_dataflow", "fp8_tensorwise"), ("int8_dataflow", "int8_rowwise")):
        flow, gemms = qjax.recipe(name), qjax.recipe(base)
        assert (flow.fwd, flow.dgrad, flow.wgrad) == (gemms.fwd, gemms.dgrad, gemms.wgrad)
        assert flow.saved.granularity == "row"
    assert (qjax.recipe("fp8_dataflow").saved_group, qjax.recipe("int8_dataflow").saved_group) == (16, 32)


def test_frozen_and_replace():
    recipe = qjax.recipe("int8_rowwise")
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.fwd = None
    fwd_only = dataclasses.replace(recipe, name="int8_fwd", dgrad=None, wgrad=None)
    assert fwd_only.fwd == recipe.fwd and fwd_only.dgrad is None and qjax.recipe("int8_rowwise").dgrad is not None
    sr = qjax.with_stochastic_gradients(recipe)
    assert sr.needs_key and sr.dgrad.lhs.stochastic and sr.wgrad.lhs.stochastic
    assert not sr.fwd.lhs.stochastic and not sr.dgrad.rhs.stochastic


def test_invalid_gemm_specs():
    with pytest.raises(ValueError, match="cannot mix int8 and fp8"):
        qjax.GemmSpec(QuantSpec("int8"), QuantSpec("e4m3"))
    with pytest.raises(ValueError, match="both operands block-scaled"):
        qjax.GemmSpec(QuantSpec("e4m3", "1x128"), QuantSpec("e4m3", "row"))

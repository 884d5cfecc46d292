"""The fused quantize kernels (qjax.kernels.quantize_mgpu) against the jnp reference `quantize_with_seed`.

Off a Hopper GPU the kernels run under the Mosaic GPU interpreter (slow: small shapes, each case covers two
granularities, one per layout) and must equal the jitted reference bit for bit: codes as raw bytes, scales as f32
bits. On a GPU (marked tests, real sizes) the compiled kernels are compared with XLA:GPU's reference: codes and
scales exact, except that fp8 NaN codes only need to be NaN on both sides (NaN sign/payload bits are backend
choices). The `lowers_for_hopper` tests run the Mosaic GPU lowering (layouts, SMEM transfers, TMA descriptors) for
an sm_90 target on the CPU; they cannot run ptxas or the kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qjax import formats
from qjax.kernels import quantize_mgpu
from qjax.dispatch import on_hopper_gpu
from qjax.quantize import QuantSpec, quantize_with_seed

ROW_SEED, COL_SEED = np.uint32(0x1234567), np.uint32(4242)
interpreter_only = pytest.mark.skipif(on_hopper_gpu(), reason="CPU interpreter tests (GPU: the gpu tests)")

# Ties at scale 1 (the block holding them also holds the format's max): half-even must pick the even neighbour.
_TIES = {"int8": [0.5, 1.5, 2.5, -2.5, -0.5, 126.5], "e4m3": [17.0, 19.0, -21.0, 304.0, 0.5 + 2**-5, -9.0],
         "e5m2": [4.5, 5.5, -6.5, 0.875, 40960.0, -1.25]}


def _input(shape, dtype, fmt_name, specials, seed=0):
    """Normal values spread over decades, ties at scale 1 in row 1 and column 2 (with the format's max in the
    same row / column block), a zero block, and optionally NaN / +-Inf in separate blocks."""
    m, k = shape
    key_n, key_e = jax.random.split(jax.random.key(seed))
    x = np.array(jax.random.normal(key_n, shape) * 10.0 ** jax.random.uniform(key_e, shape, minval=-3, maxval=1))
    top = formats.get_format(fmt_name).max_value
    ties = _TIES[fmt_name]
    x[1, 0], x[1, 3:3 + len(ties)] = top, ties
    x[0, 2], x[3:3 + len(ties), 2] = -top, ties
    x[m // 2:, k - 128:] = 0  # all-zero 1x128 blocks (and an all-zero 128x128 tile when M >= 256)
    if specials:
        x[3, 5] = np.nan
        x[m // 2 - 1, 130] = np.inf
        x[m - 1, 7] = -np.inf
    return jnp.asarray(x, dtype)


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same_qtensor(got, want, compiled):
    """Codes and scales equal bit for bit (compiled on a GPU: fp8 NaN codes need only be NaN on both sides)."""
    assert got.granularity == want.granularity
    assert got.data.shape == want.data.shape and got.data.dtype == want.data.dtype
    assert got.scale.shape == want.scale.shape and got.scale.dtype == jnp.float32
    np.testing.assert_array_equal(_bits(got.scale), _bits(want.scale))
    codes, codes_ref = _bits(got.data), _bits(want.data)
    if compiled and jnp.issubdtype(want.data.dtype, jnp.floating):
        nan, nan_ref = np.isnan(np.asarray(got.data, np.float32)), np.isnan(np.asarray(want.data, np.float32))
        np.testing.assert_array_equal(nan, nan_ref)
        codes, codes_ref = codes[~nan_ref], codes_ref[~nan_ref]
    differ = int(np.sum(codes != codes_ref))
    assert differ == 0, f"{differ} of {codes.size} codes differ ({want.data.dtype}, {want.granularity})"


def _check_pair(x, row_spec, col_spec):
    compiled = on_hopper_gpu()
    interpret = None if compiled else True
    # Jitted: run eagerly, interpreted kernels can deadlock with the next eager op (benchmarks/NOTES.md).
    if col_spec is None:
        got_row = jax.jit(lambda x: quantize_mgpu.quantize_kernel(x, row_spec, ROW_SEED, interpret=interpret))(x)
        got_col = None
    else:
        got_row, got_col = jax.jit(lambda x: quantize_mgpu.quantize_pair_kernel(
            x, row_spec, col_spec, ROW_SEED, COL_SEED, interpret=interpret))(x)
    want_row = jax.jit(lambda x: quantize_with_seed(x, row_spec, ROW_SEED))(x)
    assert_same_qtensor(got_row, want_row, compiled)
    if col_spec is None:
        return got_row, None
    want_col = jax.jit(lambda x: quantize_with_seed(x.T, col_spec, COL_SEED))(x)
    assert_same_qtensor(got_col, want_col, compiled)
    return got_row, got_col


# Each case: (x shape, x dtype, row spec, col spec, NaN/Inf in x). Together: every format x granularity; every
# granularity and every format both nearest and stochastic; pow2 scales; mixed formats; the three input dtypes;
# both layouts' SR indices at a shape with several tiles along M and K; one single-layout call (col spec None).
S = lambda dtype, granularity, sr=False, pow2=False: QuantSpec(dtype, granularity, stochastic=sr, pow2_scale=pow2)
CASES = [
    ((256, 384), jnp.bfloat16, S("int8", "1x128"), S("e4m3", "128x128", sr=True), True),
    ((128, 256), jnp.bfloat16, S("e5m2", "row", sr=True), S("int8", "tensor", pow2=True), True),
    ((128, 256), jnp.float32, S("e4m3", "1x128", sr=True), S("e5m2", "128x128", pow2=True), True),
    ((256, 384), jnp.float16, S("int8", "128x128", sr=True), S("e4m3", "row", pow2=True), True),
    ((128, 256), jnp.bfloat16, S("int8", "row"), S("e5m2", "1x128", sr=True), False),
    ((128, 256), jnp.bfloat16, S("e4m3", "tensor", sr=True), S("e5m2", "tensor"), False),
    ((128, 256), jnp.bfloat16, S("e4m3", "row", sr=True, pow2=True), None, False),
]


def _zero_blocks(x_layout, granularity):
    """Mask of the all-zero blocks of an (R, K) array for a block granularity, in the scale's shape."""
    r, k = x_layout.shape
    block_r = 1 if granularity == "1x128" else 128
    return ~np.asarray(x_layout != 0).reshape(r // block_r, block_r, k // 128, 128).any(axis=(1, 3))


@interpreter_only
@pytest.mark.parametrize("shape,dtype,row_spec,col_spec,specials", CASES)
def test_pair_matches_reference(shape, dtype, row_spec, col_spec, specials):
    x = _input(shape, dtype, row_spec.dtype, specials)
    got_row, got_col = _check_pair(x, row_spec, col_spec)
    for got, spec, transposed in ((got_row, row_spec, False), (got_col, col_spec, True)):
        layout = x.T if transposed else x
        if spec is None:
            continue
        scale = np.asarray(got.scale)
        assert np.isnan(scale).any() == specials  # a block holding NaN gets a NaN scale (numerics.amax)
        assert np.isinf(scale).any() == (specials and spec.granularity != "tensor")  # Inf without NaN: Inf
        if spec.granularity in ("1x128", "128x128"):
            zero = _zero_blocks(layout, spec.granularity)
            assert np.all(scale[zero] == 1) and np.all(np.asarray(got.data, np.float32)[np.repeat(np.repeat(
                zero, layout.shape[0] // zero.shape[0], 0), 128, 1)] == 0)
            assert zero.any() or transposed or shape[0] < 256  # the input has zero blocks on the row side
        if spec.pow2_scale:
            finite = scale[np.isfinite(scale)]
            np.testing.assert_array_equal(np.frexp(finite)[0], 0.5)


@interpreter_only
@pytest.mark.parametrize("row_spec,col_spec,valid_rows", [
    (S("int8", "row", sr=True), S("int8", "row", sr=True), 200),  # int8_dataflow's x / g pair; a partial tile
    (S("e4m3", "1x128"), S("e4m3", "128x128", sr=True), 72),  # block scales; rows 72.. of tile 0, all of tile 1
    (S("e4m3", "tensor"), S("e5m2", "row"), 0),  # the XLA tensor amax; no valid row at all
])
def test_valid_rows_read_as_zeros(row_spec, col_spec, valid_rows):
    """valid_rows (a ragged_dot's padding rows): the kernels equal the reference on x with those rows zeroed, bit
    for bit, and NaN / Inf there reach no code or scale."""
    x = np.array(_input((256, 384), jnp.bfloat16, row_spec.dtype, specials=False), np.float32)
    x[valid_rows:, 0], x[-1, 5], x[valid_rows:, 200] = np.nan, np.inf, 1e30
    x = jnp.asarray(x, jnp.bfloat16)
    got = jax.jit(lambda x, n: quantize_mgpu.quantize_pair_kernel(
        x, row_spec, col_spec, ROW_SEED, COL_SEED, valid_rows=n, interpret=True))(x, jnp.int32(valid_rows))
    zeroed = x.at[valid_rows:].set(0)
    assert_same_qtensor(got[0], jax.jit(lambda x: quantize_with_seed(x, row_spec, ROW_SEED))(zeroed), False)
    assert_same_qtensor(got[1], jax.jit(lambda x: quantize_with_seed(x.T, col_spec, COL_SEED))(zeroed), False)
    assert all(np.isfinite(np.asarray(q.scale)).all() for q in got)


@interpreter_only
@pytest.mark.parametrize("spec,spec_t", [
    (S("int8", "row", sr=True), S("int8", "row", sr=True)),  # int8_rowwise SR: the forward's and dgrad's weight
    (S("e4m3", "tensor", sr=True), S("e4m3", "row", pow2=True)),  # a tensor scale over all groups
])
def test_grouped_pair_runs_grouped_kernel(spec, spec_t):
    """The experts' weights w (G, K, N) of a ragged_dot through dispatch.quantize_grouped_pair: the kernel with
    col_groups (one amax and one tile kernel for the whole batch) equals the reference on swapaxes(w) bit for bit,
    both layouts; a NaN in one expert's weight makes only its row scales NaN. One expert (G = 1) and a
    block-scaled dgrad layout take the reference, in the reference's shapes."""
    from qjax import dispatch
    from qjax.quantize import quantize_pair_reference

    w = np.array(_input((3 * 128, 256), jnp.float32, "e4m3", specials=False), np.float32).reshape(3, 128, 256)
    w[1, 5, 7] = np.nan
    w = jnp.asarray(w, jnp.bfloat16)
    for w, spec_t, kernel_groups in ((w, spec_t, [3]), (w[:1], spec_t, []), (w, S("e4m3", "1x128"), [])):
        calls = []
        kernel = quantize_mgpu.quantize_pair_kernel
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(quantize_mgpu, "quantize_pair_kernel",
                          lambda *a, **kw: calls.append(kw["col_groups"]) or kernel(*a, **kw))
            with dispatch.force("interpret"):
                got = jax.jit(lambda w: dispatch.quantize_grouped_pair(w, spec, spec_t, ROW_SEED, COL_SEED))(w)
        assert calls == kernel_groups
        want = jax.jit(lambda w: quantize_pair_reference(jnp.swapaxes(w, 1, 2), spec, spec_t, ROW_SEED,
                                                         COL_SEED))(w)
        for g, r in zip(got, want):
            assert_same_qtensor(g, r, False)
        if spec.granularity == "row" and kernel_groups:
            nan_groups = np.isnan(np.asarray(got[0].scale)).any(axis=(1, 2))
            np.testing.assert_array_equal(nan_groups, [False, True, False])


@pytest.mark.parametrize("shape,tiles_per_program", [((128, 256), 4), ((256, 512), 2)])  # 1 program / 4 of 2 tiles
def test_amax_pair_is_the_row_and_column_amax(shape, tiles_per_program):
    x = _input(shape, jnp.bfloat16, "e4m3", specials=True)
    interpret = None if on_hopper_gpu() else True
    row_amax, col_amax = jax.jit(lambda x: quantize_mgpu.amax_pair(x, interpret=interpret,
                                                                   tiles_per_program=tiles_per_program))(x)
    x32 = np.asarray(x, np.float32)
    for axis, got in ((1, row_amax), (0, col_amax)):  # NaN where a NaN is, else max |x| (Inf where an Inf is)
        np.testing.assert_array_equal(np.asarray(got), np.where(np.isnan(x32).any(axis), np.nan,
                                                                np.nanmax(np.abs(x32), axis=axis)))
    assert np.isnan(row_amax[3]) and np.isnan(col_amax[5]) and np.isinf(row_amax[-1])  # NaN and -Inf rows


@pytest.mark.parametrize("row_spec,col_spec,amax_kernel", [
    (QuantSpec("int8", "tensor"), QuantSpec("int8", "row"), True),
    (QuantSpec("e4m3", "tensor"), QuantSpec("e4m3", "tensor"), False),  # XLA's tensor amax
])
def test_row_axes_inside_shard_map(row_spec, col_spec, amax_kernel, monkeypatch):
    """`row_axes` (qjax.dot_general's per-device GEMMs): inside `jax.shard_map` the tensor and column amax are
    reduced over the mesh axes M is split over. On a one-device mesh (the CPU interpreter cannot run kernels on
    several devices at once) the reduction is the identity: the kernel must lower, run, and equal the reference,
    including the scale whose amax is reduced."""
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    x = _input((128, 256), jnp.bfloat16, row_spec.dtype, specials=False)
    interpret = None if on_hopper_gpu() else True

    amax_calls = []
    monkeypatch.setattr(quantize_mgpu, "amax_pair",
                        lambda *args, _amax_pair=quantize_mgpu.amax_pair, **kw: amax_calls.append(1) or _amax_pair(
                            *args, **kw))

    def per_device(x):
        row, col = quantize_mgpu.quantize_pair_kernel(x, row_spec, col_spec, interpret=interpret, row_axes=("data",))
        return row.data, row.scale, col.data, col.scale

    run = jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P(), P(None, "data"), P()),
                        check_vma=False)
    assert str(jax.make_jaxpr(run)(x)).count("pmax") == 2  # each side's tensor or column amax
    assert bool(amax_calls) == amax_kernel
    row_codes, row_scale, col_codes, col_scale = jax.jit(run)(x)
    want_row = quantize_with_seed(x, row_spec, None)
    want_col = quantize_with_seed(x.T, col_spec, None)
    for got, want in ((row_codes, want_row.data), (row_scale, want_row.scale), (col_codes, want_col.data),
                      (col_scale, want_col.scale)):
        np.testing.assert_array_equal(_bits(got), _bits(want))


def test_supports_and_errors():
    spec = S("int8", "row")
    ok = jnp.zeros((256, 128), jnp.bfloat16)
    assert quantize_mgpu.supports(ok, spec, spec) is None
    assert quantize_mgpu.supports(ok, spec, None) is None
    assert "multiples of 128" in quantize_mgpu.supports(jnp.zeros((200, 128)), spec, spec)
    assert "multiples of 128" in quantize_mgpu.supports(jnp.zeros((256, 64)), spec, None)
    assert "2-D" in quantize_mgpu.supports(jnp.zeros((2, 128, 128)), spec, spec)
    assert "float32, bfloat16 or float16" in quantize_mgpu.supports(jnp.zeros((128, 128), jnp.int8), spec, spec)
    assert "QuantSpec" in quantize_mgpu.supports(ok, "int8", spec)
    assert "row_spec is required" in quantize_mgpu.supports(ok, None, spec)
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_mgpu.quantize_pair_kernel(jnp.zeros((200, 128)), spec, spec, interpret=True)
    with pytest.raises(ValueError, match="seed"):
        quantize_mgpu.quantize_pair_kernel(ok, S("int8", "row", sr=True), None, None, interpret=True)


def test_lowers_for_hopper():
    """The Mosaic GPU lowering (register layouts, transposed SMEM loads, TMA) succeeds for sm_90, on any host: two
    kernels (amax, tile) with a row-scaled side, the tile kernel alone where the only given scale is a tensor's."""
    for dtype, row_spec, col_spec, kernels in (
            (jnp.bfloat16, S("e4m3", "128x128", sr=True, pow2=True), S("int8", "row", sr=True), 2),
            (jnp.float32, S("int8", "1x128"), S("e5m2", "tensor"), 1)):
        for valid_rows in (None, jnp.int32(200)):  # and with a ragged_dot's padding rows masked
            f = lambda x: quantize_mgpu.quantize_pair_kernel(x, row_spec, col_spec, ROW_SEED, COL_SEED,
                                                             valid_rows=valid_rows)
            lowered = jax.jit(f).trace(jnp.zeros((256, 384), dtype)).lower(lowering_platforms=("cuda",))
            assert _mosaic_calls(lowered.as_text()) == kernels
    # the experts' weights of a ragged_dot: the col side per group (3-D output and inverse-scale regions)
    f = lambda x: quantize_mgpu.quantize_pair_kernel(x, S("int8", "row", sr=True), S("int8", "row", sr=True),
                                                     ROW_SEED, COL_SEED, col_groups=2)
    lowered = jax.jit(f).trace(jnp.zeros((512, 384), jnp.bfloat16)).lower(lowering_platforms=("cuda",))
    assert _mosaic_calls(lowered.as_text()) == 2


def _mosaic_calls(hlo_text):
    """Custom calls to Mosaic GPU kernels in lowered StableHLO text."""
    return sum("mosaic_gpu" in line for line in hlo_text.splitlines() if "stablehlo.custom_call" in line)


# ---------------------------------------------------------------- GPU (H100/H200): compiled kernels vs XLA:GPU


@pytest.mark.gpu
@pytest.mark.parametrize("row_spec,col_spec", [
    (S("int8", "row"), S("int8", "row")),  # int8_rowwise: fwd lhs x and wgrad rhs x
    (S("int8", "row", sr=True), S("int8", "row", sr=True)),
    (S("e4m3", "1x128"), S("e4m3", "1x128")),  # fp8_blockwise: x 1x128 and 128x1
    (S("e4m3", "row", pow2=True), S("e4m3", "row", sr=True, pow2=True)),
    (S("e4m3", "tensor"), S("e4m3", "tensor", sr=True)),
    (S("int8", "128x128", sr=True), S("e5m2", "1x128", sr=True)),
])
def test_gpu_pair_matches_reference(row_spec, col_spec):
    assert on_hopper_gpu(), jax.devices()
    x = _input((16384, 4096), jnp.bfloat16, row_spec.dtype, specials=False, seed=1)
    _check_pair(x, row_spec, col_spec)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_gpu_specials_and_input_dtypes(dtype):
    x = _input((2048, 1536), dtype, "e4m3", specials=True, seed=2)
    _check_pair(x, S("e4m3", "1x128", sr=True), S("e4m3", "128x128", pow2=True))
    _check_pair(x, S("int8", "row"), S("int8", "tensor", sr=True))

"""The Mosaic GPU grouped scaled GEMMs (rows ragged: forward and dgrad; contracting over each group's rows: wgrad)
against their reference (`qjax.ragged_dot._grouped_gemm`, XLA's ragged_dot on the codes with the scales after it),
and `qjax.ragged_dot`'s use of them and of JAX's bf16 grouped kernels.

Off a Hopper GPU the kernel runs under the Mosaic GPU interpreter (slow: few, small cases, each covering several
ragged properties: an empty group, a group straddling tiles, rows past sum(group_sizes), M, N and K that pad);
`test_lowers_for_cuda` lowers the default config at the MoE benchmark's size for the GPU from any machine. Tests
marked gpu run compiled at size, and JAX's bf16 kernels (which have no interpreted mode), only on the device.

Tolerances: int8 sums are exact in both, and the scales are multiplied in the reference's order, so float32
outputs are equal; fp8 sums differ in float32 summation order only (interpreted) or by Hopper's reduced-precision
fp8 accumulation (compiled, unpromoted).

The fp8 contracting kernel is checked against exact sums (float64 on the codes, `_exact_contract`), not against
XLA's ragged_dot on the fp8 codes: XLA:GPU's Triton GEMM emitter compiles every fp8 dot without accumulator
promotion (max_num_imprecise_acc at its maximum), whatever its precision config, so a GPU reference that lands
there accumulates in Hopper's reduced precision. `test_fp8_contract_kernel` prints, per group and output tile,
what explains an error (a missing or duplicated token block, shifted tokens, another group's tokens, or none:
precision), the unpromoted kernel's and XLA's errors against the same sums, and which GEMM XLA compiled (run it
with -s on the device).
"""

import dataclasses
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qjax
from qjax.dispatch import on_hopper_gpu
from qjax.kernels import grouped_bf16_mgpu
from qjax.kernels import grouped_contract_mgpu as contract
from qjax.kernels import grouped_matmul_mgpu as grouped
from qjax.quantize import QuantSpec, quantize

ragged_dot_lib = importlib.import_module("qjax.ragged_dot")  # the module (qjax.ragged_dot is the function)
INTERPRET = not on_hopper_gpu()
# Small tiles: several work items per group and several n-tiles per CTA at small sizes, short interpreter compiles.
SMALL = grouped.GroupedConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)
# Two compute warpgroups: 128-row items, so at these sizes some halves hold none of an item's rows (skipped).
SMALL_2WG = dataclasses.replace(SMALL, compute_warpgroups=2)
F32_RTOL = 1e-5  # relative to |a| |b|^T: float32 summation order over K <= 4096
FP8_RTOL = F32_RTOL if INTERPRET else 2e-3  # compiled, unpromoted: Hopper's fp8 wgmma accumulation
PROMOTED_FP8_RTOL = F32_RTOL if INTERPRET else 5e-4  # compiled, promoted every tile_k (as the dense kernel's)


def _operands(m, n, k, groups, code, seed=0):
    """Row-quantized a (M, K) with per-row magnitudes over decades, b (G, N, K) per-(group, n) scales."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), np.float32) * 10.0 ** rng.uniform(-2, 2, (m, 1)).astype(np.float32)
    w = rng.standard_normal((groups, n, k), np.float32) * 10.0 ** rng.uniform(-1, 1, (groups, 1, 1)).astype(
        np.float32)
    spec = QuantSpec(code, "row")
    return quantize(jnp.asarray(x), spec), quantize(jnp.asarray(w), spec)


def _contract_operands(m, n, k, code, seed=0):
    """Row-quantized a (K, M) and b (N, M): the tokens last, per-feature magnitudes over decades."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((k, m), np.float32) * 10.0 ** rng.uniform(-2, 2, (k, 1)).astype(np.float32)
    g = rng.standard_normal((n, m), np.float32) * 10.0 ** rng.uniform(-1, 1, (n, 1)).astype(np.float32)
    spec = QuantSpec(code, "row")
    return quantize(jnp.asarray(x), spec), quantize(jnp.asarray(g), spec)


def _contract_reference(a, b, sizes, out_dtype, precise):
    out = ragged_dot_lib._grouped_gemm(a, b, sizes, ragged_dot_lib._RAGGED_CONTRACT, None, out_dtype, precise)
    return np.asarray(out.astype(jnp.float32), np.float64)  # an empty group's dw is 0


def _reference(a, b, sizes, out_dtype, precise=False):
    group_ids = ragged_dot_lib._rows_and_groups(a.data.shape[0], sizes)[1]
    out = ragged_dot_lib._grouped_gemm(a, b, sizes, ragged_dot_lib._RAGGED_ROWS, group_ids, out_dtype, precise)
    return np.asarray(out.astype(jnp.float32), np.float64)  # rows past sum(sizes) are 0


def _magnitude(a, b, sizes):
    """|a| |b[group(r)]|^T per row: the scale of each output's summation-order error."""
    ab = lax.ragged_dot(jnp.abs(a.dequantize()), jnp.swapaxes(jnp.abs(b.dequantize()), 1, 2), sizes,
                        precision=lax.Precision.HIGHEST)
    return np.asarray(ab, np.float64)


def _kernel(a, b, sizes, out_dtype, config=SMALL, precise=False):
    # jitted: interpreted kernels run eagerly can deadlock with the next eager op
    fn = jax.jit(lambda a, b, s: grouped.grouped_matmul_kernel(a, b, s, out_dtype, precise=precise, config=config,
                                                               interpret=INTERPRET))
    out = fn(a, b, sizes)
    assert out.shape == (a.data.shape[0], b.data.shape[1]) and out.dtype == jnp.dtype(out_dtype)
    return np.asarray(out.astype(jnp.float32), np.float64)


def _assert_close(out, ref, mag, out_dtype, rtol):
    bound = rtol * mag + (2.0**-8 * np.abs(ref) if out_dtype == jnp.bfloat16 else 0)
    assert np.all(np.isfinite(out))
    excess = np.abs(out - ref) - bound
    assert excess.max() <= 0, f"worst excess {excess.max():.3g} at {np.unravel_index(excess.argmax(), out.shape)}"


def test_work_items_cover_each_row_once():
    """Every row of every group is in exactly one item of its group, the rows past the sum in group G's items (the
    zero tiles); items past row M have no rows."""
    for sizes in ([0, 70, 0, 1, 64, 100, 0], [0, 300, 0, 0, 0, 0, 0]):  # sum 235 < M = 300; sum M
        sizes = jnp.array(sizes, jnp.int32)
        m, tile, groups = 300, 64, sizes.shape[0]
        table = np.asarray(grouped.work_items(sizes, m, tile))
        assert table.shape == (4, -(-m // tile) + groups)
        owner = np.full(m, -1)
        for group, tile_idx, first, count in table.T:
            assert 0 <= first and first + count <= tile and 0 <= group <= groups
            rows = np.arange(tile_idx * tile + first, tile_idx * tile + first + count)
            assert (owner[rows] == -1).all(), "a row in two items"
            owner[rows] = group
        total = int(sizes.sum())
        expected = np.concatenate([np.full(s, g) for g, s in enumerate(np.asarray(sizes))]
                                  + [np.full(m - total, groups)])
        np.testing.assert_array_equal(owner, expected)


@pytest.mark.parametrize("config", [SMALL, SMALL_2WG], ids=["1wg", "2wg"])
@pytest.mark.parametrize("code, out_dtype, sizes, m", [
    # empty first and middle groups, a group straddling tiles, 30 rows past the sum; M, N, K all pad
    ("int8", jnp.float32, (0, 70, 0, 100), 200),
    # one group of all the rows
    ("e4m3", jnp.bfloat16, (0, 192, 0, 0), 192),
])
def test_kernel_equals_reference(code, out_dtype, sizes, m, config):
    n, k = 160, 192  # pad to 192 = 3 n-tiles; K = 3 steps
    sizes = jnp.array(sizes, jnp.int32)
    a, b = _operands(m, n, k, sizes.shape[0], code)
    out, ref = _kernel(a, b, sizes, out_dtype, config), _reference(a, b, sizes, out_dtype)
    if code == "int8" and out_dtype == jnp.float32:
        np.testing.assert_array_equal(out, ref)  # exact int32 sums, the reference's scale order
    _assert_close(out, ref, _magnitude(a, b, sizes), out_dtype, FP8_RTOL if code == "e4m3" else 0.0)
    assert (out[int(sizes.sum()):] == 0).all()


@pytest.mark.parametrize("config", [SMALL, SMALL_2WG], ids=["1wg", "2wg"])
def test_precise_fp8_promotes(config):
    """fp8 with precise accumulation (the dgrad) against the reference at Precision.HIGHEST."""
    sizes = jnp.array([100, 28], jnp.int32)
    a, b = _operands(128, 64, 256, 2, "e4m3", seed=1)
    out = _kernel(a, b, sizes, jnp.float32, config, precise=True)
    _assert_close(out, _reference(a, b, sizes, jnp.float32, precise=True), _magnitude(a, b, sizes), jnp.float32,
                  PROMOTED_FP8_RTOL)


def test_two_warpgroup_configs_fit():
    """Two compute warpgroups keep two output tiles in SMEM: fewer pipeline stages, fewer for float32 outputs; a
    config without room for two stages is refused, and so is one whose promoting warpgroups lack registers."""
    two = grouped.GroupedConfig(compute_warpgroups=2)
    assert grouped.GroupedConfig().stages(jnp.float32) == 4
    assert (two.stages(jnp.bfloat16), two.stages(jnp.float32)) == (3, 2)
    with pytest.raises(ValueError, match="two pipeline stages"):
        grouped.GroupedConfig(tile_n=256, max_concurrent_steps=2, compute_warpgroups=2)
    with pytest.raises(ValueError, match="compute_warpgroups must be 1 or 2"):
        grouped.GroupedConfig(compute_warpgroups=3)
    # promoting warpgroups hold two f32 tiles each: 128 x 128 would need 256 registers per thread
    assert grouped.resolve_config(None, promote=True) is grouped.PROMOTE_CONFIG
    assert grouped.resolve_config(dataclasses.replace(two, tile_m=64), promote=True).tile_m == 64
    assert grouped.resolve_config(two, promote=False) is two
    with pytest.raises(ValueError, match="use tile_m=64"):
        grouped.resolve_config(two, promote=True)


def test_group_blocks_cover_each_group():
    """Each group's blocks are the tile_k token blocks its tokens touch, shared with a neighbour where a boundary
    falls inside one; an empty group has none."""
    sizes = jnp.array([0, 70, 0, 1, 64, 100], jnp.int32)
    table = np.asarray(contract.group_blocks(sizes, 64))
    start = 0
    for size, (first, blocks, group_start, group_end) in zip(np.asarray(sizes), table.T):
        assert (group_start, group_end) == (start, start + size)
        touched = sorted({t // 64 for t in range(start, start + size)})
        assert blocks == len(touched) and (not touched or first == touched[0])
        start += size
    np.testing.assert_array_equal(table[:2], [[0, 0, 1, 1, 1, 2], [0, 2, 0, 1, 2, 2]])


def _contract_kernel(a, b, sizes, out_dtype, precise, config=SMALL):
    fn = jax.jit(lambda a, b, s: contract.grouped_contract_kernel(a, b, s, out_dtype, precise=precise, config=config,
                                                                 interpret=INTERPRET))
    out = fn(a, b, sizes)
    assert out.shape == (sizes.shape[0], a.data.shape[0], b.data.shape[0]) and out.dtype == jnp.dtype(out_dtype)
    return np.asarray(out.astype(jnp.float32), np.float64)


@pytest.mark.parametrize("config", [SMALL, dataclasses.replace(SMALL_2WG, num_ctas=3)], ids=["1wg", "2wg-3ctas"])
def test_contract_kernel_equals_reference(config):
    """int8: an empty group, a 3-row group, 27 rows past the sum; K and N pad, several token blocks per group (with
    3 CTAs each walks 4 tiles of 0 to 2 blocks: pipelines of different lengths in a row)."""
    m, n, k = 200, 160, 96
    sizes = jnp.array((70, 0, 100, 3), jnp.int32)
    a, b = _contract_operands(m, n, k, "int8")
    out = _contract_kernel(a, b, sizes, jnp.float32, precise=True, config=config)
    np.testing.assert_array_equal(out, _contract_reference(a, b, sizes, jnp.float32, True))
    assert (out[np.asarray(sizes) == 0] == 0).all()


def _codes_and_scales(q):
    """(codes as float64 (rows, M), row scales (rows, 1) float64): fp8 and int8 codes are exact in float64."""
    codes = np.asarray(q.data.astype(jnp.float32), np.float64)
    return codes, np.broadcast_to(np.asarray(q.scale, np.float64).reshape(-1, 1), (codes.shape[0], 1))


def _exact_contract(a, b, sizes):
    """(G, K, N) float64: the exact per-group sums of the codes rounded to float32 and scaled as the kernel does,
    (acc * sa) * sb in float32; and |a| |b|^T per group (the scale of summation-order errors)."""
    (ac, sa), (bc, sb) = _codes_and_scales(a), _codes_and_scales(b)
    ends = np.cumsum(np.asarray(sizes))
    exact = np.stack([ac[:, e - s:e] @ bc[:, e - s:e].T for s, e in zip(np.asarray(sizes), ends)])
    mag = np.stack([np.abs(ac[:, e - s:e]) @ np.abs(bc[:, e - s:e]).T for s, e in zip(np.asarray(sizes), ends)])
    f32 = lambda v: v.astype(np.float32)
    return (f32(exact) * f32(sa)) * f32(sb).T, mag * sa * sb.T


def _contract_error(out, ref, mag, out_dtype):
    """Per element |out - ref| beyond rounding ref to out_dtype (half a bf16 ulp, at most 2**-8 |ref|), relative to
    |a| |b|^T (0 where the group is empty)."""
    rounding = 2.0**-8 * np.abs(ref) if out_dtype == jnp.bfloat16 else 0.0
    return np.maximum(np.abs(out - ref) - rounding, 0) / np.maximum(mag, np.finfo(np.float32).tiny)


def _explain(diff, candidates):
    """The first candidate error that diff equals (to 1% of its size), else None."""
    size = np.abs(diff).max()
    for name, candidate in candidates.items():
        if np.abs(diff - candidate).max() <= 1e-2 * size:
            return name
    return None


def _diagnose_contract(label, out, a, b, sizes, out_dtype, config, rtol):
    """Prints, per non-empty group, the worst error / magnitude against the exact sums and, per output tile
    (config.tile_m x tile_n) over rtol, what its error equals: a token block (tile_k tokens of the group's run)
    missing or counted twice, the group's tokens shifted by a few rows, another group's sum added, or an unwritten
    tile; none of them means precision. Returns the worst error / magnitude and {(group, i, j): cause} for the
    tiles over rtol."""
    ref, mag = _exact_contract(a, b, sizes)
    err = _contract_error(out, ref, mag, out_dtype)
    (ac, sa), (bc, sb) = _codes_and_scales(a), _codes_and_scales(b)
    partial = lambda lo, hi: ac[:, max(lo, 0):max(hi, 0)] @ bc[:, max(lo, 0):max(hi, 0)].T * sa * sb.T
    sizes_np = np.asarray(sizes)
    ends = np.cumsum(sizes_np)
    tm, tn = config.tile_m, config.tile_n
    tiles = [(i, j) for i in range(-(-out.shape[1] // tm)) for j in range(-(-out.shape[2] // tn))]
    causes = {}
    print(f"\n{label}: worst error / |a||b| {err.max():.3g} (tolerance {rtol:.3g})")
    for g, (size, end) in enumerate(zip(sizes_np, ends)):
        start = end - size
        if size == 0:
            assert (out[g] == 0).all(), f"{label}: empty group {g} has nonzero outputs"
            continue
        exact = partial(start, end)
        candidates = {"unwritten (zero)": -exact}
        for t in range(-(-size // config.tile_k)):
            block = partial(start + t * config.tile_k, min(start + (t + 1) * config.tile_k, end))
            candidates[f"token block {t} missing"] = -block
            candidates[f"token block {t} twice"] = block
        for shift in (-2, -1, 1, 2):
            candidates[f"tokens shifted by {shift}"] = partial(start + shift, end + shift) - exact
        for h, (other, other_end) in enumerate(zip(sizes_np, ends)):
            if h != g and other:
                candidates[f"group {h}'s tokens added"] = partial(other_end - other, other_end)
        print(f"  group {g} ({size} tokens from {start}): worst {err[g].max():.3g}, median {np.median(err[g]):.3g}")
        for i, j in tiles:
            rows, cols = slice(i * tm, (i + 1) * tm), slice(j * tn, (j + 1) * tn)
            if not err[g, rows, cols].max() <= rtol:  # NaN included
                diff = out[g, rows, cols] - ref[g, rows, cols]
                cause = ("non-finite outputs" if not np.isfinite(diff).all() else
                         _explain(diff, {name: c[rows, cols] for name, c in candidates.items()}) or "precision")
                causes[g, i, j] = cause
                print(f"    tile ({i}, {j}): error {err[g, rows, cols].max():.3g}, {cause}")
    return err.max(), causes


def test_contract_diagnosis_names_structural_errors():
    """The diagnosis (host numpy only) tells a missing token block, shifted tokens, an unwritten tile and a NaN
    apart, leaves correct tiles alone, and its worst error is NaN where an output is."""
    sizes = jnp.array((70, 0, 100, 3), jnp.int32)
    a, b = _contract_operands(200, 160, 96, "e4m3")
    ref, _ = _exact_contract(a, b, sizes)
    (ac, sa), (bc, sb) = _codes_and_scales(a), _codes_and_scales(b)
    partial = lambda lo, hi: ac[:, lo:hi] @ bc[:, lo:hi].T * sa * sb.T
    out = ref.copy()
    out[2, :64, :64] -= partial(70 + 64, 170)[:64, :64]  # group 2's second block (tokens 134..169) lost
    out[0, 64:, 64:128] = partial(1, 71)[64:, 64:128]  # group 0 read one token late
    out[3, :64, 128:] = 0  # never written
    out[3, 70, 5] = np.nan
    worst, causes = _diagnose_contract("synthetic", out, a, b, sizes, jnp.float32, SMALL, 1e-5)
    assert causes == {(2, 0, 0): "token block 1 missing", (0, 1, 1): "tokens shifted by 1",
                      (3, 0, 2): "unwritten (zero)", (3, 1, 0): "non-finite outputs"}
    assert np.isnan(worst)


def _xla_gemms(fn, *args) -> list[str]:
    """The GEMM kinds XLA compiled fn to: custom-call targets and fusion kinds naming a GEMM (e.g. __triton_gemm,
    __cublas$lt$matmul$f8); empty off the GPU."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    names = set(re.findall(r'custom_call_target="([^"]+)"', hlo)) | set(re.findall(r'"kind":\s*"(__[a-z_$]+)"', hlo))
    return sorted(n for n in names if any(w in n for w in ("gemm", "matmul", "cublas", "triton", "cudnn")))


_THREE_CTAS = dataclasses.replace(SMALL, num_ctas=3)
# label: (precise, config, rtol)
_CONTRACT_RUNS = {"promoted": (True, SMALL, PROMOTED_FP8_RTOL),
                  "promoted, 3 CTAs": (True, _THREE_CTAS, PROMOTED_FP8_RTOL),
                  "unpromoted, 3 CTAs": (False, _THREE_CTAS, FP8_RTOL),
                  "promoted, 2 warpgroups, 3 CTAs": (True, dataclasses.replace(_THREE_CTAS, compute_warpgroups=2),
                                                     PROMOTED_FP8_RTOL)}


# Each run (accumulation and grid) once, each with one of the two group layouts (interpreted runs are slow).
@pytest.mark.parametrize("out_dtype, sizes, runs", [
    # one group of all the rows (the GPU's failing case), bf16 out
    (jnp.bfloat16, (0, 200, 0, 0), ("promoted", "promoted, 2 warpgroups, 3 CTAs")),
    # group boundaries inside token blocks: an empty group, a 3-row group, 27 rows past the sum
    (jnp.float32, (70, 0, 100, 3), ("promoted, 3 CTAs", "unpromoted, 3 CTAs")),
])
def test_fp8_contract_kernel(out_dtype, sizes, runs):
    """The fp8 contracting kernel, promoted (the wgrad's precise accumulation) and not, against exact sums, with a
    diagnosis of any error; prints XLA's ragged_dot error (the fp8 reference `_grouped_gemm`) beside it, on the fp8
    codes and on them cast to bf16. Compiled, SMALL's grid gives each CTA one tile, 3 CTAs walk 8 tiles each
    (pipelines of 0 to 4 token blocks in a row)."""
    m, n, k = 200, 160, 96
    sizes = jnp.array(sizes, jnp.int32)
    a, b = _contract_operands(m, n, k, "e4m3")
    worst = {}
    for label in runs:
        precise, config, rtol = _CONTRACT_RUNS[label]
        out = _contract_kernel(a, b, sizes, out_dtype, precise, config)
        worst[label], _ = _diagnose_contract(label, out, a, b, sizes, out_dtype, config, rtol)
    ref, mag = _exact_contract(a, b, sizes)
    xla = _contract_reference(a, b, sizes, out_dtype, True)
    gemm = lambda a, b, s: ragged_dot_lib._grouped_gemm(a, b, s, ragged_dot_lib._RAGGED_CONTRACT, None, out_dtype,
                                                        True)
    print(f"XLA ragged_dot on the codes at HIGHEST: worst error / |a||b| "
          f"{_contract_error(xla, ref, mag, out_dtype).max():.3g}; GEMMs {_xla_gemms(gemm, a, b, sizes)}")
    # the same on the codes cast to bf16 (exact for e4m3): what a precise XLA fallback could run instead
    bf16 = lambda q: dataclasses.replace(q, data=q.data.astype(jnp.bfloat16))
    xla_bf16 = np.asarray(jax.jit(gemm)(bf16(a), bf16(b), sizes).astype(jnp.float32), np.float64)
    xla_bf16 = np.where(np.asarray(sizes)[:, None, None] > 0, xla_bf16, 0)
    print(f"XLA ragged_dot on the codes as bf16: worst error / |a||b| "
          f"{_contract_error(xla_bf16, ref, mag, out_dtype).max():.3g}; "
          f"GEMMs {_xla_gemms(gemm, bf16(a), bf16(b), sizes)}")
    assert all(worst[label] <= _CONTRACT_RUNS[label][2] for label in worst), worst


def test_ragged_dot_runs_kernel_and_matches_reference(monkeypatch):
    """qjax.ragged_dot int8_rowwise with the kernels (forward, dgrad, wgrad) equals it without (XLA), value and
    grads."""
    calls = []
    for module, name in ((grouped, "grouped_matmul_kernel"), (contract, "grouped_contract_kernel")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    m, k, n = 192, 128, 128
    sizes = jnp.array([50, 0, 90], jnp.int32)
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w, g = jax.random.normal(kx, (m, k)), jax.random.normal(kw, (3, k, n)) * 0.1, jax.random.normal(kg, (m, n))

    def run(mode):
        with qjax.dispatch.force(mode):
            fn = jax.jit(lambda x, w: jax.vjp(lambda x, w: qjax.ragged_dot(x, w, sizes, recipe="int8_rowwise"),
                                              x, w))
            out, vjp = fn(x, w)
            return [np.asarray(v) for v in (out, *vjp(g))]

    kernel = run("interpret" if INTERPRET else "kernel")
    assert sorted(calls) == ["grouped_contract_kernel"] + ["grouped_matmul_kernel"] * 2  # wgrad; forward, dgrad
    for ours, ref in zip(kernel, run("reference")):
        np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_bad_operands():
    a, b = _operands(64, 64, 64, 2, "int8")
    sizes = jnp.array([32, 32], jnp.int32)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        grouped.grouped_matmul_kernel(a, b, sizes, jnp.float16, interpret=True)
    with pytest.raises(ValueError, match=r"group_sizes must have shape \(2,\)"):
        grouped.grouped_matmul_kernel(a, b, sizes[:1], jnp.float32, interpret=True)
    fp8_b = quantize(b.dequantize(), QuantSpec("e4m3", "row"))
    with pytest.raises(ValueError, match="int8 x int8 or float8"):
        grouped.grouped_matmul_kernel(a, fp8_b, sizes, jnp.float32, interpret=True)
    with pytest.raises(ValueError, match="tile_n must be"):
        grouped.GroupedConfig(tile_n=96)
    with pytest.raises(ValueError, match=r"a \(K, M\) and b \(N, M\)"):
        contract.grouped_contract_kernel(a, b, sizes, jnp.float32, interpret=True)


def test_bf16_kernels_only_where_they_tile():
    """JAX's bf16 kernels take bf16 in and out, M, K, N multiples of 128, compiled; the rest stays on XLA."""
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    assert grouped_bf16_mgpu.bf16_supports(bf16(256, 128), bf16(4, 128, 384), jnp.bfloat16, interpret=False) is None
    assert "interpreted" in grouped_bf16_mgpu.bf16_supports(bf16(256, 128), bf16(4, 128, 384), jnp.bfloat16,
                                                            interpret=True)
    assert "multiples of 128" in grouped_bf16_mgpu.bf16_supports(bf16(200, 128), bf16(4, 128, 384), jnp.bfloat16, False)
    assert "bfloat16" in grouped_bf16_mgpu.bf16_supports(bf16(256, 128), bf16(4, 128, 384), jnp.float32, False)


def test_lowers_for_cuda():
    """The default config and two compute warpgroups at the MoE benchmark's gate_up shape lower to a Mosaic GPU
    module (layouts, wgmma operands, shared memory), accumulating and promoting, both kernels."""
    m, k, n, groups = 131072, 2048, 2816, 64
    for code, promote in ((jnp.int8, False), (jnp.float8_e4m3fn, False), (jnp.float8_e4m3fn, True)):
        config = grouped.GroupedConfig(num_ctas=132)
        two = grouped.resolve_config(dataclasses.replace(config, compute_warpgroups=2, tile_m=64 if promote else 128),
                                     promote)
        args = (jax.ShapeDtypeStruct((m, k), code), jax.ShapeDtypeStruct((groups, n, k), code),
                jax.ShapeDtypeStruct((m,), jnp.float32), jax.ShapeDtypeStruct((groups, n), jnp.float32),
                jax.ShapeDtypeStruct((groups,), jnp.int32))
        # two compute warpgroups with float32 outputs too: two pipeline stages beside two f32 output tiles
        for rows_config, out_dtype in ((config, jnp.bfloat16), (two, jnp.bfloat16), (two, jnp.float32)):
            lowered = jax.jit(lambda *xs: grouped._launch(*xs, out_dtype=jnp.dtype(out_dtype), config=rows_config,
                                                          promote=promote, interpret=False)).trace(*args).lower(
                                                              lowering_platforms=("cuda",))
            assert "mosaic_gpu" in lowered.as_text()
        contract_args = (jax.ShapeDtypeStruct((k, m), code), jax.ShapeDtypeStruct((n, m), code),
                         jax.ShapeDtypeStruct((k,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32),
                         jax.ShapeDtypeStruct((groups,), jnp.int32))
        for contract_config in (config, two):
            lowered = jax.jit(lambda *xs: contract._launch_contract(
                *xs, out_dtype=jnp.dtype(jnp.float32), config=contract_config, promote=promote,
                interpret=False)).trace(*contract_args).lower(lowering_platforms=("cuda",))
            assert "mosaic_gpu" in lowered.as_text()


def test_contract_default_avoids_padding_k():
    """An expert FFN width of 1408 (a multiple of 128, not of the default's 256-row tiles) gets 64-row halves, so
    that a's codes are not padded; they lower for the GPU with int8 codes. Widths the default tiles keep it."""
    assert contract._unpadded_default(1408, promote=False).tile_m == 64
    assert contract._unpadded_default(2048, promote=False) == grouped.DEFAULT_CONFIG
    assert contract._unpadded_default(1400, promote=False) == grouped.DEFAULT_CONFIG  # padding either way
    assert contract._unpadded_default(1408, promote=True) == grouped.PROMOTE_CONFIG
    m, k, n, groups = 131072, 1408, 2048, 64
    args = (jax.ShapeDtypeStruct((k, m), jnp.int8), jax.ShapeDtypeStruct((n, m), jnp.int8),
            jax.ShapeDtypeStruct((k,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32),
            jax.ShapeDtypeStruct((groups,), jnp.int32))
    config = dataclasses.replace(contract._unpadded_default(k, promote=False), num_ctas=132)
    lowered = jax.jit(lambda *xs: contract._launch_contract(
        *xs, out_dtype=jnp.dtype(jnp.bfloat16), config=config, promote=False,
        interpret=False)).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_bf16_rows_lower_for_cuda():
    """JAX's bf16 grouped kernel with our block sizes, forward and dgrad (transposed rhs), lowers at the MoE
    benchmark's size. (Its wgrad kernel asks the device for its SM count, so it lowers on the GPU only.)"""
    m, k, n, groups = 131072, 2048, 2816, 64
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    for transpose_rhs, rhs in ((False, bf16(groups, k, n)), (True, bf16(groups, n, k))):
        fn = jax.jit(lambda x, w, s: grouped_bf16_mgpu.bf16_rows(x, w, s, transpose_rhs=transpose_rhs))
        lowered = fn.trace(bf16(m, k), rhs, jax.ShapeDtypeStruct((groups,), jnp.int32)).lower(
            lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


# ---- compiled, real sizes (device only) ----

def _routed_sizes(rows, groups, seed=0):
    counts = np.bincount(np.random.default_rng(seed).integers(0, groups, rows), minlength=groups)
    counts[3] = 0  # an empty expert
    return jnp.asarray(counts, jnp.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("warpgroups", [1, 2])
@pytest.mark.parametrize("code, precise", [("int8", False), ("e4m3", False), ("e4m3", True)])
def test_kernel_at_size(code, precise, warpgroups):
    m, k, n, groups = 8192, 2048, 1408, 16
    sizes = _routed_sizes(m - 100, groups)  # 100 rows past the sum
    a, b = _operands(m, n, k, groups, code)
    config = grouped.GroupedConfig(compute_warpgroups=warpgroups, tile_m=64 if precise and warpgroups == 2 else 128)
    out = _kernel(a, b, sizes, jnp.float32, config=config, precise=precise)
    rtol = 0.0 if code == "int8" else (PROMOTED_FP8_RTOL if precise else FP8_RTOL)
    _assert_close(out, _reference(a, b, sizes, jnp.float32, precise), _magnitude(a, b, sizes), jnp.float32, rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("warpgroups", [1, 2])
@pytest.mark.parametrize("code", ["int8", "e4m3"])
def test_contract_kernel_at_size(code, warpgroups):
    m, k, n, groups = 8192, 2048, 1408, 16
    sizes = _routed_sizes(m - 100, groups)
    a, b = _contract_operands(m, n, k, code)
    promoted = code == "e4m3" and warpgroups == 2  # registers: 64-row halves (grouped.resolve_config)
    config = grouped.GroupedConfig(compute_warpgroups=warpgroups, tile_m=64 if promoted else 128)
    out = jax.jit(lambda a, b, s: contract.grouped_contract_kernel(a, b, s, jnp.float32, precise=True,
                                                                   config=config))(a, b, sizes)
    out = np.asarray(out, np.float64)
    if code == "int8":
        np.testing.assert_array_equal(out, _contract_reference(a, b, sizes, jnp.float32, True))
    else:
        ref, mag = _exact_contract(a, b, sizes)
        error = _contract_error(out, ref, mag, jnp.float32)
        assert error.max() <= PROMOTED_FP8_RTOL, f"worst error / |a||b| {error.max():.3g}"


@pytest.mark.gpu
def test_contract_kernel_default_at_expert_width():
    """The default config at K = 1408 (int8 with 64-row halves, `_unpadded_default`), exact."""
    m, k, n, groups = 8192, 1408, 2048, 16
    sizes = _routed_sizes(m - 100, groups)
    a, b = _contract_operands(m, n, k, "int8")
    out = jax.jit(lambda a, b, s: contract.grouped_contract_kernel(a, b, s, jnp.float32, precise=True))(a, b, sizes)
    np.testing.assert_array_equal(np.asarray(out, np.float64), _contract_reference(a, b, sizes, jnp.float32, True))


@pytest.mark.gpu
def test_bf16_ragged_dot_on_jax_kernels():
    """recipe "bf16" on JAX's grouped kernels: value and both gradients within bf16 rounding of lax.ragged_dot at
    Precision.HIGHEST in float32 (rows past the sum 0, an empty group)."""
    m, k, n, groups = 4096, 1024, 768, 8
    sizes = _routed_sizes(m - 256, groups)
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (groups, k, n)) * k**-0.5).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (m, n), jnp.bfloat16)
    assert ragged_dot_lib._use_bf16_kernels(importlib.import_module("qjax.recipes").recipe("bf16"), x, w, None)

    def value_and_grads(fn, *args):
        out, vjp = jax.vjp(fn, *args)
        return (out, *vjp(g.astype(out.dtype)))

    ours = jax.jit(lambda x, w: value_and_grads(lambda x, w: qjax.ragged_dot(x, w, sizes, recipe="bf16"), x, w))
    exact = lambda x, w: lax.ragged_dot(x, w, sizes, precision=lax.Precision.HIGHEST)
    refs = value_and_grads(exact, x.astype(jnp.float32), w.astype(jnp.float32))
    for got, ref in zip(ours(x, w), refs):
        assert got.dtype == jnp.bfloat16
        got, ref = np.asarray(got.astype(jnp.float32), np.float64), np.asarray(ref, np.float64)
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, ref, rtol=2.0**-7, atol=2.0**-7 * np.abs(ref).max())

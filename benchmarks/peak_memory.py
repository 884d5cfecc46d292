"""Where a train step's peak memory goes, per recipe: XLA's memory analysis of the compiled step, on any machine.

  python benchmarks/peak_memory.py                                  # 1.1B shape, 2 and 4 layers, batch 8 x 2048
  python benchmarks/peak_memory.py --layers 2 --recipes bf16 int8_dataflow --residuals

Compiles (never runs) the train step of `qjax.train.make_train_step`, as benchmarks/train.py builds it (optax
AdamW, float32 params, LM head in bf16), on abstract inputs, and prints per recipe the compiled step's argument,
output, alias (donated) and temporary bytes from `compiled.memory_analysis()`; peak = argument + output - alias +
temp, which is what XLA's buffer assignment allocates at most (the GPU runtime adds its own workspace). Compiling
at two depths gives the bytes each layer adds (the slope) and the rest (the intercept), extrapolated to
--extrapolate layers (22: the 1.1B model).

On a machine without a GPU the reference GEMMs run (the same tensors are saved: the kernels' codes and scales
equal the references'), and attention has no flash implementation: XLA's would save the (B, heads, T, T) scores and
probabilities, gigabytes a layer that cuDNN never keeps. So attention here is `flash_attention`, a custom VJP that
saves what cuDNN's flash attention saves (q, k, v, the output and a float32 logsumexp per query) and recomputes the
probabilities in the backward one (batch, kv head) at a time; --attention xla keeps XLA's.

--memory-report DIR keeps XLA's memory-usage report of each compiled step (its largest buffers, with shapes; on a
GPU it names what the CPU cannot show). --residuals prints what the loss's vjp saves
(`jax._src.ad_checkpoint.saved_residuals` over the whole model, LM head and loss included), grouped by source, at the
smallest depth. The residuals column sums them at every depth: unlike the compiled peak, they are the same on every
backend (docs/performance.md). A memory-usage report on the GPU:
  python benchmarks/peak_memory.py --layers 22 --memory-report /tmp/reports   # attention: cuDNN's (auto)
"""

import argparse
import collections
import functools
import glob
import math
import os
import pathlib
import shutil
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax._src.ad_checkpoint import saved_residuals

from activations import nbytes, short_source
from common import REPO, llama_config

sys.path.insert(0, str(REPO))  # this checkout's qjax and configs/
from qjax.models import layers  # noqa: E402
from qjax.train import make_task, make_train_step  # noqa: E402

GB = 1e9


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q, k, v, is_causal):
    return _flash_forward(q, k, v, is_causal)[0]


def _per_kv_head(q, k, v):
    """(B, T, H, D), (B, T, Hkv, D) -> q (B*Hkv, G, T, D), k, v (B*Hkv, T, D), G = H / Hkv query heads per kv head."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, t, hkv, h // hkv, d).transpose(0, 2, 3, 1, 4).reshape(b * hkv, h // hkv, t, d)
    kv = lambda x: x.transpose(0, 2, 1, 3).reshape(b * hkv, t, d)
    return q, kv(k), kv(v)


def _probabilities(q, k, is_causal, lse=None):
    """float32 scores (G, T, T) of one kv head's queries, and their logsumexp (or the probabilities given it)."""
    s = jnp.einsum("gqd,kd->gqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    if is_causal:
        t = q.shape[1]
        s = jnp.where(jnp.arange(t)[:, None] >= jnp.arange(t)[None, :], s, -jnp.inf)
    if lse is None:
        return s, jax.nn.logsumexp(s, axis=-1)
    return jnp.exp(s - lse[..., None])


def _flash_forward(q, k, v, is_causal):
    qh, kh, vh = _per_kv_head(q, k, v)

    def one(args):
        q, k, v = args
        s, lse = _probabilities(q, k, is_causal)
        return jnp.einsum("gqk,kd->gqd", jnp.exp(s - lse[..., None]).astype(v.dtype), v).astype(q.dtype), lse

    out, lse = jax.lax.map(one, (qh, kh, vh))  # (B*Hkv, G, T, D), (B*Hkv, G, T)
    b, t, h, d = q.shape
    out = out.reshape(b, k.shape[2], h // k.shape[2], t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
    return out, lse


def _flash_fwd(q, k, v, is_causal):
    out, lse = _flash_forward(q, k, v, is_causal)
    return out, (q, k, v, out, lse)


def _flash_bwd(is_causal, residuals, g):
    q, k, v, out, lse = residuals
    qh, kh, vh = _per_kv_head(q, k, v)
    gh, oh = _per_kv_head(g, k, v)[0], _per_kv_head(out, k, v)[0]
    scale = 1 / math.sqrt(q.shape[-1])

    def one(args):
        q, k, v, g, o, lse = args
        p = _probabilities(q, k, is_causal, lse)  # (G, T, T) float32
        g32 = g.astype(jnp.float32)
        dv = jnp.einsum("gqk,gqd->kd", p, g32)
        dp = jnp.einsum("gqd,kd->gqk", g32, v.astype(jnp.float32))
        ds = p * (dp - jnp.sum(g32 * o.astype(jnp.float32), axis=-1, keepdims=True)) * scale
        dq = jnp.einsum("gqk,kd->gqd", ds, k.astype(jnp.float32))
        dk = jnp.einsum("gqk,gqd->kd", ds, q.astype(jnp.float32))
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    dq, dk, dv = jax.lax.map(one, (qh, kh, vh, gh, oh, lse))
    b, t, h, d = q.shape
    hkv = k.shape[2]
    dq = dq.reshape(b, hkv, h // hkv, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
    back = lambda x: x.reshape(b, hkv, t, d).transpose(0, 2, 1, 3)
    return dq, back(dk), back(dv)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(config, q, k, v, *, is_causal: bool):
    """`qjax.models.layers.attention` with flash attention's residuals (module docstring): (B, T, H * D)."""
    out = _flash(q, k, v, is_causal)
    return out.reshape(*out.shape[:2], -1)


def train_config(recipe: str, n_layers: int, batch: int, seq: int, optimizer: str, attention: str = "flash"):
    """benchmarks/train.py's 1.1B row config at `n_layers` layers ("flash": XLA attention, replaced by main)."""
    config = llama_config("1b")
    config.model.n_layers = n_layers
    config.model.attention = "xla" if attention == "flash" else attention
    config.recipe = recipe
    config.optimizer.name = optimizer
    config.seq_len, config.batch_size, config.steps = seq, batch, 1000
    return config


def abstract_batch(batch: int, seq: int) -> dict:
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return {"inputs": tokens, "targets": tokens}


def step_memory(config) -> dict:
    """{argument, output, alias, temp, peak} bytes of the compiled train step of `config` (compiled, not run)."""
    task = make_task(config)
    init_state, train_step = make_train_step(config, task)
    state = jax.eval_shape(init_state)
    m = train_step.lower(state, abstract_batch(config.batch_size, config.seq_len)).compile().memory_analysis()
    out = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes, alias=m.alias_size_in_bytes,
               temp=m.temp_size_in_bytes)
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def loss_residuals(config) -> list[tuple[str, str, tuple, int]]:
    """[(source, dtype, shape, bytes)] that the vjp of the task's loss saves, on abstract params and batch."""
    task = make_task(config)
    params = jax.eval_shape(task.init, jax.random.key(0))
    batch = abstract_batch(config.batch_size, config.seq_len)
    loss = lambda p, batch: task.loss(p, batch, jax.random.key(0))[0]
    return [(short_source(src), str(aval.dtype), aval.shape, nbytes(aval))
            for aval, src in saved_residuals(loss, params, batch)]


def residual_table(rows) -> str:
    grouped = collections.defaultdict(lambda: [0, 0])
    for source, dtype, shape, b in rows:
        g = grouped[(source, dtype, shape)]
        g[0] += 1
        g[1] += b
    lines = ["| where (saved_residuals) | shape | dtype | count | MB |", "|---|---|---|---:|---:|"]
    for (source, dtype, shape), (count, b) in sorted(grouped.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {source} | {shape} | {dtype} | {count} | {b / 1e6:,.1f} |")
    lines.append(f"\nTotal {sum(r[3] for r in rows) / GB:.3f} GB.")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["bf16", "int8_rowwise", "int8_dataflow", "fp8_dataflow"])
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 4], help="depths to compile (two: a slope)")
    parser.add_argument("--extrapolate", type=int, default=22, help="layers to extrapolate to (1.1B: 22)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--optimizer", default="adamw", help="qjax.train.OPTIMIZERS name")
    parser.add_argument("--attention", choices=("flash", "xla", "auto"),
                        help="flash (default off a GPU; module docstring), xla, or auto (the model's choice: cuDNN "
                             "on a GPU, the default there)")
    parser.add_argument("--residuals", action="store_true", help="print the saved residuals per tensor")
    parser.add_argument("--memory-report", metavar="DIR",
                        help="write XLA's memory-usage report of each compiled step (its largest buffers, with "
                             "shapes) to DIR/<recipe>_<layers>.txt")
    args = parser.parse_args()
    dump = tempfile.mkdtemp() if args.memory_report else None
    if dump:  # read when the backend starts, below
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
                                   " --xla_dump_hlo_module_re=train_step")
    args.attention = args.attention or ("auto" if jax.default_backend() == "gpu" else "flash")
    if args.attention == "flash":
        layers.attention = flash_attention  # module docstring: cuDNN's residuals on any machine
    print(f"1.1B shape, batch {args.batch} x seq {args.seq}, optimizer {args.optimizer}, attention {args.attention}, "
          f"backend {jax.default_backend()}; GB = 1e9 bytes; residuals: what the loss's vjp saves\n")
    config = lambda recipe, n: train_config(recipe, n, args.batch, args.seq, args.optimizer, args.attention)
    lo, hi = min(args.layers), max(args.layers)
    keys = ("argument", "output", "alias", "temp", "peak", "residuals")
    lines, fits = ["| recipe | layers | " + " | ".join(keys) + " |", "|---|" + "---:|" * (len(keys) + 1)], {}
    for recipe in args.recipes:
        for n in sorted(set(args.layers)):
            m = step_memory(config(recipe, n))
            m["residuals"] = sum(r[3] for r in loss_residuals(config(recipe, n)))
            if dump:
                out = pathlib.Path(args.memory_report)
                out.mkdir(parents=True, exist_ok=True)
                for report in glob.glob(f"{dump}/*memory-usage-report.txt"):
                    shutil.move(report, out / f"{recipe}_{n}layers.txt")
            fits[recipe, n] = m
            lines.append(f"| {recipe} | {n} | " + " | ".join(f"{m[k] / GB:.2f}" for k in keys) + " |")
            print(lines[-1], flush=True)
    print("\n" + "\n".join(lines))
    if hi > lo:
        base = None
        n = args.extrapolate
        print(f"\nPer layer: the slope between {lo} and {hi} layers. At {n} layers: the compiled peak extrapolated, "
              "and state (arguments) + residuals, the live set at the start of the backward pass.\n\n"
              f"| recipe | peak / layer | temp / layer | residuals / layer | peak at {n} | vs {args.recipes[0]} | "
              f"state + residuals at {n} | vs {args.recipes[0]} |\n|---|---:|---:|---:|---:|---:|---:|---:|")
        for recipe in args.recipes:
            a, b = fits[recipe, lo], fits[recipe, hi]
            slope = {k: (b[k] - a[k]) / (hi - lo) for k in keys}
            at = {k: a[k] + slope[k] * (n - lo) for k in keys}
            live = at["argument"] + at["residuals"]
            base = base or (at["peak"], live)
            print(f"| {recipe} | {slope['peak'] / GB:.3f} | {slope['temp'] / GB:.3f} | {slope['residuals'] / GB:.3f} | "
                  f"{at['peak'] / GB:.2f} | {at['peak'] / base[0]:.2f}x | {live / GB:.2f} | {live / base[1]:.2f}x |")
    if args.residuals:
        for recipe in args.recipes:
            print(f"\n### {recipe}: saved residuals of the loss, {lo} layers\n")
            print(residual_table(loss_residuals(config(recipe, lo))))


if __name__ == "__main__":
    main()

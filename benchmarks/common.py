"""Helpers shared by the JAX benchmark scripts: timing, SNR, and appending a table to RESULTS.md.

Scripts in this folder run as `python benchmarks/NAME.py`, so `import common` finds this file.
"""

import datetime
import fcntl
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

RESULTS = pathlib.Path(__file__).with_name("RESULTS.md")
REPO = pathlib.Path(__file__).resolve().parent.parent


def time_ms(fn, args, warmup, reps, inner=1):
    """Median milliseconds of one call of `fn(*args)`.

    Each of `reps` timed samples dispatches `inner` calls back to back and waits once: dispatch is asynchronous,
    so for ops shorter than the host's dispatch time (a 1024^3 GEMM takes ~2 us on an H200) inner > 1 keeps the
    GPU queue full and measures the device rather than one launch plus a round trip per sample.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(inner)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) * 1e3 / inner)
    return statistics.median(times)


def batched_seconds(fn, inputs, rounds: int, calls: int) -> float:
    """Median seconds per call of fn over `inputs` (arrays, or tuples of arguments): one jit of fn on every input
    (distinct inputs, so XLA cannot merge the calls), dispatched `calls` times back to back and timed to the last
    result, median of `rounds`. Dispatching one short call at a time would time the host instead."""
    batched = jax.jit(lambda inputs: [fn(*a) if isinstance(a, tuple) else fn(a) for a in inputs])
    jax.block_until_ready(batched(inputs))  # compile + warm up
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready([batched(inputs) for _ in range(calls)])
        samples.append((time.perf_counter() - start) / calls / len(inputs))
    return statistics.median(samples)


def snr_db(ref, out) -> float:
    """20 log10(|ref| / |ref - out|) in float64 on the host; inf when equal, nan if either holds NaN/Inf."""
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    if not (np.isfinite(ref).all() and np.isfinite(out).all()):
        return float("nan")
    err = np.linalg.norm(ref - out)
    return float("inf") if err == 0 else float(20 * np.log10(np.linalg.norm(ref) / err))


def git_commit() -> str:
    """Short commit of the checkout, '+dirty' when qjax/ or benchmarks/ differ from it; 'unknown' without git.

    $QJAX_COMMIT, when set, is returned instead: a copy of the working tree sent to another machine can carry a
    stale .git (the device copies reported the session's first commit for every later one), so a script run there
    should pass the commit it was sent from (`QJAX_COMMIT=$(git rev-parse --short HEAD)` where it is written)."""
    if os.environ.get("QJAX_COMMIT"):
        return os.environ["QJAX_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "qjax", "benchmarks"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def device_kind() -> str:
    return jax.devices()[0].device_kind


def append_results(title: str, report: str, path: pathlib.Path = RESULTS) -> None:
    """Appends `report` to `path` (RESULTS.md) under a heading with the device, UTC date, jax version, commit and
    command line."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    heading = f"## {title} — {device_kind()} — {stamp} — jax {jax.__version__} — code at {git_commit()}"
    command = "python " + " ".join(shlex.quote(a) for a in [f"benchmarks/{pathlib.Path(sys.argv[0]).name}",
                                                            *sys.argv[1:]])
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # device_run.sh lanes finish benchmarks at the same time
        f.write(f"\n{heading}\n\n`{command}`\n\n{report}")
    print(f"appended to {path}")


def recipe_variant(name: str):
    """A recipe of `qjax.RECIPES` by name, or one of the benchmarks' variants of them (ablations, not public):
    int8_fwd / int8_fwd_dgrad (int8_rowwise with wgrad, or dgrad and wgrad, in bf16), any of these or a recipe +
    "_sr" (stochastic rounding of the gradient operand, `qjax.with_stochastic_gradients`: int8_rowwise_sr,
    int8_dataflow_sr as Jetfire rounds; an '_sr' that changes nothing raises ValueError), and any data-flow recipe
    or its "_sr" + "_recompute" (`Recipe.recompute_prologue_output`) or + "_recompute_w" (also
    `Recipe.recompute_weight_codes`)."""
    import dataclasses

    import qjax

    for suffix, weights in (("_recompute_w", True), ("_recompute", False)):
        if name.endswith(suffix):
            return dataclasses.replace(recipe_variant(name.removesuffix(suffix)), name=name,
                                       recompute_prologue_output=True, recompute_weight_codes=weights)
    if name.endswith("_sr"):
        base = recipe_variant(name.removesuffix("_sr"))
        sr = qjax.with_stochastic_gradients(base)
        if (sr.dgrad, sr.wgrad) == (base.dgrad, base.wgrad):
            raise ValueError(f"recipe {name!r}: {base.name}'s gradient GEMMs are bf16 or already stochastic, so '_sr' "
                             "would change nothing; drop it")
        return sr
    int8 = qjax.recipe("int8_rowwise")
    variants = {
        "int8_fwd": dataclasses.replace(int8, name="int8_fwd", dgrad=None, wgrad=None),
        "int8_fwd_dgrad": dataclasses.replace(int8, name="int8_fwd_dgrad", wgrad=None),
    }
    return variants.get(name) or qjax.recipe(name)

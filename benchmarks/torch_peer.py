"""PyTorch / torchao peer measurements, run in a subprocess by the JAX benchmarks (one JSON line on stdout).

  python benchmarks/torch_peer.py linear [--m 16384] [--shapes 4096x4096 4096x14336] [--variants ...]
  python benchmarks/torch_peer.py llama  [--dim 2048 --layers 22 --heads 32 --kv-heads 4 --ffn 5632 --vocab 32000]
                                         [--batch 8 --seq 2048] [--variants ...]
  python benchmarks/torch_peer.py linear --small --no-compile     # tiny shapes; runs on CPU in seconds

Variants (torchao 0.17, the release built for torch 2.11):
  bf16                  plain nn.Linear
  float8_tensorwise     torchao.float8.convert_to_float8_training, Float8LinearConfig.from_recipe_name("tensorwise")
  float8_rowwise        same, from_recipe_name("rowwise")
  int8_mixed_precision  torchao.quantize_(model, torchao.prototype.quantized_training.int8_mixed_precision_training())

linear: torch.compile'd forward + backward of nn.Linear(K, N, bias=False) on bf16 x (M, K), w ~ N(0, 1/K) and an
upstream gradient g (M, N) -> y, dx, dw; the shapes and data distribution of benchmarks/linear.py. Each variant is
checked against a float32 reference (SNR of y, dx, dw) before it is timed.
llama: Hugging Face LlamaForCausalLM (default: TinyLlama 1.1B shape) in bf16, torch.compile, fused AdamW, random
tokens; the LM head stays in bf16 in every variant. Reports tokens/s, step ms and peak GPU memory.

Progress goes to stderr; the last stdout line is the JSON result. Variants that cannot run (no torchao, float8
without an sm_89+ GPU, an exception) are listed under "skipped" with the reason. JAX scripts call `run_torch_peer`,
which imports no torch: torch runs only in the child process, so the two frameworks never share a process or its
GPU memory pool.
"""

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("bf16", "float8_tensorwise", "float8_rowwise", "int8_mixed_precision")
SMALL_LINEAR = dict(m=512, shapes=["256x256", "256x1024"])
SMALL_LLAMA = dict(dim=128, layers=2, heads=4, kv_heads=2, ffn=256, vocab=512, batch=2, seq=64)
ROUNDS = 3  # train-step throughput: median over this many rounds of --steps steps queued back to back
SNR_MIN_DB = 15.0  # far below what any 8-bit recipe gives on Gaussian data (~25-45 dB): catches broken paths only


def run_torch_peer(mode, *, python=None, timeout=1800, **kwargs) -> dict:
    """Runs this file in a subprocess (`mode` "linear" or "llama") and returns its JSON result as a dict.

    kwargs become command-line flags: m=16384 -> --m 16384, shapes=["4096x4096"] -> --shapes 4096x4096,
    small=True -> --small, compile=False -> --no-compile. `python` defaults to $QJAX_TORCH_PYTHON, else this
    interpreter. Never raises for a failed child: returns {"error": "..."} (with whatever the child reported).

    GPU memory: the caller must leave the child room. A JAX caller sets XLA_PYTHON_CLIENT_PREALLOCATE=false
    before importing jax (JAX otherwise takes 75% of the GPU at its first op), or calls this before JAX touches
    the GPU. The llama default shape needs ~35 GB in bf16.
    """
    python = python or os.environ.get("QJAX_TORCH_PYTHON") or sys.executable
    argv = [python, os.path.abspath(__file__), mode]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        elif value is not None:
            argv += [flag, str(value)]
    print("torch peer: " + " ".join(argv), file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"torch peer did not finish: {e}"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": f"torch peer exited {proc.returncode} without a JSON result (its stderr is above)"}
    result = json.loads(lines[-1])
    if proc.returncode and "error" not in result:
        result["error"] = f"torch peer exited {proc.returncode}"
    return result


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def _snr_db(ref, out):
    ref, out = ref.double(), out.double()
    err = (ref - out).norm().item()
    return float("inf") if err == 0 else 20 * math.log10(ref.norm().item() / err)


def _skip_reason(variant, torch, device):
    """Why `variant` cannot run here, or None."""
    if variant == "bf16":
        return None
    try:
        import torchao  # noqa: F401
    except ImportError as e:
        return f"torchao not importable ({e}); carry the torchao 0.17.0 wheel"
    if variant.startswith("float8") and (device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)):
        return "float8 training needs a CUDA GPU with compute capability >= 8.9 (torch._scaled_mm)"
    return None


def _convert(model, variant, skip_fqns=()):
    """Applies a torchao training variant to every nn.Linear of `model` except those named in skip_fqns.

    Returns the converted model: `model` changed in place, or a new module where `model` itself is an nn.Linear
    (torchao's float8 swap cannot replace a root module in place). Raises if a quantized variant converted no
    layer."""
    import torch

    def keep(module, fqn):
        return type(module) is torch.nn.Linear and fqn not in skip_fqns

    if variant.startswith("float8"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        recipe = variant.removeprefix("float8_")
        model = convert_to_float8_training(model, module_filter_fn=keep,
                                           config=Float8LinearConfig.from_recipe_name(recipe))
    elif variant == "int8_mixed_precision":
        from torchao import quantize_
        from torchao.prototype.quantized_training import int8_mixed_precision_training
        # module_swap=True: in torchao 0.17 the default tensor-subclass path registers F.linear as an aten op, so
        # it is never intercepted and the layer silently runs in bf16 (outputs bit-identical to nn.Linear).
        quantize_(model, int8_mixed_precision_training(module_swap=True), filter_fn=keep)
    elif variant != "bf16":
        raise ValueError(f"unknown variant {variant!r}; use one of {VARIANTS}")
    converted = sum(isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear for m in model.modules())
    if variant != "bf16" and converted == 0:
        raise RuntimeError(f"{variant}: torchao converted no nn.Linear")
    return model


def _sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lm_step(model, optimizer, tokens, losses: list, after=None):
    """One causal-LM training step of a Hugging Face model on `tokens` (labels = inputs) as a closure: forward,
    backward, optimizer step, gradients freed, then `after(model)` if given; appends the loss tensor (no sync)."""

    def step():
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after is not None:
            after(model)
        losses.append(loss.detach())

    return step


def _median_ms(step, torch, device, warmup, reps, inner=1):
    """Median ms of one step over `reps` samples, each `inner` steps dispatched back to back and one wait (as
    `benchmarks/common.time_ms`)."""
    for _ in range(warmup):
        step()
    _sync(torch, device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            step()
        _sync(torch, device)
        times.append((time.perf_counter() - start) * 1e3 / inner)
    return statistics.median(times)


def _free(torch, device):
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def bench_linear(args, torch, device):
    """{variant: {"KxN": {"ms", "snr_y", "snr_dx", "snr_dw"}}} for fwd+bwd of one linear layer."""
    results, skipped = {}, {}
    for shape in args.shapes:
        k, n = (int(d) for d in shape.split("x"))
        gen = torch.Generator(device=device).manual_seed(0)
        x0 = torch.randn(args.m, k, device=device, dtype=torch.bfloat16, generator=gen)
        w0 = (torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(torch.bfloat16)
        g = torch.randn(args.m, n, device=device, dtype=torch.bfloat16, generator=gen)
        refs = (x0.float() @ w0.float().T, g.float() @ w0.float(), g.float().T @ x0.float())
        y_bf16 = torch.nn.functional.linear(x0, w0)
        for variant in args.variants:
            if variant in skipped:
                continue
            reason = _skip_reason(variant, torch, device)
            if reason:
                skipped[variant] = reason
                _log(f"  {variant:22s} skipped: {reason}")
                continue
            try:
                layer = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
                with torch.no_grad():
                    layer.weight.copy_(w0)
                layer = _convert(layer, variant)
                model = torch.compile(layer) if args.compile else layer
                x = x0.clone().requires_grad_(True)

                def step():
                    x.grad = layer.weight.grad = None
                    y = model(x)
                    y.backward(g)
                    return y

                y = step()
                snrs = [_snr_db(ref, out.float()) for ref, out in zip(refs, (y, x.grad, layer.weight.grad))]
                if min(snrs) < SNR_MIN_DB:
                    raise RuntimeError(f"SNR vs float32 (y, dx, dw) = {snrs} dB < {SNR_MIN_DB}")
                if variant != "bf16" and torch.equal(y, y_bf16):
                    raise RuntimeError("output bit-identical to the bf16 layer: the quantized path did not run")
                ms = _median_ms(step, torch, device, args.warmup, args.reps, inner=args.inner)
                results.setdefault(variant, {})[shape] = dict(ms=ms, snr_y=snrs[0], snr_dx=snrs[1], snr_dw=snrs[2])
                _log(f"  {variant:22s} K={k:6d} N={n:6d} {ms:9.3f} ms  SNR y/dx/dw "
                     + "/".join(f"{s:.1f}" for s in snrs) + " dB")
            except Exception as e:  # one broken variant must not lose the others' numbers
                skipped[variant] = f"{type(e).__name__}: {e}"[:500]
                _log(f"  {variant:22s} failed: {skipped[variant]}")
            finally:
                layer = model = x = None
                _free(torch, device)
    return dict(m=args.m, results=results, skipped=skipped)


def bench_llama(args, torch, device):
    """{variant: {"tokens_per_s", "step_ms", "peak_mem_gb", "loss_first", "loss_last", "model_tflops"}}."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                         tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "sdpa"
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device,
                           generator=torch.Generator(device=device).manual_seed(0))
    results, skipped, n_params = {}, {}, None
    for variant in args.variants:
        reason = _skip_reason(variant, torch, device)
        if reason:
            skipped[variant] = reason
            _log(f"  {variant:22s} skipped: {reason}")
            continue
        try:
            torch.manual_seed(0)
            model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)
            n_params = sum(p.numel() for p in model.parameters())
            model = _convert(model, variant, skip_fqns=("lm_head",))
            compiled = torch.compile(model) if args.compile else model
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
            losses = []
            step = lm_step(compiled, optimizer, tokens, losses)
            # Throughput as a training loop sees it (steps queued back to back, one wait), and with a wait after
            # every step (adds the host's dispatch latency; what this benchmark reported before 2026-11-23).
            ms = _median_ms(step, torch, device, args.warmup, ROUNDS, inner=args.steps)
            synced_ms = _median_ms(step, torch, device, 0, args.steps)
            peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
            first, last = losses[0].item(), losses[-1].item()
            if not (first == first and last == last) or last > first + 1.0:  # NaN, or training diverged
                raise RuntimeError(f"loss went from {first} to {last}")
            tokens_per_s = args.batch * args.seq / ms * 1e3
            # Model FLOPs per token (PaLM, appendix B): 6 x non-embedding params + 12 x layers x dim x seq.
            flops_per_token = 6 * (n_params - args.vocab * args.dim) + 12 * args.layers * args.dim * args.seq
            results[variant] = dict(tokens_per_s=tokens_per_s, step_ms=ms, synced_step_ms=synced_ms, peak_mem_gb=peak,
                                    loss_first=first, loss_last=last,
                                    model_tflops=tokens_per_s * flops_per_token / 1e12)
            _log(f"  {variant:22s} {tokens_per_s:12,.0f} tok/s  {ms:9.2f} ms/step ({synced_ms:.2f} synced)  peak "
                 + (f"{peak:.1f} GB" if peak else "n/a") + f"  loss {first:.3f} -> {last:.3f}")
        except Exception as e:
            skipped[variant] = f"{type(e).__name__}: {e}"[:500]
            _log(f"  {variant:22s} failed: {skipped[variant]}")
        finally:
            model = compiled = optimizer = None
            _free(torch, device)
    shape = {k: getattr(args, k) for k in ("dim", "layers", "heads", "kv_heads", "ffn", "vocab", "batch", "seq")}
    return dict(shape=shape, params=n_params, results=results, skipped=skipped)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("linear", "llama"))
    parser.add_argument("--small", action=argparse.BooleanOptionalAction, default=False,
                        help="tiny shapes (CPU smoke test); overrides shape flags")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile (default on; --no-compile where no C++ compiler is present)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20, help="linear: timed samples")
    parser.add_argument("--inner", type=int, default=1, help="linear: steps queued back to back per sample")
    parser.add_argument("--steps", type=int, default=10, help="llama: timed training steps")
    parser.add_argument("--m", type=int, default=16384)
    parser.add_argument("--shapes", nargs="*", default=["4096x4096", "4096x14336", "14336x4096"], help="KxN")
    for name, default in dict(dim=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000, batch=8,
                              seq=2048).items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    args = parser.parse_args(argv)
    if args.small:
        for key, value in (SMALL_LINEAR if args.mode == "linear" else SMALL_LLAMA).items():
            setattr(args, key, value)
    return args


def main():
    args = parse_args()
    out = dict(mode=args.mode, compile=args.compile, variants=args.variants)
    try:
        import torch
    except ImportError as e:
        print(json.dumps(dict(out, error=f"torch not importable: {e}")), flush=True)
        sys.exit(2)
    try:
        import torchao
        out["torchao"] = torchao.__version__
    except ImportError:
        out["torchao"] = None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out.update(torch=torch.__version__, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    _log(f"torch peer {args.mode} on {out['device']}: torch {torch.__version__}, torchao {out['torchao']}, "
         f"compile={args.compile}")
    bench = bench_linear if args.mode == "linear" else bench_llama
    out.update(bench(args, torch, device))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

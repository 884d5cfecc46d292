"""Quantized AdamW on params sharded over a mesh of 8 CPU devices: runs, keeps the sharding, matches unsharded.

XLA_FLAGS must be set before jax initialises, so the check runs in a subprocess.
"""

import os
import subprocess
import sys
import textwrap

from helpers import cpu_devices_env

_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from qjax import optim
    assert len(jax.devices()) == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    params = {"w1": jax.random.normal(jax.random.key(0), (256, 512)) * 0.1,
              "w2": jax.random.normal(jax.random.key(1), (512, 128)) * 0.1, "b": jnp.zeros(512)}
    specs = {"w1": P("data", "model"), "w2": P("model", None), "b": P("model")}
    for name, tx in [("8bit", optim.adamw_8bit(1e-3)), ("4bit", optim.adamw_4bit(1e-3)), ("fp8", optim.adamw_fp8(1e-3)),
                     ("fp8_dre", optim.adamw_fp8(1e-3, dynamic_range_expansion=True))]:
        def run(p, g_scale):
            s = tx.init(p)
            for i in range(3):
                g = jax.tree.map(lambda x: x * (g_scale * (i + 1)), p)  # no transcendental: identical on any shard shape
                u, s = tx.update(g, s, p)
                p = optax.apply_updates(p, u)
            return p, s
        ref_p, ref_s = jax.jit(run)(params, 0.01)
        sharded = jax.tree.map(lambda x, sp: jax.device_put(x, NamedSharding(mesh, sp)), params, specs)
        got_p, got_s = jax.jit(run)(sharded, 0.01)
        assert len(got_p["w1"].sharding.device_set) == 8
        assert got_p["w1"].sharding.spec == P("data", "model"), got_p["w1"].sharding
        # XLA:CPU fuses the sharded program differently (last-bit float differences), so: floats agree to ~1 ulp,
        # and codes agree except where such a difference crosses a rounding boundary (then by one code).
        for a, b in zip(jax.tree.leaves((got_p, got_s)), jax.tree.leaves((ref_p, ref_s))):
            a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
            if a.dtype in (np.float32,):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
            else:
                assert np.mean(a.view(np.uint8) == b.view(np.uint8)) > 0.99
        print(name, "ok")
""")


def test_sharded_over_8_cpu_devices_matches_unsharded():
    env = cpu_devices_env(8)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == ["8bit", "ok", "4bit", "ok", "fp8", "ok", "fp8_dre", "ok"], out.stdout

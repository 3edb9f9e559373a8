import jax, jax.numpy as jnp, numpy as np
from kernels import flat_gemm as fg
ks = jax.random.split(jax.random.key(0), 8)
w = jax.random.normal(ks[4], (4, 4096, 14336), jnp.bfloat16) * 0.02
for m in (64, 128):
    x = jax.random.normal(ks[6], (m, 4096), jnp.bfloat16)
    r = jax.random.normal(ks[7], (m, 14336), jnp.bfloat16)
    ref = np.asarray(fg.flat_gemm_reference(x, w, 2, r), np.float64)
    for impl in ("mosaic", "triton"):
        o = np.asarray(fg.flat_gemm(x, w, jnp.int32(2), r, impl=impl), np.float64)
        print(m, impl, "ref norm", np.linalg.norm(ref), "out norm", np.linalg.norm(o), "max diff", np.abs(o - ref).max(),
              "equal frac", (o == ref).mean(), flush=True)

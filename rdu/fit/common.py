"""The fit shared by every model of rdu.fit: constants in free space, Adam with a prior, the loss and
per-row error summaries."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

EFFICIENCIES = frozenset(
    {
        "hbm_efficiency",
        "gemv_efficiency",
        "gemm_efficiency",
        "attention_efficiency",
        "flat_gemm_efficiency",
        "split_k_efficiency",
    }
)
PRIOR_WEIGHT = 0.01  # per (log or logit) unit squared, next to a squared log error per row


def _to_free(c: dict) -> dict:
    return {k: (jnp.log(v / (1 - v)) if k in EFFICIENCIES else jnp.log(v)) for k, v in c.items()}


def _from_free(z: dict) -> dict:
    return {k: (jax.nn.sigmoid(v) if k in EFFICIENCIES else jnp.exp(v)) for k, v in z.items()}


def fit_constants(
    loss_of_constants, start: dict, steps: int, lr: float, weak: frozenset = frozenset()
) -> tuple[dict, float]:
    """Adam on the free parameters; constants in `weak` (assumed, not measured) get a 10x weaker prior."""
    z0 = _to_free({k: jnp.asarray(v, jnp.float32) for k, v in start.items()})

    def loss(z):
        prior = sum((0.1 if k in weak else 1.0) * jnp.square(z[k] - z0[k]) for k in z)
        return loss_of_constants(_from_free(z)) + PRIOR_WEIGHT * prior

    opt = optax.adam(lr)
    value_and_grad = jax.jit(jax.value_and_grad(loss))

    @jax.jit
    def step(z, s):
        v, g = jax.value_and_grad(loss)(z)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction raises a float to an int32 count
            u, s = opt.update(g, s, z)
        return optax.apply_updates(z, u), s, v

    z, s = z0, opt.init(z0)
    for _ in range(steps):
        z, s, _ = step(z, s)
    v, _ = value_and_grad(z)
    return {k: float(x) for k, x in _from_free(z).items()}, float(v)


def msle(pred, target) -> jax.Array:
    return jnp.mean(jnp.square(jnp.log(jnp.stack(pred)) - jnp.log(jnp.asarray(target, jnp.float32))))


def err_pct(model: float, target: float) -> float:
    return 100.0 * (model - target) / target


def summarize(errs: list[float]) -> dict:
    a = [abs(e) for e in errs]
    return {"rows": len(a), "mape_pct": sum(a) / len(a) if a else 0.0, "max_abs_err_pct": max(a, default=0.0)}

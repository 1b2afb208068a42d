"""Server optimizers (FedOpt; Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2).

The server treats the cohort's aggregate as a step: with x the global parameters before the round and
x̄ the (masked, weighted) mean the algorithm aggregated, the pseudo-gradient is g = x - x̄ (= -Δ in the paper)
and an optax transformation turns it into an update u; the new global parameters are x + u.

    sgd      u = -η v,  v = β v + g                     (FedAvgM, Hsu et al. 2019; β = 0: plain server lr)
    adagrad  v = v + g²
    adam     v = β2 v + (1 - β2) g²
    yogi     v = v - (1 - β2) g² sign(v - g²)
             m = β1 m + (1 - β1) g,   u = -η m / (sqrt(v) + τ)     (the adaptive three; m_{-1} = 0, v_{-1} = τ²)

as the paper writes them: no bias correction, τ the adaptivity. The update is applied as
x̄ + (g + u), which equals x + u and makes plain SGD at η = 1 exactly (bitwise) the mean, i.e. today's
algorithm. Only parameters take the step; BatchNorm statistics stay the algorithm's own mean, and a leaf the
algorithm did not aggregate (personal) has g = 0.

Deviations: v_{-1} = τ² (the paper asks for v_{-1} >= τ²); server learning-rate defaults are [OUR CHOICE]:
1 for sgd, 0.1 for adagrad, 0.01 for adam and yogi (the paper tunes η per task on a grid).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from .types import Algorithm

SERVER_OPTIMIZERS = ("none", "sgd", "adagrad", "adam", "yogi")
DEFAULT_SERVER_LR = {"sgd": 1.0, "adagrad": 0.1, "adam": 0.01, "yogi": 0.01}
STATE_KEY = "server_opt"  # the optimizer's state beside the algorithm's own server state


class AdaptiveState(NamedTuple):
    m: optax.Updates  # first moment of the pseudo-gradient
    v: optax.Updates  # second-moment accumulator


def scale_by_fedopt(kind: str, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3
                    ) -> optax.GradientTransformation:
    """g -> m / (sqrt(v) + τ) with Reddi et al.'s moment updates for ``kind`` (adagrad | adam | yogi);
    every leaf keeps m and v of its own shape."""
    def init(params):
        return AdaptiveState(jax.tree_util.tree_map(jnp.zeros_like, params),
                             jax.tree_util.tree_map(lambda p: jnp.full_like(p, tau * tau), params))

    def second(v, g):
        g2 = g * g
        if kind == "adagrad":
            return v + g2
        if kind == "adam":
            return beta2 * v + (1 - beta2) * g2
        return v - (1 - beta2) * g2 * jnp.sign(v - g2)  # yogi

    def update(updates, state, params=None):
        m = jax.tree_util.tree_map(lambda m, g: beta1 * m + (1 - beta1) * g, state.m, updates)
        v = jax.tree_util.tree_map(second, state.v, updates)
        out = jax.tree_util.tree_map(lambda m, v: m / (jnp.sqrt(v) + tau), m, v)
        return out, AdaptiveState(m, v)

    return optax.GradientTransformation(init, update)


def server_optimizer(kind: str, lr: float | None = None, momentum: float = 0.0, beta1: float = 0.9,
                     beta2: float = 0.99, tau: float = 1e-3) -> optax.GradientTransformation:
    """The optax transformation of server optimizer ``kind`` (``SERVER_OPTIMIZERS`` but "none"); ``lr`` None
    takes ``DEFAULT_SERVER_LR``. It maps a pseudo-gradient g = x - x̄ to the update u (x + u is the step)."""
    lr = DEFAULT_SERVER_LR[kind] if lr is None else lr
    if kind == "sgd":
        return optax.sgd(lr, momentum=momentum or None)
    return optax.chain(scale_by_fedopt(kind, beta1, beta2, tau), optax.scale(-lr))


def server_step(tx: optax.GradientTransformation, params, mean, opt_state):
    """(new params, opt_state): one server step from ``params`` x to the aggregate ``mean`` x̄ (same pytree).
    new = x̄ + (g + u) with g = x - x̄ and u = tx's update of g: equal to x + u, and bitwise x̄ when u = -g."""
    g = jax.tree_util.tree_map(jnp.subtract, params, mean)
    u, opt_state = tx.update(g, opt_state, params)
    return jax.tree_util.tree_map(lambda xb, g, u: xb + (g + u), mean, g, u), opt_state


def with_server_optimizer(alg: Algorithm, tx: optax.GradientTransformation) -> Algorithm:
    """``alg`` whose aggregated parameters take a server-optimizer step (``server_step``).

    ``alg``'s server state must be a dict with ``"params"`` (the averaging algorithms'); the optimizer's state
    is kept beside them under ``STATE_KEY`` (so it is checkpointed with the server), and ``alg``'s own
    functions see the server state without it."""
    def inner(server):
        return {k: v for k, v in server.items() if k != STATE_KEY}

    def init(key, sample_x):
        server, client = alg.init(key, sample_x)
        return {**server, STATE_KEY: tx.init(server["params"])}, client

    def aggregate(server, trained, weights, info):
        new, kept = alg.aggregate(inner(server), trained, weights, info)
        params, opt_state = server_step(tx, server["params"], new["params"], server[STATE_KEY])
        return {**new, "params": params, STATE_KEY: opt_state}, kept

    def wrap(fn):  # fn(server, ...) of ``alg``, given the server state without the optimizer's
        return None if fn is None else (lambda server, *a, **k: fn(inner(server), *a, **k))

    return alg._replace(init=init, local_update=wrap(alg.local_update), aggregate=aggregate,
                        predict=wrap(alg.predict), predict_trained=wrap(alg.predict_trained),
                        prepare_predict=wrap(alg.prepare_predict), share_mask=wrap(alg.share_mask),
                        round_metrics=None if (own := alg.round_metrics) is None else (
                            lambda before, after: own(inner(before), inner(after))))

"""Robust aggregation as a composition: ``with_robust_aggregate(alg, name, **params)`` replaces the mean of an
averaging algorithm's shared parameters by a Byzantine-robust rule of ``jaxfl.ops.robust`` (``--aggregator``).

With x the global parameters before the round and Δ_i = x_i - x the update of cohort row i (rows of weight 0 are
absent: padding, a Poisson cohort's empty rows), the new global parameters of every shared leaf are

    x' = x + R({Δ_i : i present})

where R is the rule (``RULES``) over the updates flattened into one vector per row (all shared leaves together,
so distance-based rules see whole updates):

    median            coordinate-wise median (Yin et al., ICML 2018)
    trimmed_mean      coordinate-wise mean without the floor(beta k) largest and smallest values (beta in [0, 1/2))
    krum              the update of smallest Krum score, f Byzantine rows assumed (Blanchard et al., NeurIPS 2017)
    multi_krum        the mean of the m updates of smallest Krum score (m default k - f)
    bulyan            k - 2f updates chosen by repeated Krum, then per coordinate the mean of the k - 4f values
                      closest to their median (El Mhamdi et al., ICML 2018)
    geometric_median  smoothed Weiszfeld iterations, weighted by the aggregation weights (Pillutla et al., RFA)
    norm_bound        the weighted mean of Δ_i min(1, bound / ||Δ_i||) (Sun et al., 2019)
    centered_clip     v <- v + mean_i clip(Δ_i - v, tau), ``iters`` times from v = 0 (Karimireddy et al., 2021)

Leaves the algorithm does not share (its ``share_mask``: personal heads, BatchNorm layers kept local), the
server's other state and what clients keep are the algorithm's own. median, trimmed_mean, krum and multi_krum
weigh the present rows equally (they order values, not weights); geometric_median and norm_bound use the
aggregation weights (``--weighting``). The rules are translation-equivariant except norm_bound and
centered_clip, which is why they act on updates, not on models.

Deviations: centered clipping starts from v = 0 each round (the paper's momentum variant starts from the
previous round's aggregate).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from . import robust
from .spec import parse_spec
from ..core.privacy import all_shared
from ..core.types import Algorithm

# each rule's parameters and their defaults (``--aggregator NAME:key=value,...``)
RULES = {
    "median": {},
    "trimmed_mean": {"beta": 0.1},
    "krum": {"f": 1},
    "multi_krum": {"f": 1, "m": 0},
    "bulyan": {"f": 1},
    "geometric_median": {"iters": 8},
    "norm_bound": {"bound": 1.0},
    "centered_clip": {"tau": 1.0, "iters": 1},
}
AGGREGATORS = ("mean",) + tuple(RULES)
# parameter -> (type, check, what is allowed)
_CHECKS = {"beta": (float, lambda v: 0 <= v < 0.5, "a number in [0, 0.5)"),
           "f": (int, lambda v: v >= 0, "an integer >= 0"),
           "m": (int, lambda v: v >= 0, "an integer >= 1, or 0 for k - f"),
           "iters": (int, lambda v: v >= 1, "an integer >= 1"),
           "bound": (float, lambda v: 0 < v < float("inf"), "a number > 0"),
           "tau": (float, lambda v: 0 < v < float("inf"), "a number > 0")}


def parse_aggregator(spec: str) -> tuple[str, dict]:
    """``"NAME"`` or ``"NAME:key=value,key=value"`` -> (name, its parameters with the defaults filled in);
    ConfigError naming the bad name, key or value and what is allowed (``spec.parse_spec``)."""
    return parse_spec(spec, "aggregator", {"mean": {}, **RULES}, _CHECKS)


def robust_rule(name: str, **params) -> Callable:
    """The rule ``name`` (``RULES``) as rule(x [N, D], present [N] bool, weights [N]) -> [D]."""
    if name == "median":
        return lambda x, present, w: robust.coordinate_median(x, present)
    if name == "trimmed_mean":
        return lambda x, present, w: robust.trimmed_mean(x, present, params["beta"])
    if name in ("krum", "multi_krum"):
        f = params["f"]

        def krum(x, present, w):
            m = 1 if name == "krum" else (params["m"] or jnp.maximum(jnp.sum(present) - f, 1))
            return robust.multi_krum(x, present, f, m)[0]
        return krum
    if name == "bulyan":
        return lambda x, present, w: robust.bulyan(x, present, params["f"])[0]
    if name == "geometric_median":
        return lambda x, present, w: robust.geometric_median(x, present, w, iters=params["iters"])
    if name == "norm_bound":
        return lambda x, present, w: robust.norm_bounded_mean(x, present, params["bound"], w)
    if name == "centered_clip":
        return lambda x, present, w: robust.centered_clip(x, present, params["tau"], params["iters"])
    raise ValueError(f"no robust rule {name!r}; the rules: {', '.join(RULES)}")


def robust_params(rule: Callable, server_params, trained_params, mean_params, shared, weights):
    """The new global parameters: x + R(Δ) on the shared leaves, ``mean_params`` (the algorithm's own
    aggregate) on the others. server_params and mean_params: leaves [...]; trained_params: leaves [k, ...];
    shared: a tree of bools over server_params (Python or traced scalars: a leaf marked Python False takes no
    part in R, a traced False contributes a zero update and keeps its mean); weights [k] (0: absent row)."""
    x, treedef = jax.tree_util.tree_flatten(server_params)
    marks, rows = jax.tree_util.tree_leaves(shared), jax.tree_util.tree_leaves(trained_params)
    out = jax.tree_util.tree_leaves(mean_params)
    used = [i for i, s in enumerate(marks) if s is not False]
    if not used:
        return mean_params
    scale = lambda i: 1 if marks[i] is True else jnp.asarray(marks[i], rows[i].dtype)  # noqa: E731
    deltas = [(rows[i] - x[i][None]) * scale(i) for i in used]
    step = robust.tree_robust(lambda d, present: rule(d, present, weights), deltas, weights > 0)
    for i, r in zip(used, step):
        out[i] = x[i] + r if marks[i] is True else jnp.where(marks[i], x[i] + r, out[i])
    return jax.tree_util.tree_unflatten(treedef, out)


def with_robust_aggregate(alg: Algorithm, name: str, **params) -> Algorithm:
    """``alg`` whose aggregate of the shared parameters is the robust rule ``name`` over the cohort's updates
    (the module docstring). ``alg`` must be an averaging algorithm in the sense of ``Options.user_dp``: its
    server state holds ``"params"``, its aggregate averages a fixed set of the trained rows' ``"params"``
    leaves (``share_mask``; all without one) and nothing else the clients computed from their data."""
    if name == "mean":
        return alg
    rule = robust_rule(name, **{**RULES[name], **params})

    def aggregate(server, trained, weights, info):
        new, kept = alg.aggregate(server, trained, weights, info)
        shared = alg.share_mask(server, info) if alg.share_mask is not None else all_shared(server["params"])
        return {**new, "params": robust_params(rule, server["params"], trained["params"], new["params"], shared,
                                               weights)}, kept

    return alg._replace(aggregate=aggregate)

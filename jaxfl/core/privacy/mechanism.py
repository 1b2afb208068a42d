"""DP-FedAvg's mechanism (the package docstring gives the formulas): each update's clipping to l2 norm C, the
server's Gaussian noise, adaptive clipping's noised count and clip update, the fixed-denominator estimate of a
Poisson cohort, and ``with_privacy``, which wraps an averaging algorithm with them."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..types import Algorithm


def all_shared(params):
    """The share mask of an aggregate that averages every parameter leaf."""
    return jax.tree_util.tree_map(lambda _: True, params)


def update_norm(server_params, trained_params, shared=None):
    """||x_i - x||_2 over the parameter leaves ``shared`` marks (a tree of Python bools or bool scalars over
    ``server_params``; None: every leaf). One client: leaves [...] -> float32 []."""
    shared = shared if shared is not None else all_shared(server_params)
    total = jnp.zeros((), jnp.float32)
    for s, x, xi in zip(jax.tree_util.tree_leaves(shared), jax.tree_util.tree_leaves(server_params),
                        jax.tree_util.tree_leaves(trained_params)):
        if s is False:
            continue
        sq = jnp.sum(jnp.square((xi - x).astype(jnp.float32)))
        total = total + (sq if s is True else jnp.where(s, sq, 0.0))
    return jnp.sqrt(total)


def clip_factor(norm, clip: float):
    """min(1, C / norm) (1 at norm 0). norm: [...] -> [...]."""
    return jnp.where(norm > clip, clip / jnp.where(norm > 0, norm, 1.0), 1.0)


def clip_updates(server_params, trained_params, scale):
    """x + c_i (x_i - x) for every client i, and x_i itself (bit for bit) where c_i = 1.
    server_params: leaves [...]; trained_params: leaves [k, ...]; scale c: [k] -> leaves [k, ...]."""
    def one(x, xi):
        c = scale.astype(xi.dtype).reshape((-1,) + (1,) * x.ndim)
        return jnp.where(c < 1, x[None] + c * (xi - x[None]), xi)
    return jax.tree_util.tree_map(one, server_params, trained_params)


def add_noise(key, params, shared, std):
    """params + N(0, std²) on every leaf ``shared`` marks (a leaf marked by a traced bool gets it where True);
    one key per leaf, ``fold_in(key, leaf index)``. params: leaves [...]; std: [] -> leaves [...]."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    out = []
    for i, (s, x) in enumerate(zip(jax.tree_util.tree_leaves(shared), leaves)):
        if s is False:
            out.append(x)
            continue
        noise = (std * jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32)).astype(x.dtype)
        out.append(x + (noise if s is True else jnp.where(s, noise, 0)))
    return jax.tree_util.tree_unflatten(treedef, out)


DP_LEVELS = ("user", "sample")  # DP-FedAvg here; DP-SGD in local training (``jaxfl.core.dpsgd``)
DEFAULT_CLIP_LR = 0.2  # adaptive clipping's learning rate (Andrew et al.'s and TFF's)
CLIP_KEY = "dp_clip"  # adaptive clipping: the current clipping norm, beside the algorithm's server state
COUNT_STREAM = 2 ** 32 - 1  # fold_in(key, COUNT_STREAM): the clipped count's noise (a round index never reaches it)


def value_noise_multiplier(noise_multiplier: float, count_std: float) -> float:
    """The update's noise multiplier σ_Δ under adaptive clipping, such that the update and the noised count of
    unclipped clients (std σ_b) together are the Gaussian mechanism of multiplier z that fixed clipping would be
    (Andrew et al. 2021, Thm. 1; TFF's ``adaptive_clip_noise_params``): σ_Δ = (z^-2 - (2 σ_b)^-2)^-1/2.
    Needs z < 2 σ_b; z = 0 gives 0."""
    if noise_multiplier == 0:
        return 0.0
    if not noise_multiplier < 2 * count_std:
        raise ValueError(f"adaptive clipping at noise multiplier {noise_multiplier} needs a count noise std above "
                         f"{noise_multiplier / 2}, got {count_std}")
    return (noise_multiplier ** -2 - (2 * count_std) ** -2) ** -0.5


def update_clip(clip, unclipped_fraction, target: float, lr: float):
    """The geometric clip update of adaptive clipping (Andrew et al. 2021, Alg. 1):
    C' = C · exp(-η (b̄ - γ)), b̄ the (noised) fraction of the cohort's updates no longer than C, γ the target
    quantile; C shrinks while more than γ of the updates fit. Scalars -> scalar."""
    return clip * jnp.exp(-lr * (unclipped_fraction - target))


def fixed_denominator(server_params, mean_params, shared, members, expected):
    """x + (x̄ - x) · k / (qN) on the leaves ``shared`` marks (the others: x̄): the cohort's mean x̄ of its k
    members turned into McMahan et al.'s fixed-denominator estimate x + Σ_i Δ̃_i / (qN), qN = ``expected``, the
    expected cohort size of Poisson sampling. Leaves [...]; members, expected: [] -> leaves [...]."""
    scale = members / expected

    def one(s, x, m):
        moved = x + (m - x) * scale.astype(m.dtype)
        return m if s is False else (moved if s is True else jnp.where(s, moved, m))
    return jax.tree_util.tree_map(one, shared, server_params, mean_params)


def with_privacy(alg: Algorithm, clip: float, noise_multiplier: float, key, *, quantile: float | None = None,
                 clip_lr: float = DEFAULT_CLIP_LR, count_std: float = 0.0,
                 expected_clients: float | None = None) -> Algorithm:
    """``alg`` as DP-FedAvg: each client's update of the shared parameters clipped to norm C (``clip``), Gaussian
    noise of std z · C / k on the aggregate's shared parameters (z = ``noise_multiplier``; k: the cohort's
    clients of positive weight; the engine must weigh them equally).

    ``quantile`` γ: adaptive clipping (Andrew et al., "Differentially Private Learning with Adaptive Clipping",
    NeurIPS 2021): C starts at ``clip`` and follows ``update_clip`` with ``clip_lr`` η and the fraction of
    unclipped updates counted with Gaussian noise of std ``count_std`` σ_b; the update's noise multiplier
    becomes ``value_noise_multiplier(z, σ_b)``, so the round's privacy is fixed clipping's at z. C is kept in the
    server state (``CLIP_KEY``; checkpointed), and each round's metrics (``round_metrics``) give ``dp_clip``, the
    C the round clipped to.

    ``alg``'s server state must hold the global model's ``"params"``, its ``aggregate`` average the trained rows'
    ``"params"`` (those ``alg.share_mask`` marks, all if it has none) and keep per client only what the clients
    trained. Round t's noise comes from fold_in(key, t) (the count's from fold_in(fold_in(key, COUNT_STREAM), t)).
    A client's metrics gain ``update_norm`` (before clipping); its trained row is ``alg``'s own (so
    ``predict_trained`` sees what it expects).

    ``expected_clients`` qN: the cohort is Poisson-sampled (``cohort.poisson_members``, q the sampling rate),
    and the mean becomes McMahan et al.'s fixed-denominator estimate x + Σ_i Δ̃_i / (qN) with noise of std
    z C / (qN) (add/remove neighbours, sensitivity C / (qN): ``rdp_poisson_gaussian`` accounts for it); an empty
    cohort leaves the model as it was, plus the noise. Adaptive clipping then counts the centred indicators
    Σ_i (b_i - 1/2) + N(0, σ_b²) (sensitivity 1/2) and estimates b̄ = that / (qN) + 1/2 (Andrew et al., Alg. 1)."""
    adaptive = quantile is not None
    noise = value_noise_multiplier(noise_multiplier, count_std) if adaptive else noise_multiplier

    def inner(server):  # what ``alg``'s own functions see: their server state without the clip
        return {k: v for k, v in server.items() if k != CLIP_KEY} if adaptive else server

    def current_clip(server):
        return server[CLIP_KEY] if adaptive else clip

    def mask(server, info):
        return alg.share_mask(server, info) if alg.share_mask is not None else all_shared(server["params"])

    def init(rng, sample_x):
        server, client = alg.init(rng, sample_x)
        return ({**server, CLIP_KEY: jnp.asarray(clip, jnp.float32)} if adaptive else server), client

    def local_update(server, client, data, rng, info):
        s = inner(server)
        trained, metrics = alg.local_update(s, client, data, rng, info)
        return trained, dict(metrics, update_norm=update_norm(s["params"], trained["params"], mask(s, info)))

    def aggregate(server, trained, weights, info):
        s, c = inner(server), current_clip(server)
        shared = mask(s, info)
        norms = jax.vmap(lambda row: update_norm(s["params"], row, shared))(trained["params"])
        clipped = {**trained, "params": clip_updates(s["params"], trained["params"], clip_factor(norms, c))}
        new, _ = alg.aggregate(s, clipped, weights, info)  # the server's model from the clipped updates
        _, kept = alg.aggregate(s, trained, weights, info)  # what clients keep: their own training (XLA
        # drops the unused halves of the two calls)
        real = weights > 0
        members = jnp.sum(real).astype(jnp.float32)
        if expected_clients is None:  # a fixed-size cohort: the mean over its k members
            k = jnp.maximum(members, 1.0)
        else:  # Poisson sampling: the fixed denominator qN (an empty cohort's mean is the model as it was)
            k = jnp.float32(expected_clients)
            new = jax.tree_util.tree_map(lambda a, b: jnp.where(members > 0, a, b), new, s)
            new = {**new, "params": fixed_denominator(s["params"], new["params"], shared, members, k)}
        if noise > 0:
            noisy = add_noise(jax.random.fold_in(key, info.round), new["params"], shared, noise * c / k)
            new = {**new, "params": noisy}
        if adaptive:
            fits = jnp.sum(real & (norms <= c)).astype(jnp.float32)
            if expected_clients is not None:
                fits = fits - members / 2  # centred: Σ (b_i - 1/2), sensitivity 1/2 under add/remove
            if count_std > 0:
                count_key = jax.random.fold_in(jax.random.fold_in(key, COUNT_STREAM), info.round)
                fits = fits + count_std * jax.random.normal(count_key, ())
            fraction = fits / k if expected_clients is None else fits / k + 0.5
            new = {**new, CLIP_KEY: update_clip(c, fraction, quantile, clip_lr).astype(jnp.float32)}
        return new, kept

    def round_metrics(before, after):  # the clip this round used (adaptive), and what ``alg`` reports
        own = {} if alg.round_metrics is None else alg.round_metrics(inner(before), inner(after))
        return dict(own, dp_clip=before[CLIP_KEY]) if adaptive else own

    def wrap(fn):  # fn(server, ...) of ``alg``, given the server state without the clip
        return None if fn is None else (lambda server, *a, **kw: fn(inner(server), *a, **kw))

    return alg._replace(init=init, local_update=local_update, aggregate=aggregate, predict=wrap(alg.predict),
                        predict_trained=wrap(alg.predict_trained), prepare_predict=wrap(alg.prepare_predict),
                        share_mask=wrap(alg.share_mask), round_metrics=round_metrics,
                        aggregates_empty=expected_clients is not None)  # an empty round is noised too

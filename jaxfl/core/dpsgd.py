"""Sample-level differential privacy inside local training: DP-SGD (Abadi et al., "Deep Learning with
Differential Privacy", CCS 2016) in every client's minibatch loop, as Opacus runs it in PFLlib's clients.

A client with n samples takes s = ceil(n / B) steps an epoch, as without DP (``LocalTrainer``). Each step
draws its batch by Poisson sampling, every real sample on its own with rate q = 1 / s (Opacus's
``DPDataLoader``: 1 / len(loader); expected batch qn <= B), clips each sample's gradient to l2 norm C over all
parameter leaves, sums, adds Gaussian noise and divides by the expected batch size:

    g = (1 / (q n)) · ( Σ_{j in batch} g_j · min(1, C / ||g_j||) + N(0, (z C)² I) ),

then the client optimizer takes g as its gradient. One step is the Poisson-sampled Gaussian mechanism of
rate q and noise multiplier z (add/remove one sample, sensitivity C); ``SampleAccountant`` composes them.

The batch is a fixed number of lanes L (= B) per computation: the members of a step are gathered in position
order and their per-sample gradients computed L at a time, in as many chunks as the draw needs (a
``while_loop``; more than B members happen, and none is dropped, so the sampling is exactly Poisson).
Whether position j joins a step depends on ``fold_in(step key, j)`` alone, so padding changes nothing.

Deviations:
- The number of steps and the rate follow the client's sample count, which is treated as public (as Opacus
  and TF Privacy do: their rate is B / n or 1 / len(loader)); strictly, add/remove changes n.
- Models with BatchNorm are refused (their statistics mix the samples of a batch).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .cohort import position_uniforms
from .metrics import correct_count
from .privacy import add_noise, all_shared, clip_factor

SELECT_STREAM, NOISE_STREAM, SAMPLE_STREAM = 1, 2, 3  # fold_in(step key, ·): the draw, the noise, per-sample keys


@dataclasses.dataclass(frozen=True)
class SampleDP:
    """DP-SGD's two numbers: the per-sample clipping norm C and the noise multiplier z (std z C on the sum)."""
    clip: float
    noise_multiplier: float


def poisson_rate(count, batch_size: int):
    """q = 1 / ceil(n / B): each of a step's n samples joins with this rate (1 for n <= B). count: int [...]
    -> float32 [...]."""
    steps = jnp.maximum((count + batch_size - 1) // batch_size, 1)
    return 1.0 / steps.astype(jnp.float32)


def poisson_members(key, count, m: int, rate):
    """Position j < count joins the step if uniform(fold_in(key, j)) < rate: bool [m] (padding never joins;
    a position's draw does not depend on m)."""
    return (jnp.arange(m) < count) & (position_uniforms(key, m) < rate)


def per_sample_norms(grads):
    """||g_j||_2 over every leaf: leaves [L, ...] -> float32 [L] (differentiable at 0: gradient 0 there)."""
    sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32)).reshape(g.shape[0], -1), axis=1)
             for g in jax.tree_util.tree_leaves(grads))
    return jnp.where(sq > 0, jnp.sqrt(jnp.where(sq > 0, sq, 1.0)), 0.0)


def clipped_sum(grads, w, clip: float):
    """Σ_j w_j g_j min(1, C / ||g_j||) (w_j in {0, 1}: 0 drops lane j). grads: leaves [L, ...]; w: [L]
    -> (leaves [...], norms [L])."""
    norms = per_sample_norms(grads)
    scale = w * clip_factor(norms, clip)
    return jax.tree_util.tree_map(lambda g: jnp.tensordot(scale.astype(g.dtype), g, axes=1), grads), norms


def private_gradient(loss_fn, params, state, batch_of, preprocess, members, count, key, dp: SampleDP,
                     lanes: int, rate):
    """One DP-SGD step's gradient (module docstring) and its metric sums.

    loss_fn(params, state, x, y, w, key) -> (loss, (state, logits)), a weighted mean over the batch; each
    sample's gradient is that of its own loss (w = [1]). batch_of(idx) -> (x, y) of positions idx [L].
    members: bool [m], the step's draw; count: the client's real samples n; rate: q.
    Returns (gradient tree like params, float32 [4]: Σ loss, correct, members, 1).
    """
    m = members.shape[0]
    slots = -(-m // lanes) * lanes
    order = jnp.nonzero(members, size=slots, fill_value=0)[0]  # the members first, in position order
    total = jnp.sum(members)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def one(x, y, k):
        (loss, (_, logits)), g = grad_fn(params, state, x[None], y[None], jnp.ones(1, jnp.float32), k)
        return loss, logits[0], g

    def chunk(carry):
        c, acc, sums = carry
        pos = c * lanes + jnp.arange(lanes)
        idx = jax.lax.dynamic_slice(order, (c * lanes,), (lanes,))
        w = (pos < total).astype(jnp.float32)
        x, y = batch_of(idx)
        keys = jax.vmap(lambda p: jax.random.fold_in(jax.random.fold_in(key, SAMPLE_STREAM), p))(idx)
        loss, logits, g = jax.vmap(one)(preprocess(x), y, keys)
        part, _ = clipped_sum(g, w, dp.clip)
        acc = jax.tree_util.tree_map(jnp.add, acc, part)
        sums = sums + jnp.stack([jnp.sum(loss * w), correct_count(logits, y, w), jnp.sum(w), 0.0]).astype(sums.dtype)
        return c + 1, acc, sums

    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    _, acc, sums = jax.lax.while_loop(lambda cr: cr[0] * lanes < total, chunk,
                                      (jnp.zeros((), jnp.int32), zeros, jnp.zeros(4, jnp.float32)))
    noisy = add_noise(jax.random.fold_in(key, NOISE_STREAM), acc, all_shared(acc), dp.noise_multiplier * dp.clip)
    denominator = rate * count.astype(jnp.float32)
    return jax.tree_util.tree_map(lambda g: g / denominator.astype(g.dtype), noisy), sums.at[3].set(1.0)

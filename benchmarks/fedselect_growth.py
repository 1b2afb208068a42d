"""Cost of FedSelect's mask growth against one local training pass of the same clients.

For each model it times, after compilation, (a) the growth of every client's masks at once, jit(vmap) of
``blocks.tree_grow_mask`` (its cut per tensor from a 32-step bisection, ``kth_smallest_nonneg``), (b) the same
growth with the cut from a full sort per tensor (``grow_by_sort``, the formula as written), and (c) one epoch
of plain SGD of every client on its 100 images (jit(vmap) of a scan over batches of 32), the work FedSelect's
LocalAlt does twice per alternation. Prints seconds and the ratio growth / epoch.

    python benchmarks/fedselect_growth.py --models fedavg_cnn,resnet18_imagenet --clients 10
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

from jaxfl.ops.masks import tree_grow_mask
from jaxfl.models import build_model


def grow_by_sort(mask, delta, rate, limit):
    """grow_mask's rule with cut = sort(where(personal, -inf, |delta|))[n_p + round((1 - rate) n_g)]."""
    m, d = jnp.ravel(mask), jnp.abs(jnp.ravel(delta))
    n_p = jnp.sum(m)
    n_g = m.size - n_p
    idx = jnp.round((1.0 - rate) * n_g).astype(jnp.int32)
    cut = jnp.sort(jnp.where(m, -jnp.inf, d))[jnp.clip(n_p + idx, 0, m.size - 1)]
    grow = (limit > 0) & (n_p <= limit * m.size) & (n_g > 0) & (idx < n_g)
    return (m | (grow & ~m & (d >= cut))).reshape(mask.shape)


def timed(fn, *args, reps=3):
    jax.block_until_ready(fn(*args))  # compile
    t = time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t) / reps


def measure(name: str, clients: int, samples: int = 100, batch: int = 32) -> dict:
    model = build_model(name, 10)
    x = jax.random.normal(jax.random.key(0), (clients, samples, 32, 32, 3))
    y = jax.random.randint(jax.random.key(1), (clients, samples), 0, 10)
    v = model.init(jax.random.key(2), x[0, :1])
    stack = lambda t: jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (clients,) + a.shape), t)  # noqa: E731
    reference = stack(v["params"])
    leaves, treedef = jax.tree_util.tree_flatten(reference)
    params = jax.tree_util.tree_unflatten(treedef, [  # distinct per-client updates W - W_ref
        a + 0.01 * jax.random.normal(jax.random.fold_in(jax.random.key(3), i), a.shape) for i, a in enumerate(leaves)])
    masks = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, bool), params)
    grow = jax.jit(jax.vmap(lambda m, p, r: tree_grow_mask(m, p, r, 0.25, 0.8)))
    sort = jax.jit(jax.vmap(lambda m, p, r: jax.tree_util.tree_map(
        lambda mi, pi, ri: grow_by_sort(mi, pi - ri, 0.25, 0.8), m, p, r)))
    tx = optax.sgd(0.05)

    def epoch(p, stats, xc, yc):
        def step(carry, i):
            p, s, o = carry
            xb, yb = (jax.lax.dynamic_slice_in_dim(xc, i * batch, batch),
                      jax.lax.dynamic_slice_in_dim(yc, i * batch, batch))

            def loss(p):
                logits, upd = model.apply({"params": p, "batch_stats": s}, xb, True, mutable=["batch_stats"])
                return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean(), upd["batch_stats"]
            (_, s), g = jax.value_and_grad(loss, has_aux=True)(p)
            u, o = tx.update(g, o, p)
            return (optax.apply_updates(p, u), s, o), None
        (p, _, _), _ = jax.lax.scan(step, (p, stats, tx.init(p)), jnp.arange(samples // batch))
        return p
    train = jax.jit(jax.vmap(epoch))
    stats = stack(v.get("batch_stats", {}))
    same = jax.tree_util.tree_all(jax.tree_util.tree_map(
        lambda a, b: bool(jnp.array_equal(a, b)), grow(masks, params, reference), sort(masks, params, reference)))
    assert same, "bisection and sort growth differ"
    t_grow, t_sort = timed(grow, masks, params, reference), timed(sort, masks, params, reference)
    t_epoch = timed(train, params, stats, x, y)
    entries = sum(a.size for a in jax.tree_util.tree_leaves(params))
    return dict(model=name, clients=clients, entries=entries, grow_s=t_grow, sort_s=t_sort, epoch_s=t_epoch)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="fedavg_cnn,resnet18_imagenet")
    p.add_argument("--clients", type=int, default=10)
    args = p.parse_args(argv)
    from jaxfl.models import MODELS
    from jaxfl.run.script import check_at_least, parse_list
    parse_list(args.models, "--models", choices=tuple(MODELS))
    check_at_least("--clients", args.clients, 1)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print("| model | clients | parameter entries (all clients) | growth s (bisection) | growth s (sort) | "
          "one epoch s | growth / epoch |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        r = measure(name, args.clients)
        print(f"| {r['model']} | {r['clients']} | {r['entries']:,} | {r['grow_s']:.3f} | {r['sort_s']:.3f} | "
              f"{r['epoch_s']:.3f} | {r['grow_s'] / r['epoch_s']:.2f} |", flush=True)


if __name__ == "__main__":
    from jaxfl.run.script import run_script
    raise SystemExit(run_script(main))

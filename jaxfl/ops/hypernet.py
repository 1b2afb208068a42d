"""Server-side hypernetwork (FedTP / pFedHN) as an (init, apply) pair of pure functions, and its update
as a vector-Jacobian product of the clients' weight changes.

    h(phi; z) = { name: reshape(head_name(trunk(z)), shape) },
    trunk(z)  = L_n(relu(... relu(L_1(z)))),  L(x) = x W + b   (no ReLU after the last trunk layer)

Weights follow PyTorch's Linear default U(+-1/sqrt(fan_in)); the client embedding table is N(0, 1).
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from ..errors import ConfigError


class Hypernet(NamedTuple):
    """init(key) -> params; apply(params, embedding [E]) -> {name: array of out_shapes[name]}."""
    init: Callable
    apply: Callable


def _linear_init(key, fan_in, fan_out):
    bound = 1.0 / math.sqrt(fan_in)
    kw, kb = jax.random.split(key)
    return {"kernel": jax.random.uniform(kw, (fan_in, fan_out), minval=-bound, maxval=bound),
            "bias": jax.random.uniform(kb, (fan_out,), minval=-bound, maxval=bound)}


def hypernetwork(out_shapes: Mapping[str, Sequence[int]], embed_dim: int, hidden: int = 150,
                 n_hidden: int = 3) -> Hypernet:
    """MLP from a client embedding [embed_dim] to one weight tensor per entry of ``out_shapes``.

    Trunk: Linear(E -> hidden) then n_hidden x [ReLU, Linear(hidden -> hidden)]; one linear head per
    output (hidden -> prod(shape)), reshaped. FedTP: hidden 150, n_hidden 3, one head per block.
    Parameter count: E*H + H + n_hidden*(H^2 + H) + sum_name (H + 1) * prod(shape).
    """
    names = sorted(out_shapes)
    shapes = {n: tuple(int(d) for d in out_shapes[n]) for n in names}

    def init(key):
        keys = jax.random.split(key, n_hidden + 1 + len(names))
        dims = [embed_dim] + [hidden] * (n_hidden + 1)
        trunk = [_linear_init(keys[i], dims[i], dims[i + 1]) for i in range(n_hidden + 1)]
        heads = {n: _linear_init(keys[n_hidden + 1 + j], hidden, math.prod(shapes[n])) for j, n in enumerate(names)}
        return {"trunk": trunk, "heads": heads}

    def apply(params, embedding):
        h = embedding
        for i, layer in enumerate(params["trunk"]):
            h = h @ layer["kernel"] + layer["bias"]
            if i < len(params["trunk"]) - 1:
                h = jax.nn.relu(h)
        return {n: (h @ params["heads"][n]["kernel"] + params["heads"][n]["bias"]).reshape(shapes[n])
                for n in names}

    return Hypernet(init, apply)


def require_table_size(method: str, num_clients) -> None:
    """Raise ``ConfigError`` unless ``num_clients`` (the client-embedding table's size N) is a positive int: client
    ids index the table, and under jit an id past a smaller table would silently read its last row."""
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ConfigError(f"{method} needs num_clients, the size of its client-embedding table (the run's client "
                          f"count, a positive integer), got {num_clients!r}")


def init_embeddings(key, num_clients: int, embed_dim: int):
    """Client embedding table Z [N, E] ~ N(0, 1) (torch.nn.Embedding's default)."""
    return jax.random.normal(key, (num_clients, embed_dim))


def generate(apply: Callable, params, embeddings, client_ids):
    """W_i = h(phi; Z[i]) for each id: pytree with a leading axis [S] (vmapped apply)."""
    return jax.vmap(apply, (None, 0))(params, embeddings[client_ids])


def _client_weighted(weights, tree):
    p = weights / jnp.sum(weights)
    return jax.tree_util.tree_map(lambda d: p.reshape((-1,) + (1,) * (d.ndim - 1)).astype(d.dtype) * d, tree)


def hypernet_grads(apply: Callable, params, embeddings, client_ids, sent, trained, weights):
    """Pseudo-gradient of the hypernetwork and the embedding table by one VJP:

        g_phi = sum_i p_i (dW_i/dphi)^T (W_i^0 - W_i^K),   g_Z = sum_i p_i (dW_i/dZ)^T (W_i^0 - W_i^K),
        p_i = w_i / sum_j w_j,

    i.e. the gradient at the current point of 0.5 * sum_i p_i ||h(phi; z_i) - W_i^K||^2 (when ``sent`` is
    h's current output). Rows of Z that are not in ``client_ids`` get zero gradient.
    sent, trained: pytrees of the generated outputs with leading axis [S]; weights: [S]. Returns (g_phi, g_Z).
    """
    _, vjp = jax.vjp(lambda p, z: generate(apply, p, z, client_ids), params, embeddings)
    delta = jax.tree_util.tree_map(jnp.subtract, sent, trained)
    return vjp(_client_weighted(weights, delta))


def hypernet_surrogate_loss(apply: Callable, params, embeddings, client_ids, trained, weights):
    """0.5 * sum_i p_i ||h(phi; Z[i]) - stop_gradient(W_i^K)||^2 (its gradient is ``hypernet_grads``)."""
    gen = generate(apply, params, embeddings, client_ids)
    diff = jax.tree_util.tree_map(lambda g, t: g - jax.lax.stop_gradient(t), gen, trained)
    sq = jax.tree_util.tree_map(lambda d: jnp.sum(jnp.square(d).reshape(d.shape[0], -1), -1), diff)
    per_client = sum(jax.tree_util.tree_leaves(sq))
    p = weights / jnp.sum(weights)
    return 0.5 * jnp.sum(p * per_client)

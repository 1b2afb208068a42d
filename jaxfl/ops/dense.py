"""Small dense layers as pure functions, for the extra networks some methods add beside the model (FedCP's
policy network, GPFL's conditional valve): PyTorch-default initialisation, params as plain dicts."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def dense_init(key, d_in: int, d_out: int):
    """torch.nn.Linear's default init: kernel [d_in, d_out] and bias [d_out] ~ U(-1/sqrt(d_in), 1/sqrt(d_in))."""
    bound = 1.0 / math.sqrt(d_in)
    k1, k2 = jax.random.split(key)
    return {"kernel": jax.random.uniform(k1, (d_in, d_out), jnp.float32, -bound, bound),
            "bias": jax.random.uniform(k2, (d_out,), jnp.float32, -bound, bound)}


def dense(params, x):
    """x W + b. x [..., d_in] -> [..., d_out]."""
    return x @ params["kernel"] + params["bias"]


def layer_norm_init(d: int):
    """torch.nn.LayerNorm's default affine parameters: scale 1, bias 0, [d] each."""
    return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}


def layer_norm(params, x, eps: float = 1e-5):
    """(x - mean) / sqrt(var + eps) * scale + bias over the last axis (biased variance, as torch). x [..., d]."""
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, -1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * params["scale"] + params["bias"]

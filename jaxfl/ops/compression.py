"""Update compression (``--compression``): each client's update Δ_i = x_i - x of the shared parameters, flattened to
one vector v [D], is encoded, sent, and decoded by the server before aggregation. Each codec is a pure function
v -> v̂ (the decoded update) with the bits its message takes (``message_bits``); the randomised ones draw from the
client's own key (``with_compression``), so results do not depend on the cohort's layout.

    topk       v̂_j = v_j for the k = ceil(fraction D) coordinates of largest |v_j|, else 0
               (bits: k (32 + ceil(log2 D)): values and indices)
    randk      v̂_j = (D / k) v_j on k coordinates drawn uniformly without replacement, else 0: unbiased
               (bits: 32 k; the coordinates follow from a seed the server knows)
    quantize   stochastic uniform quantization to 2^b levels between min(v) and max(v): v̂ is unbiased,
               E v̂ = v (bits: b D + 64); with ``rotate``, v is first rotated by H S / sqrt(D') (S random signs
               from the round's shared key, H the Walsh-Hadamard matrix, D' the next power of two) and v̂ is
               rotated back (Suresh et al., ICML 2017), which shrinks max - min
    qsgd       v̂_j = ||v|| sign(v_j) ξ_j / s with ξ_j = l or l + 1 (l = floor(s |v_j| / ||v||)), unbiased
               (Alistarh et al., NeurIPS 2017; bits: D (ceil(log2(s + 1)) + 1) + 32)
    sign       v̂ = (||v||_1 / D) sign(v) (signSGD with the mean magnitude; bits: D + 32)

Error feedback (``feedback=1``; Seide et al. 2014, Karimireddy et al., ICML 2019): client i keeps the residual
e_i (zero at first), sends C(Δ_i + e_i) and keeps e_i <- Δ_i + e_i - C(Δ_i + e_i); a client absent from a round
keeps its residual. The residual is the client's persistent state beside the algorithm's own. Error feedback
needs a contractive C, E||C(v) - v||^2 <= (1 - δ) ||v||^2 (Karimireddy et al.'s δ-approximate compressor); an
unbiased codec of variance ω (E||C(v) - v||^2 <= ω ||v||^2) is one after scaling by 1 / (1 + ω), with
δ = 1 / (1 + ω) (``unbiased_variance``): under feedback randk sends its k coordinates unscaled (ω = D/k - 1) and
qsgd is scaled by 1 / (1 + min(D / s^2, sqrt(D) / s)). Unscaled, randk's residual on its kept coordinates is
(1 - D/k) v_j, which grows without bound (FedAvg on MNIST falls to 21% at k = D/10).

Deviations: the bit counts are those of the message's values and indices, without entropy coding. Stochastic
quantization (``quantize``) runs unscaled under feedback: its variance, at most D (max - min)^2 / (4 L^2),
depends on v, and no scale known to both sides makes it contractive for every v.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..core.privacy import all_shared
from ..core.types import Algorithm, RoundInfo
from .spec import parse_spec
from .updates import shared_updates

CODECS = {
    "none": {},
    "topk": {"fraction": 0.01, "feedback": 0},
    "randk": {"fraction": 0.1, "feedback": 0},
    "quantize": {"bits": 4, "rotate": 0, "feedback": 0},
    "qsgd": {"levels": 16, "feedback": 0},
    "sign": {"feedback": 0},
}
_CHECKS = {"fraction": (float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
           "bits": (int, lambda v: 1 <= v <= 16, "an integer in [1, 16]"),
           "rotate": (int, lambda v: v in (0, 1), "0 or 1"),
           "feedback": (int, lambda v: v in (0, 1), "0 or 1"),
           "levels": (int, lambda v: v >= 1, "an integer >= 1")}


def parse_compression(spec: str) -> tuple[str, dict]:
    """``"NAME"`` or ``"NAME:key=value,..."`` -> (name, parameters with defaults); ConfigError naming what is
    wrong and what is allowed (``spec.parse_spec``)."""
    return parse_spec(spec, "compression", CODECS, _CHECKS)


def kept_count(size: int, fraction: float) -> int:
    """k = ceil(fraction D), at least 1."""
    return max(1, min(size, math.ceil(fraction * size)))


def topk(v, fraction: float):
    """The k = ceil(fraction D) entries of largest magnitude, the rest 0 (ties by index). v [D] -> [D]."""
    k = kept_count(v.shape[0], fraction)
    idx = jax.lax.top_k(jnp.abs(v), k)[1]
    return jnp.zeros_like(v).at[idx].set(v[idx])


def randk(v, fraction: float, key):
    """k = ceil(fraction D) uniformly drawn entries scaled by D / k (unbiased), the rest 0. v [D] -> [D]."""
    d = v.shape[0]
    k = kept_count(d, fraction)
    idx = jax.random.permutation(key, d)[:k]
    return jnp.zeros_like(v).at[idx].set(v[idx] * (d / k))


def stochastic_quantize(v, bits: int, key):
    """Unbiased stochastic rounding of v to L = 2^bits - 1 equal steps between min(v) and max(v):
    u = (v - lo) / (hi - lo) L, v̂ = lo + (floor(u) + Bernoulli(u - floor(u))) (hi - lo) / L. v [D] -> [D]."""
    lo, hi = jnp.min(v), jnp.max(v)
    levels = 2 ** bits - 1
    span = jnp.maximum(hi - lo, jnp.finfo(v.dtype).tiny)
    u = (v - lo) / span * levels
    low = jnp.floor(u)
    q = low + (jax.random.uniform(key, v.shape, v.dtype) < u - low)
    return jnp.where(hi > lo, lo + q * span / levels, v)


def qsgd(v, levels: int, key):
    """QSGD: ||v|| sign(v_j) ξ_j / s, ξ_j = l + Bernoulli(s |v_j| / ||v|| - l), l = floor(s |v_j| / ||v||)
    (s = ``levels``); unbiased. v [D] -> [D]."""
    norm = jnp.linalg.norm(v)
    r = levels * jnp.abs(v) / jnp.maximum(norm, jnp.finfo(v.dtype).tiny)
    low = jnp.floor(r)
    xi = low + (jax.random.uniform(key, v.shape, v.dtype) < r - low)
    return norm * jnp.sign(v) * xi / levels


def sign_compress(v):
    """(||v||_1 / D) sign(v). v [D] -> [D]."""
    return jnp.mean(jnp.abs(v)) * jnp.sign(v)


def walsh_hadamard(v):
    """The orthonormal Walsh-Hadamard transform H v / sqrt(n) of v [n], n a power of two (its own inverse)."""
    n = v.shape[0]
    if n & (n - 1):
        raise ValueError(f"walsh_hadamard needs a power-of-two length, got {n}")
    h = 1
    x = v
    while h < n:
        x = x.reshape(-1, 2, h)
        x = jnp.concatenate([x[:, 0] + x[:, 1], x[:, 0] - x[:, 1]], axis=1).reshape(n)
        h *= 2
    return x / jnp.sqrt(jnp.asarray(n, v.dtype))


def rotated(codec, v, key, rotation_key):
    """codec applied in a random rotation: w = H S [v, 0] / sqrt(D') (S: random signs of ``rotation_key``,
    shared by clients and server; D' the next power of two), ŵ = codec(w, key), v̂ = (S H ŵ / sqrt(D'))[:D]."""
    d = v.shape[0]
    n = 1 << max(d - 1, 0).bit_length()
    signs = jnp.where(jax.random.bernoulli(rotation_key, 0.5, (n,)), 1.0, -1.0).astype(v.dtype)
    w = walsh_hadamard(signs * jnp.pad(v, (0, n - d)))
    return (signs * walsh_hadamard(codec(w, key)))[:d]


def decode(name: str, v, key, rotation_key, **params):
    """The server's v̂ of codec ``name`` (``CODECS``) for the update v [D] -> [D]."""
    if name == "topk":
        return topk(v, params["fraction"])
    if name == "randk":
        return randk(v, params["fraction"], key)
    if name == "quantize":
        q = lambda w, k: stochastic_quantize(w, params["bits"], k)  # noqa: E731
        return rotated(q, v, key, rotation_key) if params["rotate"] else q(v, key)
    if name == "qsgd":
        return qsgd(v, params["levels"], key)
    if name == "sign":
        return sign_compress(v)
    raise ValueError(f"no codec {name!r}; the codecs: {', '.join(CODECS)}")


def unbiased_variance(name: str, size: int, **params) -> float | None:
    """ω of an unbiased codec, E||C(v) - v||^2 <= ω ||v||^2 for every v of ``size`` D: randk D/k - 1 (exact),
    qsgd min(D / s^2, sqrt(D) / s) (Alistarh et al., Lemma 3.1); None for the others (biased, or ``quantize``,
    whose variance depends on v)."""
    if name == "randk":
        return size / kept_count(size, params["fraction"]) - 1.0
    if name == "qsgd":
        s = params["levels"]
        return min(size / s ** 2, math.sqrt(size) / s)
    return None


def message_bits(name: str, size: int, **params) -> int:
    """Bits of one client's message under codec ``name`` for an update of ``size`` floats (32 bits each
    uncompressed): the module docstring's counts."""
    if name == "none":
        return 32 * size
    if name == "topk":
        k = kept_count(size, params["fraction"])
        return k * (32 + max(1, math.ceil(math.log2(size))))
    if name == "randk":
        return 32 * kept_count(size, params["fraction"])
    if name == "quantize":
        n = 1 << max(size - 1, 0).bit_length() if params["rotate"] else size
        return params["bits"] * n + 64
    if name == "qsgd":
        return size * (math.ceil(math.log2(params["levels"] + 1)) + 1) + 32
    if name == "sign":
        return size + 32
    raise ValueError(f"no codec {name!r}; the codecs: {', '.join(CODECS)}")


def with_compression(alg: Algorithm, name: str, key, **params) -> Algorithm:
    """``alg`` whose aggregate sees each row's update of the shared parameters decoded from codec ``name``
    (all shared leaves flattened per row); each client's metrics gain ``upload_bits``, its message's size.
    Client i in round t draws from fold_in(fold_in(fold_in(key, 0), t), i); the rotation's signs from
    fold_in(fold_in(key, 1), t) (one per round, known to all). ``feedback=1``: error feedback, the client's
    state becomes {"inner": its state under ``alg``, "residual": e_i [D]}. ``alg`` must be an averaging
    algorithm (``Options.user_dp``)."""
    if name == "none":
        return alg
    params = {**CODECS[name], **params}
    feedback = bool(params.pop("feedback", 0))
    residual_key = "compression_residual"  # the trained row's copy of the client's residual (feedback)

    def shared_of(server, info):
        return alg.share_mask(server, info) if alg.share_mask is not None else all_shared(server["params"])

    def shared_size(server, info):
        marks = jax.tree_util.tree_leaves(shared_of(server, info))
        return sum(x.size for x, s in zip(jax.tree_util.tree_leaves(server["params"]), marks) if s is not False)

    def init(rng, sample_x):
        server, client = alg.init(rng, sample_x)
        if not feedback:
            return server, client
        info = RoundInfo(jnp.int32(0), jnp.int32(0))  # (the share mask of round 0 sizes the residual)
        return server, {"inner": client, "residual": jnp.zeros(shared_size(server, info), jnp.float32)}

    def local_update(server, client, data, rng, info):
        trained, metrics = alg.local_update(server, client["inner"] if feedback else client, data, rng, info)
        if feedback:
            trained = {**trained, residual_key: client["residual"]}
        return trained, dict(metrics, upload_bits=jnp.float32(message_bits(name, shared_size(server, info),
                                                                           **params)))

    def aggregate(server, trained, weights, info):
        residual = trained.get(residual_key) if feedback else None
        inner = {k: v for k, v in trained.items() if k != residual_key}
        flat, rebuild = shared_updates(server["params"], inner["params"], shared_of(server, info))
        if flat.shape[1] == 0:  # nothing shared: nothing sent
            new_server, kept = alg.aggregate(server, inner, weights, info)
            return (new_server, kept) if residual is None else (new_server, {"inner": kept, "residual": residual})
        sent = flat if residual is None else flat + residual
        round_key = jax.random.fold_in(jax.random.fold_in(key, 0), info.round)
        keys = jax.vmap(lambda c: jax.random.fold_in(round_key, c))(jnp.asarray(info.client_id, jnp.int32))
        rotation_key = jax.random.fold_in(jax.random.fold_in(key, 1), info.round)
        decoded = jax.vmap(lambda v, kk: decode(name, v, kk, rotation_key, **params))(sent, keys)
        omega = unbiased_variance(name, flat.shape[1], **params) if residual is not None else None
        if omega is not None:  # error feedback needs a contractive codec: C / (1 + ω) is one
            decoded = decoded / (1.0 + omega)
        new_server, kept = alg.aggregate(server, {**inner, "params": rebuild(decoded)}, weights, info)
        if residual is None:
            return new_server, kept
        present = (weights > 0)[:, None]
        return new_server, {"inner": kept, "residual": jnp.where(present, sent - decoded, residual)}

    def unwrap(fn):  # fn(server, client, ...) of ``alg``, given its own client state
        if fn is None or not feedback:
            return fn
        return lambda server, client, *a, **kw: fn(server, client["inner"], *a, **kw)

    def unwrap_trained(fn):
        if fn is None or not feedback:
            return fn
        return lambda server, trained, *a, **kw: fn(server, {k: v for k, v in trained.items() if k != residual_key},
                                                    *a, **kw)

    prepare = alg.prepare_predict
    return alg._replace(
        init=init, local_update=local_update, aggregate=aggregate, predict=unwrap(alg.predict),
        predict_trained=unwrap_trained(alg.predict_trained),
        prepare_predict=None if prepare is None or not feedback else (
            lambda server, client, *a, **kw: {**client, "inner": prepare(server, client["inner"], *a, **kw)}))

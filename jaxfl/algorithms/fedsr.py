"""FedSR (Nguyen, Torr, Lim, NeurIPS 2022): FedAvg on a probabilistic representation with two regularisers.

Model: the encoder's output h (width d) goes through a linear layer to 2 * z_dim numbers, split into a mean and a
raw scale: mu = (h W + b)[:z_dim], sigma = softplus((h W + b)[z_dim:]); the representation is one sample
z = mu + sigma * eps, eps ~ N(0, I) (reparameterised), and the model's head maps z to logits. Client i minimises

    L = CE(head(z), y) + alpha_L2R * mean_b ||z_b||_2 + alpha_CMI * mean_b KL(N(c mu_b, (c sigma_b)^2) || r(.|y_b)),

r(z|y) = N(r_mu[y], softplus(r_sigma[y])^2) a per-class diagonal Gaussian and c a learnt scalar
(``losses.gaussian_cmi_bound``). The L2 term is the norm of the sample z, not its square. The server averages
the encoder, the linear layer, the head and the BN statistics with the engine's sample weights (FedAvg). r_mu
(init 0), r_sigma (init 1, before the softplus) and c (init 1) are the client's persistent state, trained with
the same optimizer but never communicated (as in the official code). Prediction: the mean of softmax(head(z_s))
over ``eval_samples`` draws z_s = mu + sigma * eps_s, returned as its log (``eval_samples`` = 0: the head on the
mean mu), from a fixed key (PRNGKey(0)), so an evaluation is a deterministic Monte-Carlo estimate; the clients
predict with the global model (the reference distributions do not enter prediction). Defaults: alpha_L2R =
0.01, alpha_CMI = 0.001 (DapperFL's Table 4), z_dim = the encoder's width d, eval_samples = 20. The linear layer
is initialised as torch's ``nn.Linear`` (uniform on +-1/sqrt(d)).

Deviations:
- The official optimizer persists across rounds (momentum buffers); jaxfl's starts fresh each round.
- The official server averages without weights (a mean over clients) and trains on pretrained ResNets; here
  the engine's weights and any jaxfl model.
- The default alpha_CMI is DapperFL's 1e-3; the official code's default is 5e-4.
- The logged negative-entropy diagnostic of the official loop is not computed (not in the objective).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ..core.aggregation import tree_weighted_mean
from ..core.metrics import cross_entropy, weighted_mean_loss
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ..ops.losses import feature_norm, gaussian_cmi_bound
from ._registry import register


@dataclasses.dataclass(frozen=True)
class FedSROptions(Options):
    name = "fedsr"
    client_state = True
    sharing = ("all parameters, BN statistics and the representation layer (FedAvg)",
               "its reference distributions r(z|y) (per-class means and scales) and the scale c")
    l2r: float = option(0.01, "alpha_L2R, weight of the mean L2 norm of the representation z", lo=0.0)
    cmi: float = option(0.001, "alpha_CMI, weight of the conditional-mutual-information bound", lo=0.0)
    z_dim: int = option(0, "width of the probabilistic representation z (0: the encoder's width)", minimum=0)
    eval_samples: int = option(20, "samples of z averaged at prediction (0: predict from the mean)", minimum=0)


def gaussian_representation(h, proj):
    """(mu, sigma) of FedSR's representation: a = h @ proj["kernel"] + proj["bias"], mu = a[..., :k],
    sigma = softplus(a[..., k:]); h [B, d], kernel [d, 2k], bias [2k] -> mu, sigma [B, k]."""
    a = h @ proj["kernel"] + proj["bias"]
    k = a.shape[-1] // 2
    return a[..., :k], jax.nn.softplus(a[..., k:])


def init_projection(key, d: int, z_dim: int):
    """torch ``nn.Linear(d, 2 z_dim)``'s default init: kernel [d, 2 z_dim] and bias [2 z_dim]
    ~ U(-1/sqrt d, 1/sqrt d)."""
    bound = 1.0 / math.sqrt(d)
    kk, kb = jax.random.split(key)
    return {"kernel": jax.random.uniform(kk, (d, 2 * z_dim), minval=-bound, maxval=bound),
            "bias": jax.random.uniform(kb, (2 * z_dim,), minval=-bound, maxval=bound)}


def sampled_forward(module, x, train, mask, proj, eps):
    """A ``Classifier`` method: (logits [S, B, C], z [S, B, k], mu [B, k], sigma [B, k]) for noise eps [S, B, k]
    (z = mu + sigma * eps; eps = 0 gives the mean)."""
    mu, sigma = gaussian_representation(module.encoder(x, train, mask), proj)
    z = mu + sigma * eps
    s, b, k = z.shape
    tiled = None if mask is None else jnp.tile(mask, s)
    logits = module.head(z.reshape(s * b, k), train, tiled)
    return logits.reshape(s, b, -1), z, mu, sigma


def fedsr_loss(model, l2r: float, cmi: float):
    """loss_fn(params, stats, x, y, w, key) with params {"model", "proj", "prior"} -> (loss, (stats, logits)):
    CE of one reparameterised sample + l2r * mean_w ||z|| + cmi * mean_w KL to the class's reference Gaussian."""
    def loss_fn(params, stats, x, y, w, key):
        k = params["proj"]["bias"].shape[0] // 2
        k_eps, k_drop = jax.random.split(key)
        eps = jax.random.normal(k_eps, (1, x.shape[0], k))
        (logits, z, mu, sigma), updated = model.apply(
            {"params": params["model"], "batch_stats": stats}, x, True, w, params["proj"], eps,
            method=sampled_forward, mutable=["batch_stats"], rngs={"dropout": k_drop})
        logits, z = logits[0], z[0]
        prior = params["prior"]
        bound = gaussian_cmi_bound(mu, sigma, prior["r_mu"][y], jax.nn.softplus(prior["r_sigma"])[y],
                                   prior["scale"])
        loss = (weighted_mean_loss(cross_entropy(logits, y), w) + l2r * weighted_mean_loss(feature_norm(z), w)
                + cmi * weighted_mean_loss(bound, w))
        return loss, (updated.get("batch_stats", {}), logits)
    return loss_fn


@register(FedSROptions)
def fedsr(model, trainer: LocalTrainer, o: FedSROptions, ctx: RunContext) -> Algorithm:
    """FedSR: FedAvg with a Gaussian representation, its L2 norm and a CMI bound to per-client class priors."""
    loss_fn = fedsr_loss(model, o.l2r, o.cmi)

    def init(key, sample_x):
        x = trainer.preprocess(sample_x[:1])
        k_model, k_proj = jax.random.split(key)
        d = jax.eval_shape(lambda: model.apply(model.init(k_model, x, method="features"), x,
                                               method="features")).shape[-1]
        z_dim = o.z_dim or d
        proj = init_projection(k_proj, d, z_dim)
        eps = jnp.zeros((1, 1, z_dim))
        variables = model.init(k_model, x, False, None, proj, eps, method=sampled_forward)
        c = jax.eval_shape(lambda: model.apply(variables, x, False, None, proj, eps,
                                               method=sampled_forward)[0]).shape[-1]
        server = {"params": variables["params"], "batch_stats": variables.get("batch_stats", {}), "proj": proj}
        prior = {"r_mu": jnp.zeros((c, z_dim)), "r_sigma": jnp.ones((c, z_dim)), "scale": jnp.ones(())}
        return server, prior

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        params = {"model": server["params"], "proj": server["proj"], "prior": client}
        params, stats, _, metrics = trainer.run(loss_fn, params, server["batch_stats"], trainer.tx.init(params),
                                                data, key)
        return {"params": params["model"], "batch_stats": stats, "proj": params["proj"],
                "prior": params["prior"]}, metrics

    def aggregate(server, trained, weights, info=None):
        shared = {k: trained[k] for k in ("params", "batch_stats", "proj")}
        return tree_weighted_mean(shared, weights), trained["prior"]

    def log_mean_probs(state, x):
        k = state["proj"]["bias"].shape[0] // 2
        s = max(o.eval_samples, 1)
        eps = (jax.random.normal(jax.random.PRNGKey(0), (s, x.shape[0], k)) if o.eval_samples
               else jnp.zeros((1, x.shape[0], k)))
        logits = model.apply({"params": state["params"], "batch_stats": state["batch_stats"]}, x, False, None,
                             state["proj"], eps, method=sampled_forward)[0]
        return jax.nn.logsumexp(jax.nn.log_softmax(logits, -1), axis=0) - jnp.log(s)

    def predict(server, client, x, client_id=None):
        return log_mean_probs(server, x)

    def predict_trained(server, trained, x, client_id=None):
        return log_mean_probs(trained, x)

    return Algorithm("fedsr", init, local_update, aggregate, predict, predict_trained)

"""FedCP (Zhang et al., KDD 2023, "FedCP: Separating Feature Information for Personalized Federated Learning via
Conditional Policy"): a conditional policy network splits each sample's features between a personal and a
global head.

Client i holds a personal head h_p, a global head h_g, a policy network (CPN) cs and a context vector c_i [d].
On a sample with features z = f(x) (the global encoder f),

    [a, a'] = ReLU(LayerNorm(u K + b)),  u = z * c_i / ||c_i||      (K: [d, 2d]; a, a' [d])
    pm = sigmoid((a - a' + L) / tau),  L ~ Logistic(0, 1),  gm = 1 - pm      (a 2-way Gumbel-softmax, tau = 1)
    logits = h_p(z * pm) + h_g(z * gm)

and client i trains f, h_p and cs (h_g frozen) on CE + lam MMD^2(z, z-bar), z-bar = f-bar(x) the frozen encoder it
received and MMD with Gaussian kernels of bandwidths 2 x {10, 15, 20, 50} (``losses.gaussian_mmd``). It uploads
f, cs and 0.5 h_p + 0.5 h_g; the server averages each (the engine's weights) and sends them back: the cohort's
clients take the new h_g and cs and set their context to the row sums of their trained personal head's kernel
product (c_i[j] = sum_k (K_1 ... K_L)[j, k]: for a linear head, the sum over classes of its weights). BN
statistics stay with the client. A client predicts with the global encoder, its h_p, h_g, cs and c_i, without
the logistic noise. Defaults: lam = 5 (the official run script; its ``main.py`` default 0 switches the MMD off).

Stability: with lam = 5 the MMD term needs a small client lr (the official 0.005). At 0.05 (2NN on MNIST) the
features leave the kernels' range within a few steps, a third of them die and FedCP stops learning; the official
code does the same from the same weights (``experiments/official/fedcp.md``).

Every client starts from the same CPN, heads and context c ~ U[0, 1)^d (PFLlib's seeding; officially each client
draws its own context).

Reference: TsingZ0/FedCP @ 7110e973 (``system/flcore/clients/clientcp.py`` ``Ensemble``, ``train_cs_model``,
``MMD``, ``generate_upload_head``, ``set_head_g``; ``servers/servercp.py``, its ``ConditionalSelection``);
PFLlib's ``clientcp.py`` is the same code.

Deviations:
- Prediction is deterministic (pm = sigmoid((a - a') / tau)); the official code samples the Gumbel noise at
  evaluation too.
- Heads with hidden layers: the context multiplies their Dense kernels and ignores their biases and
  BatchNorms (the official models' heads are one linear layer).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..core.aggregation import tree_weighted_mean
from ..core.metrics import cross_entropy, weighted_mean_loss
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ..ops.dense import dense, dense_init, layer_norm, layer_norm_init
from ..ops.losses import gaussian_mmd
from ..ops.masks import gumbel_sigmoid
from ._common import feature_dim, head_dense_kernels, head_on, init_variables
from ._registry import register

MMD_BANDWIDTHS = (20.0, 30.0, 40.0, 100.0)  # 2 x the official {10, 15, 20, 50}: exp(-D / (2 a))


@dataclasses.dataclass(frozen=True)
class FedCPOptions(Options):
    name = "fedcp"
    client_state = True
    sharing = ("the encoder, the policy network and 0.5 personal + 0.5 global head (each averaged)",
               "its personal head, its copies of the global head and policy, its context vector, BN statistics")
    lam: float = option(5.0, "weight of MMD^2 between its features and the received encoder's", lo=0.0)
    tau: float = option(1.0, "temperature of the policy's Gumbel-softmax", lo=0.0, lo_open=True)


def policy_init(key, d: int):
    """The CPN's parameters: Linear(d, 2d) (torch init) and LayerNorm(2d)."""
    return {"dense": dense_init(key, d, 2 * d), "ln": layer_norm_init(2 * d)}


def policy_gates(cpn, z, context, key=None, tau: float = 1.0):
    """(pm, gm): the personal and global feature gates of features z [B, d] given the context [d].
    [a, a'] = ReLU(LN((z * c / ||c||) K + b)); pm = sigmoid((a - a' + L) / tau) (L = 0 without a key); gm = 1 - pm."""
    u = z * (context / jnp.maximum(jnp.linalg.norm(context), 1e-12))
    h = jax.nn.relu(layer_norm(cpn["ln"], dense(cpn["dense"], u)))
    d = z.shape[-1]
    pm = gumbel_sigmoid(h[..., :d] - h[..., d:], key, tau)
    return pm, 1.0 - pm


def head_context(head_params):
    """c[j] = sum_k (K_1 K_2 ... K_L)[j, k] over the head's Dense kernels (a linear head: its kernel's row sums,
    the official sum over classes of the weights). -> [d]."""
    kernels = head_dense_kernels(head_params)
    prod = kernels[0]
    for k in kernels[1:]:
        prod = prod @ k
    return jnp.sum(prod, -1)


def fedcp_loss(model, lam: float, tau: float):
    """loss_fn(params, stats, x, y, w, key, head_g, cpn_context, encoder_bar) with params {"encoder", "head",
    "cs"}: CE(h_p(z pm) + h_g(z gm)) + lam MMD^2(z, sg(z-bar)); returns (loss, (stats, logits))."""
    def loss_fn(params, stats, x, y, w, key, head_g, context, encoder_bar):
        variables = {"params": {"encoder": params["encoder"], "head": params["head"]}, "batch_stats": stats}
        z, upd = model.apply(variables, x, True, w, method="features", mutable=["batch_stats"])
        z_bar, _ = model.apply({"params": {"encoder": encoder_bar}, "batch_stats": stats}, x, True, w,
                               method="features", mutable=["batch_stats"])
        pm, gm = policy_gates(params["cs"], z, context, None if key is None else jax.random.fold_in(key, 1), tau)
        lp, upd = model.apply({"params": variables["params"], "batch_stats": upd["batch_stats"]}, z * pm, True, w,
                              method=head_on, mutable=["batch_stats"])
        lg, _ = model.apply({"params": {"head": head_g}, "batch_stats": upd["batch_stats"]}, z * gm, True, w,
                            method=head_on, mutable=["batch_stats"])
        logits = lp + lg
        loss = (weighted_mean_loss(cross_entropy(logits, y), w)
                + lam * gaussian_mmd(z, jax.lax.stop_gradient(z_bar), w, MMD_BANDWIDTHS))
        return loss, (upd["batch_stats"], logits)
    return loss_fn


@register(FedCPOptions)
def fedcp(model, trainer: LocalTrainer, o: FedCPOptions, ctx: RunContext) -> Algorithm:
    """FedCP: per-sample feature gating between a personal and a global head by a conditional policy network."""
    loss_fn = fedcp_loss(model, o.lam, o.tau)

    def init(key, sample_x):
        v = init_variables(model, trainer, key, sample_x)
        x = trainer.preprocess(sample_x[:1])
        d = feature_dim(model, v, x)
        cpn = policy_init(jax.random.fold_in(key, 1), d)
        head = v["params"]["head"]
        server = {"encoder": v["params"]["encoder"], "head_g": head, "cs": cpn}
        client = {"head": head, "head_g": head, "cs": cpn, "batch_stats": v["batch_stats"],
                  "context": jax.random.uniform(jax.random.fold_in(key, 2), (d,))}
        return server, client

    def local_update(server, client, data: ClientData, key, info: RoundInfo = None):
        params = {"encoder": server["encoder"], "head": client["head"], "cs": client["cs"]}
        fn = lambda p, s, x, y, w, k: loss_fn(p, s, x, y, w, k, client["head_g"], client["context"],  # noqa: E731
                                              server["encoder"])
        params, stats, _, metrics = trainer.run(fn, params, client["batch_stats"], trainer.tx.init(params), data,
                                                key)
        upload = jax.tree_util.tree_map(lambda p, g: 0.5 * p + 0.5 * g, params["head"], client["head_g"])
        # the row also carries the frozen head and context it trained with (its prediction right after training)
        return dict(params, batch_stats=stats, head_g_up=upload, head_g=client["head_g"],
                    context=client["context"]), metrics

    def aggregate(server, trained, weights, info=None):
        new = {"encoder": tree_weighted_mean(trained["encoder"], weights),
               "head_g": tree_weighted_mean(trained["head_g_up"], weights),
               "cs": tree_weighted_mean(trained["cs"], weights)}
        k = weights.shape[0]
        sent = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (k,) + a.shape), (new["head_g"], new["cs"]))
        kept = {"head": trained["head"], "head_g": sent[0], "cs": sent[1], "batch_stats": trained["batch_stats"],
                "context": jax.vmap(head_context)(trained["head"])}
        return new, kept

    def personal_logits(encoder, client, x):
        z = model.apply({"params": {"encoder": encoder}, "batch_stats": client["batch_stats"]}, x, False,
                        method="features")
        pm, gm = policy_gates(client["cs"], z, client["context"], None, o.tau)
        def apply_head(h, f):
            return model.apply({"params": {"head": h}, "batch_stats": client["batch_stats"]}, f, False, method=head_on)
        return apply_head(client["head"], z * pm) + apply_head(client["head_g"], z * gm)

    def predict(server, client, x, client_id=None):
        return personal_logits(server["encoder"], client, x)

    def predict_trained(server, trained, x, client_id=None):
        return personal_logits(trained["encoder"], trained, x)

    return Algorithm("fedcp", init, local_update, aggregate, predict, predict_trained)

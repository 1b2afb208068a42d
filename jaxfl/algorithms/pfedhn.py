"""pFedHN (Shamsian, Navon, Fetaya, Chechik, ICML 2021): a server hypernetwork generates each client's whole model.

The server holds a hypernetwork h(phi; v) and a client embedding table V [N, E]; client i of the cohort receives
theta_i^0 = h(phi; V[i]), ALL the target network's parameters (BatchNorm scale/bias included), trains them for K
steps and returns theta_i^K; the server takes one optimizer step on (phi, V) along (``hypernet.hypernet_grads``)

    g_phi, g_V = VJP of (phi, V) -> [h(phi; V[i])]_{i in cohort} with cotangent p_i (theta_i^0 - theta_i^K),

p_i = n_i / sum_j n_j: gradient descent on 0.5 sum_i p_i ||h(phi; v_i) - theta_i^K||^2. Rows of V outside the
cohort get zero gradient (weight decay and momentum still act on the whole table, as torch's SGD does).
Client: ``inner_steps`` K = 50 steps, each on a fresh random minibatch (the first ``--batch-size`` samples of a
new permutation), SGD(lr 5e-3, momentum 0.9, weight decay 5e-5) after clipping the gradient's global norm to 50;
``inner_steps=0`` trains with the run's ``LocalTrainer`` (``--local-epochs`` passes, ``--lr``, ``--momentum``).
Server optimizer: global norm of (phi, V) clipped to 50, then ``sgd``: SGD(lr 1e-2, momentum 0.9, weight decay
1e-3; V at ``embed_lr``, default lr) or ``adam``: Adam(lr), no decay. Hypernetwork: E = int(1 + N/4)
(``embed_dim=0``), trunk Linear(E->100) then 3 x [ReLU, Linear(100->100)], one linear head per target parameter
(``hypernet.hypernetwork``), torch's default init; V ~ N(0, 1). BatchNorm running statistics are not generated:
each client keeps its own (its only persistent state; {} without BN), from the model's initial ones, updated in
every training forward pass. The heads of BN scales get 1 added to their bias at init (our choice), so a
generated scale starts near 1 rather than near 0, which would silence its layer. State: server {"params":
{"hnet": phi, "embeddings": V}, "hyper_opt"}; per client {"batch_stats"}; a client's embedding row is its id.
Prediction: h(phi; V[i]) with the client's statistics (``predict_trained``: the trained weights). Models: at most
~2.6M parameters (``PFedHNOptions.models``; (hyper_hidden + 1) weights per target parameter; small_cnn default).

Deviations:
- The official code trains one client per server step (p = 1); here a round trains the engine's cohort and
  averages their VJPs with sample weights (one client per round is the official schedule).
- Heads output each parameter in the JAX layout (kernel [in, out] / [h, w, in, out]), not torch's
  [out, in, h, w]: a fixed permutation of head outputs, equivalent up to init.
- BN scale heads' bias +1 at init (the official target CNN has no BN).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from ..core.metrics import correct_count
from ..core.options import Options, option
from ..core.trainer import LocalTrainer, client_epochs, epoch_permutation
from ..core.trees import leaf_paths
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ..ops.hypernet import generate, hypernet_grads, hypernetwork, init_embeddings, require_table_size
from ._common import ce_loss, init_variables, is_batchnorm
from ._registry import register


HYPER_OPTIMIZERS = ("sgd", "adam")


@dataclasses.dataclass(frozen=True)
class PFedHNOptions(Options):
    name = "pfedhn"
    client_state = True
    own_minibatches = True  # (its inner steps draw their own minibatches: ``--augment`` does not apply)
    server_client_rows = True  # (the server's table, one row per training client)
    local_work = "inner_steps"
    # the hypernetwork holds (hyper_hidden + 1) weights per target parameter (x3 with its optimizer state): the
    # models of at most ~2.6M parameters (digits_cnn's 14M would need a 1.4B-weight hypernetwork)
    models = ("small_cnn", "resnet10_slim", "vit_tiny", "pfl_cnn", "fedavg_cnn", "vit_small")
    sharing = ("its trained weights, whose change the server back-propagates into a hypernetwork and an "
               "embedding table that generate every parameter",
               "its BatchNorm running statistics")
    embed_dim: int = option(0, "client embedding size (0: 1 + N/4, the official default)", minimum=0)
    hyper_hidden: int = option(100, "hypernetwork trunk width", minimum=1)
    hyper_layers: int = option(3, "hidden layers of the hypernetwork trunk after the first", minimum=0)
    hyper_optimizer: str = option("sgd", "server optimizer: sgd (momentum, weight decay) | adam",
                                  choices=HYPER_OPTIMIZERS)
    hyper_lr: float = option(0.01, "hypernetwork learning rate", lo=0.0, lo_open=True)
    embed_lr: float | None = option(None, "sgd: learning rate of the embedding table (default: hyper_lr)", lo=0.0,
                                    lo_open=True)
    hyper_momentum: float = option(0.9, "sgd: hypernetwork momentum", lo=0.0, hi=1.0)
    hyper_decay: float = option(1e-3, "sgd: hypernetwork and embedding weight decay", lo=0.0)
    inner_steps: int = option(50, "client SGD steps per round, each on a fresh random minibatch (0: the run's "
                              "trainer, --local-epochs passes with --lr/--momentum)", minimum=0)
    inner_lr: float = option(5e-3, "client inner SGD learning rate", lo=0.0, lo_open=True)
    inner_momentum: float = option(0.9, "client inner SGD momentum", lo=0.0, hi=1.0)
    inner_decay: float = option(5e-5, "client inner SGD weight decay", lo=0.0)
    grad_clip: float = option(50.0, "global-norm gradient clipping of the inner and the server steps (0: off)",
                              lo=0.0)


def auto_embed_dim(num_clients: int) -> int:
    """The official ``--embed-dim -1``: int(1 + N / 4)."""
    return int(1 + num_clients / 4)


class TargetLayout:
    """The target model's parameters as the hypernetwork's named outputs: ``names`` ("encoder/conv/kernel", ...
    in ``tree_leaves`` order), ``shapes``, ``to_tree`` (h's output -> params) and ``to_flat`` (params -> h's
    output layout; works on trees stacked over clients too)."""

    def __init__(self, params_shapes):
        self.names = ["/".join(p) for p in leaf_paths(params_shapes)]
        self.treedef = jax.tree_util.tree_structure(params_shapes)
        self.shapes = {n: tuple(leaf.shape) for n, leaf in zip(self.names, jax.tree_util.tree_leaves(params_shapes))}

    def to_tree(self, out):
        return jax.tree_util.tree_unflatten(self.treedef, [out[n] for n in self.names])

    def to_flat(self, tree):
        return dict(zip(self.names, jax.tree_util.tree_leaves(tree)))


def is_bn_scale(name: str) -> bool:
    """A generated BatchNorm scale ("encoder/bn1/scale")."""
    path = tuple(name.split("/"))
    return is_batchnorm(path) and path[-1] == "scale"


def bn_scales_start_at_one(hnet_params):
    """Add 1 to the bias of every BatchNorm-scale head, so a generated BN scale starts near BN's own init (1)
    instead of near 0 (which would silence the layer); every other head keeps torch's init."""
    heads = {n: (dict(h, bias=h["bias"] + 1.0) if is_bn_scale(n) else h) for n, h in hnet_params["heads"].items()}
    return dict(hnet_params, heads=heads)


def hyper_optimizer(o: PFedHNOptions) -> optax.GradientTransformation:
    """The official server optimizer on {"hnet": phi, "embeddings": V}: clip the global norm, then SGD with
    torch's weight decay (phi at hyper_lr, V at embed_lr) or Adam."""
    if o.hyper_optimizer == "adam":
        step = optax.adam(o.hyper_lr)
    else:
        sgd = lambda lr: optax.chain(optax.add_decayed_weights(o.hyper_decay),
                                     optax.sgd(lr, momentum=o.hyper_momentum or None))
        embed_lr = o.hyper_lr if o.embed_lr is None else o.embed_lr
        labels = lambda tree: {"hnet": jax.tree_util.tree_map(lambda _: "hnet", tree["hnet"]), "embeddings": "embed"}
        step = optax.multi_transform({"hnet": sgd(o.hyper_lr), "embed": sgd(embed_lr)}, labels)
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), step) if o.grad_clip else step


def inner_optimizer(o: PFedHNOptions) -> optax.GradientTransformation:
    """The official client optimizer: clip the gradient's global norm, then SGD(inner_lr, momentum) with
    weight decay added to the gradient as torch does."""
    tx = optax.chain(optax.add_decayed_weights(o.inner_decay), optax.sgd(o.inner_lr, momentum=o.inner_momentum or None))
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), tx) if o.grad_clip else tx


def random_batch_steps(loss_fn, tx, steps: int, batch_size: int, preprocess, params, state, data: ClientData, key):
    """``steps`` optimizer steps of one client, step t on the first ``batch_size`` samples of a fresh permutation
    (``core.trainer.epoch_permutation`` with key fold_in(key, t): real samples first, padding weighted 0). A client
    without samples takes no step. Returns (params, state, metrics) with LocalTrainer's metrics."""
    b, m = batch_size, data.y.shape[0]
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    w = (jnp.arange(b) < data.count).astype(jnp.float32)

    def step(t, carry):
        params, state, opt_state, sums = carry
        k = jax.random.fold_in(key, t)
        idx = jnp.pad(epoch_permutation(jax.random.fold_in(k, 0), data.count, m), (0, max(b - m, 0)))[:b]
        (loss, (state, logits)), grads = grad_fn(params, state, preprocess(data.x[idx]), data.y[idx], w,
                                                 jax.random.fold_in(k, 1))
        updates, opt_state = tx.update(grads, opt_state, params)
        n = jnp.sum(w)
        sums = sums + jnp.stack([loss * n, correct_count(logits, data.y[idx], w), n, 1.0])
        return optax.apply_updates(params, updates), state, opt_state, sums

    n_steps = jnp.where(data.count > 0, client_epochs(data, steps), 0)  # a straggler: fewer of its steps
    params, state, _, sums = jax.lax.fori_loop(0, n_steps, step, (params, state, tx.init(params),
                                                                  jnp.zeros(4, jnp.float32)))
    seen = jnp.maximum(sums[2], 1.0)
    return params, state, {"loss": sums[0] / seen, "accuracy": sums[1] / seen, "seen": sums[2], "steps": sums[3]}


@register(PFedHNOptions)
def pfedhn(model, trainer: LocalTrainer, o: PFedHNOptions, ctx: RunContext) -> Algorithm:
    """pFedHN on any ``Classifier``; options: ``PFedHNOptions``. ctx.num_clients: N, the size of the embedding table
    (the run's client count; required: client ids index it)."""
    require_table_size("pfedhn", ctx.num_clients)
    embed_dim = o.embed_dim or auto_embed_dim(ctx.num_clients)
    hyper_tx, inner_tx = hyper_optimizer(o), inner_optimizer(o)
    loss_fn = ce_loss(model)

    @functools.lru_cache(maxsize=None)
    def target(sample_shape, dtype):
        """(layout, hypernetwork) for inputs of one sample's shape (the parameters' shapes can depend on it)."""
        x = jax.ShapeDtypeStruct((1,) + sample_shape, dtype)
        shapes = jax.eval_shape(lambda xx: init_variables(model, trainer, jax.random.key(0), xx), x)["params"]
        layout = TargetLayout(shapes)
        return layout, hypernetwork(layout.shapes, embed_dim, o.hyper_hidden, o.hyper_layers)

    def generated(server, client_id, x):
        layout, hnet = target(tuple(x.shape[1:]), jnp.dtype(x.dtype))
        return layout.to_tree(hnet.apply(server["params"]["hnet"], server["params"]["embeddings"][client_id]))

    def init(key, sample_x):
        stats = init_variables(model, trainer, key, sample_x)["batch_stats"]
        _, hnet = target(tuple(sample_x.shape[1:]), jnp.dtype(sample_x.dtype))
        k_hnet, k_emb = jax.random.split(jax.random.fold_in(key, 1))
        params = {"hnet": bn_scales_start_at_one(hnet.init(k_hnet)),
                  "embeddings": init_embeddings(k_emb, ctx.num_clients, embed_dim)}
        return {"params": params, "hyper_opt": hyper_tx.init(params)}, {"batch_stats": stats}

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        theta0 = generated(server, info.client_id, data.x)
        if o.inner_steps:
            params, stats, metrics = random_batch_steps(loss_fn, inner_tx, o.inner_steps, trainer.batch_size,
                                                        trainer.preprocess, theta0, client["batch_stats"], data, key)
        else:
            params, stats, _, metrics = trainer.run(loss_fn, theta0, client["batch_stats"], trainer.tx.init(theta0),
                                                    data, key)
        return {"params": params, "batch_stats": stats}, metrics

    def aggregate(server, clients, weights, info: RoundInfo):
        layout = TargetLayout(jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                                                     clients["params"]))
        hnet = hypernetwork(layout.shapes, embed_dim, o.hyper_hidden, o.hyper_layers)
        ids, hp = info.client_id, server["params"]
        sent = generate(hnet.apply, hp["hnet"], hp["embeddings"], ids)
        g_phi, g_v = hypernet_grads(hnet.apply, hp["hnet"], hp["embeddings"], ids, sent,
                                    layout.to_flat(clients["params"]), weights)
        updates, opt = hyper_tx.update({"hnet": g_phi, "embeddings": g_v}, server["hyper_opt"], hp)
        return {"params": optax.apply_updates(hp, updates), "hyper_opt": opt}, {"batch_stats": clients["batch_stats"]}

    def predict(server, client, x, client_id):
        return model.apply({"params": generated(server, client_id, x), "batch_stats": client["batch_stats"]}, x,
                           train=False)

    def predict_trained(server, trained, x, client_id):  # the weights the client just trained
        return model.apply(trained, x, train=False)

    return Algorithm("pfedhn", init, local_update, aggregate, predict, predict_trained)

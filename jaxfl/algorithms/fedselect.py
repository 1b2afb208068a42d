"""FedSelect (Tamirisa et al., CVPR 2024): per-client masks of personal parameter entries, grown by update size.

Each client holds the full model and a bool mask of the same shape (True = personal), all False at first.
Local training is LocalAlt: ``la_epochs`` times, one pass updating only the personal entries
(theta -= lr g * m) and one pass updating only the global ones (theta -= lr g * (1 - m)). In rounds r with
r % K == 0 and r > 0 (``grow_every`` = K), per maskable tensor W (kernels and BatchNorm scales; biases are
global unless ``mask_biases``): if frac_personal(W) <= alpha, the top ``rate`` fraction of the still-global
entries by |W_now - W_ref| become personal (``ops.masks.grow_mask``; ``grow_rate`` = p); W_ref is the client's
parameters at its previous mask update (``delta_ref="snapshot"``) or at the start of the round
(``"round_start"``). Personal entries never revert.

The server averages each entry over the clients for which it is global, unweighted (``weight_by_n`` for
sample weights), with the mask the client trained with (a newly promoted entry takes the average one last
time), and writes the average into those clients' global entries; personal entries are never read. BN
statistics stay local, unless ``aggregate_batch_stats``, which replaces every client's with the weighted mean
sum_i w_i s_i / sum_i w_i. The run's last round (``RoundInfo.is_last``) aggregates nothing, so the final
evaluation sees the personalized models right after local training, as the paper reports them. Evaluation
after earlier rounds sees the models after the broadcast.

Deviations:
- ``delta_ref="snapshot"`` (default) is the official code's reference point; the paper's is the round start
  (``"round_start"``).
- Evaluation after rounds other than the last sees the models after the broadcast; the official code logs
  them before it.
- The official code calls ``model.eval()`` to evaluate after its first round and never ``model.train()``
  again, so from its second round on every client trains with BatchNorm normalising by its running statistics,
  which stay at their first-round values. jaxfl trains in training mode throughout (the paper's method);
  ``frozen_bn_from=1`` reproduces the official behaviour (no effect on models without BatchNorm).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from ..core.aggregation import masked_mean, member_weights, weighted_mean
from ..core.options import Options, option
from ..core.trainer import LocalTrainer, client_epochs, scan_first
from ..core.trees import path_mask
from ..core.types import Algorithm, RoundInfo, RunContext
from ..data.clients import ClientData
from ..ops.masks import tree_count, tree_density, tree_grow_mask, tree_size
from ._common import ce_loss, init_variables
from ._registry import register


DELTA_REFS = ("snapshot", "round_start")


def is_maskable(path: tuple[str, ...], biases: bool = False) -> bool:
    """FedSelect's maskable tensors: every kernel and BatchNorm scale (torch names containing "weight"), and
    with ``biases`` every bias (Dense/conv bias, BatchNorm shift)."""
    return path[-1] in ("kernel", "scale") + (("bias",) if biases else ())


def mask_updates(mask) -> optax.GradientTransformation:
    """Multiply the updates by a 0/1 (or bool) pytree: entries where mask is 0 do not move."""
    def update(updates, state, params=None):
        return jax.tree_util.tree_map(lambda u, m: u * m.astype(u.dtype), updates, mask), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def local_alt(trainer: LocalTrainer, loss_fn, params, stats, mask, data: ClientData, key, la_epochs: int):
    """LocalAlt: ``la_epochs`` times a personal pass (mask) then a global pass (~mask), one epoch each, with a
    fresh optimizer per pass (a straggler: its first ``client_epochs(data, la_epochs)`` alternations). Returns
    (params, stats, metrics of the last alternation: mean of its passes)."""
    one_epoch = dataclasses.replace(trainer, epochs=1)
    global_mask = jax.tree_util.tree_map(jnp.logical_not, mask)

    def run_pass(params, stats, phase_mask, k):
        tx = optax.chain(trainer.tx, mask_updates(phase_mask))
        t = dataclasses.replace(one_epoch, tx=tx)
        params, stats, _, metrics = t.run(loss_fn, params, stats, tx.init(params), data, k)
        return params, stats, metrics

    def alternation(carry, e):
        params, stats = carry
        params, stats, m_p = run_pass(params, stats, mask, jax.random.fold_in(key, 2 * e + 1))
        # the global pass of alternation 0 uses ``key`` itself: with an all-zero mask and la_epochs = 1
        # its minibatches are those of a one-epoch FedAvg client with the same key
        k_g = jnp.where(e == 0, jax.random.key_data(key), jax.random.key_data(jax.random.fold_in(key, 2 * e + 2)))
        params, stats, m_g = run_pass(params, stats, global_mask, jax.random.wrap_key_data(k_g))
        metrics = jax.tree_util.tree_map(lambda a, b: (a + b) / 2, m_p, m_g)
        return (params, stats), metrics

    runs = client_epochs(data, la_epochs)  # all la_epochs, or a straggler's first ones
    (params, stats), metrics = scan_first(alternation, (params, stats), jnp.arange(la_epochs), runs)
    return params, stats, jax.tree_util.tree_map(lambda a: a[runs - 1], metrics)


@dataclasses.dataclass(frozen=True)
class FedSelectOptions(Options):
    name = "fedselect"
    client_state = True
    multilabel = True
    local_work = "la_epochs"
    sharing = ("each entry while it is global for the client (unweighted per-entry mean)",
               "entries grown into the personal mask by update size; BN statistics")
    # the official code (utils/options.py: --lr 0.05, --local_bs 32; MaskLocalAltSGD has no momentum), which
    # evaluates each model right after its local training
    train_preset = {"lr": 0.05, "momentum": 0.0, "batch_size": 32, "eval_point": "local"}
    alpha: float = option(0.8, "personalization limit per tensor (grows while personal fraction <= alpha; "
                          "0: never)", lo=0.0, hi=1.0)
    grow_rate: float = option(0.25, "fraction p of a tensor's global entries made personal per growth",
                              lo=0.0, hi=1.0)
    grow_every: int = option(3, "K, rounds between mask growths (rounds r with r mod K = 0, r > 0)", minimum=1)
    la_epochs: int = option(1, "E, LocalAlt alternations (personal pass + global pass) per round", minimum=1)
    delta_ref: str = option("snapshot", "snapshot (|W - W at last growth|, official code) | round_start (paper)",
                            choices=DELTA_REFS)
    weight_by_n: bool = option(False, "weight the per-entry mean by sample counts (default unweighted)")
    mask_biases: bool = option(False, "biases can become personal too (default: always global, the code)")
    aggregate_batch_stats: bool = option(False, "average BatchNorm statistics over the round's clients "
                                         "(default local)")
    frozen_bn_from: int = option(0, "from this round index on (0-based), local training normalises with the "
                                 "BatchNorm running statistics and leaves them unchanged, as the official code "
                                 "does from its second round (1); 0: never (the paper)", minimum=0)


@register(FedSelectOptions)
def fedselect(model, trainer: LocalTrainer, o: FedSelectOptions, ctx: RunContext) -> Algorithm:
    """FedSelect (options: ``FedSelectOptions``). alpha: personalization limit per tensor (0: never grow,
    which is FedAvg with LocalAlt); grow_rate: fraction p of a tensor's global entries promoted per growth;
    grow_every: K; la_epochs: E; the run's last round (``RoundInfo.is_last``) does not aggregate;
    mask_biases: biases can become personal too; aggregate_batch_stats: average the BatchNorm statistics over
    the round's clients (the code keeps them local)."""
    alpha, grow_rate, grow_every, la_epochs, delta_ref = o.alpha, o.grow_rate, o.grow_every, o.la_epochs, o.delta_ref
    weight_by_n, mask_biases, aggregate_batch_stats = o.weight_by_n, o.mask_biases, o.aggregate_batch_stats
    loss_fn = ce_loss(model)
    frozen_bn_from = o.frozen_bn_from
    frozen_loss_fn = ce_loss(model, train=False)

    def init(key, sample_x):
        v = init_variables(model, trainer, key, sample_x)
        mask = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, bool), v["params"])
        server = {"params": v["params"]}
        client = dict(v, mask=mask, pending=mask, ref=v["params"])
        return server, client

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        mask = client["mask"]
        # Global entries come from the server (a no-op under full participation, where the broadcast already
        # wrote them; a client sampled after a pause catches up here).
        start = jax.tree_util.tree_map(lambda m, c, s: jnp.where(m, c, s), mask, client["params"], server["params"])
        args = (start, client["batch_stats"], mask, data, key, la_epochs)
        if frozen_bn_from:
            # one branch runs (the round index is the cohort's, not a vmapped value, so this stays a cond)
            params, stats, metrics = jax.lax.cond(info.round >= frozen_bn_from,
                                                  lambda: local_alt(trainer, frozen_loss_fn, *args),
                                                  lambda: local_alt(trainer, loss_fn, *args))
        else:
            params, stats, metrics = local_alt(trainer, loss_fn, *args)
        r = info.round
        grow_now = (r % grow_every == 0) & (r > 0)
        ref = client["ref"] if delta_ref == "snapshot" else start
        eligible = path_mask(params, lambda path: is_maskable(path, mask_biases))
        grown = tree_grow_mask(mask, params, ref, grow_rate, alpha, eligible)
        pending = jax.tree_util.tree_map(lambda g, m: jnp.where(grow_now, g, m), grown, mask)
        new_ref = jax.tree_util.tree_map(lambda p, q: jnp.where(grow_now, p, q), params, client["ref"])
        metrics = dict(metrics, personal_fraction=tree_density(pending), uploaded=tree_size(mask) - tree_count(mask))
        return dict(client, params=params, batch_stats=stats, pending=pending, ref=new_ref), metrics

    def aggregate(server, clients, weights, info: RoundInfo):
        w = weights if weight_by_n else member_weights(weights)
        final = info.is_last
        avg = jax.tree_util.tree_map(lambda x, m, prev: masked_mean(x, w, ~m, prev),
                                     clients["params"], clients["mask"], server["params"])
        # Broadcast into each client's global entries (old mask); the final round keeps the trained models.
        params = jax.tree_util.tree_map(lambda x, m, a: jnp.where(m | final, x, a[None]),
                                        clients["params"], clients["mask"], avg)
        server_params = jax.tree_util.tree_map(lambda a, prev: jnp.where(final, prev, a), avg, server["params"])
        clients = dict(clients, params=params, mask=clients["pending"])
        if aggregate_batch_stats:  # every client gets the weighted mean (not in the final round)
            clients["batch_stats"] = jax.tree_util.tree_map(
                lambda x: jnp.where(final, x, weighted_mean(x, weights)[None]), clients["batch_stats"])
        return {"params": server_params}, clients

    def predict(server, client, x, client_id=None):
        return model.apply({"params": client["params"], "batch_stats": client["batch_stats"]}, x, train=False)

    # the trained row holds the client's whole model (personal and global entries after LocalAlt)
    return Algorithm("fedselect", init, local_update, aggregate, predict, predict)

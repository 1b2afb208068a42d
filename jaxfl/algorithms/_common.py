"""Pieces the algorithms share: the parameter groups, the cross-entropy loss of the ``LocalTrainer`` contract,
model variables, predictors, freezing parameter groups, (logits, representation) forward passes, class feature
sums, and evaluation after fine-tuning."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from ..core.metrics import cross_entropy, weighted_mean_loss
from ..core.trainer import LocalTrainer, batch_of, num_positions
from ..core.trees import PathPredicate, path_mask
from ..core.types import Algorithm
from ..data.clients import ClientData
from ..errors import ConfigError
from ..models import MLPHead


def is_batchnorm(path: tuple[str, ...]) -> bool:
    """True for leaves inside a BatchNorm module (modules named ``bn*`` or ``BatchNorm*``)."""
    return any(k.startswith("bn") or k.startswith("BatchNorm") for k in path)


def in_part(*parts: str) -> PathPredicate:
    """Predicate: the leaf's top-level key (e.g. "encoder", "head") is one of ``parts``."""
    return lambda path: path[0] in parts


def ce_loss(model, prox_mu: float = 0.0, train: bool = True):
    """loss_fn(params, stats, x, y, w, key, anchor) = weighted CE + prox_mu/2 ||params - anchor||^2.

    Returns (loss, (new_batch_stats, logits)), the LocalTrainer contract; ``anchor`` (the parameters the
    client started the round from) enters only when prox_mu != 0; ``key`` drives dropout, if the model has any.
    ``train=False`` runs the model as at evaluation (torch's ``model.eval()``: BatchNorm normalises with its
    running statistics, which the step returns unchanged; no dropout) while the gradient still flows.
    """
    def loss_fn(params, stats, x, y, w, key, anchor=None):
        if train:
            logits, updated = model.apply({"params": params, "batch_stats": stats}, x, train=True, mask=w,
                                          mutable=["batch_stats"], rngs=None if key is None else {"dropout": key})
        else:
            logits, updated = model.apply({"params": params, "batch_stats": stats}, x, train=False), \
                {"batch_stats": stats}
        loss = weighted_mean_loss(cross_entropy(logits, y), w)
        if prox_mu:
            loss = loss + 0.5 * prox_mu * optax.tree.norm(optax.tree.sub(params, anchor), squared=True)
        return loss, (updated["batch_stats"], logits)
    return loss_fn


AUX_STREAM = 2 ** 31 - 1  # far past any epoch index: LocalTrainer's epoch e draws from fold_in(key, e)


def aux_key(key, i: int = 0):
    """A client's round key for randomness beside its local training (candidate draws, data windows): a stream
    that no epoch of ``LocalTrainer.run(key)`` shares."""
    return jax.random.fold_in(jax.random.fold_in(key, AUX_STREAM), i)


def model_variables(state):
    """The model's {"params", "batch_stats"} out of a server or client state that also holds other things
    (control variates, drifts, masks, a personal head)."""
    return {"params": state["params"], "batch_stats": state["batch_stats"]}


def num_classes(model, variables, x) -> int:
    """K, the size of the model's logits [B, K] on inputs x (shapes only: nothing is computed)."""
    return jax.eval_shape(lambda: model.apply(variables, x[:1], False)).shape[-1]


def feature_dim(model, variables, x, representation: str = "features") -> int:
    """d, the size of the ``representation`` (``logits_and_representation``; default the encoder output) on
    preprocessed inputs x (shapes only: nothing is computed)."""
    forward = logits_and_representation(representation)
    return jax.eval_shape(lambda: model.apply(variables, x[:1], False, None, method=forward)[1]).shape[-1]


def global_model_predictors(model):
    """(predict, predict_trained) of a method whose clients predict with the server's model: evaluation-mode
    ``model.apply`` of the server's, respectively the just-trained row's, params and BN statistics."""
    def predict(server, client, x, client_id=None):
        return model.apply(model_variables(server), x, train=False)

    def predict_trained(server, trained, x, client_id=None):
        return model.apply(model_variables(trained), x, train=False)

    return predict, predict_trained


def init_variables(model, trainer: LocalTrainer, key, sample_x):
    """{"params", "batch_stats"} of ``model`` initialised on one preprocessed sample (batch_stats {} if none)."""
    variables = model.init(key, trainer.preprocess(sample_x[:1]), train=False)
    return {"params": variables["params"], "batch_stats": variables.get("batch_stats", {})}


def only(tx: optax.GradientTransformation, trainable) -> optax.GradientTransformation:
    """``tx`` on the leaves where ``trainable(path)`` holds; zero updates (frozen) elsewhere."""
    labels = lambda params: jax.tree_util.tree_map(
        lambda t: "train" if t else "freeze", path_mask(params, trainable))
    return optax.multi_transform({"train": tx, "freeze": optax.set_to_zero()}, labels)


REPRESENTATIONS = ("penultimate", "features")


def logits_and_representation(representation: str = "penultimate"):
    """A ``Classifier`` method (for ``model.apply(..., method=...)``): (logits, representation) in one pass.

    "penultimate": the input of the head's last Dense (the last hidden ReLU of an ``MLPHead`` with hidden
    layers; the encoder output z otherwise); "features": the encoder output z.
    """
    if representation not in REPRESENTATIONS:
        raise ValueError(f"representation {representation!r} is not one of {REPRESENTATIONS}")

    def forward(module, x, train: bool = False, mask=None):
        z = module.encoder(x, train, mask)
        head = module.head
        if representation == "penultimate" and isinstance(head, MLPHead) and len(head.hidden):
            logits, taps = head(z, train, mask, taps=True)
            return logits, taps[f"relu{len(head.hidden)}"]
        return head(z, train, mask), z
    return forward


def head_on(module, z, train: bool = False, mask=None):
    """A ``Classifier`` method (``model.apply(variables, z, method=head_on)``): the head's logits on features z
    that the caller computed (gated, shifted or biased representations)."""
    return module.head(z, train, mask)


def head_dense_names(head_params) -> list[str]:
    """The names of a head's Dense layers, first to last (``fc1``, ``fc2``, ...; ``MLPHead``'s naming)."""
    return sorted((k for k in head_params if k.startswith("fc") and k[2:].isdigit()), key=lambda k: int(k[2:]))


def head_dense_kernels(head_params) -> list:
    """The kernels [d_in, d_out] of a head's Dense layers, first to last (``head_dense_names``)."""
    return [head_params[k]["linear"]["kernel"] for k in head_dense_names(head_params)]


def class_feature_sums(model, variables, data: ClientData, num_classes: int, batch_size: int, preprocess,
                       representation: str = "features"):
    """Over a client's real samples, in evaluation mode: S1 [C, d] = sum_{y=k} z, S2 [C] = sum_{y=k} ||z||^2,
    N [C] = #{y = k}, with z = f(x) the ``representation`` (``logits_and_representation``; default the encoder
    output); in batches, skipping the padding."""
    b, m = batch_size, num_positions(data)
    n_steps = (data.count + b - 1) // b
    forward = logits_and_representation(representation)
    features = lambda x: model.apply(variables, preprocess(x), False, None, method=forward)[1]

    def step(t, sums):
        idx = t * b + jnp.arange(b)
        w = (idx < data.count).astype(jnp.float32)
        idx = jnp.minimum(idx, m - 1)
        x, y = batch_of(data, idx)
        z = features(x)
        onehot = jax.nn.one_hot(y, num_classes) * w[:, None]
        s1, s2, n = sums
        return s1 + onehot.T @ z, s2 + onehot.T @ jnp.sum(z * z, -1), n + jnp.sum(onehot, 0)

    d = jax.eval_shape(features, batch_of(data, jnp.zeros(1, jnp.int32))[0]).shape[-1]
    zeros = (jnp.zeros((num_classes, d)), jnp.zeros(num_classes), jnp.zeros(num_classes))
    return jax.lax.fori_loop(0, n_steps, step, zeros)


def with_fine_tuning(base: Algorithm, model, trainer: LocalTrainer, ft_epochs: int, *, start: Callable,
                     parts: tuple[str, ...] | None = None, reuse_trained: bool = False,
                     name: str | None = None) -> Algorithm:
    """``base`` whose clients are evaluated with a model fine-tuned from the global model they received.

    start(server, base_client) -> {"params", "batch_stats"}: the model a client fine-tunes from (its round's
        starting model). parts: the parameter groups fine-tuned ("encoder", "head"; None: all).
    reuse_trained: the base's trained row *is* the fine-tune (same start, loss, epochs, key): keep it.
    Client state: {"base": the base's client state, "tuned": the fine-tuned model}; the base's server unchanged.
    The fine-tuning run uses the client's round key (so for FedAvg with ft_epochs = E it equals the training),
    and all ``ft_epochs`` also for a straggler (evaluation does not depend on who straggled this round).
    """
    name = name or base.name
    if ft_epochs == 0:
        return base._replace(name=name)
    tx = trainer.tx if parts is None else only(trainer.tx, in_part(*parts))
    ft = dataclasses.replace(trainer, tx=tx, epochs=ft_epochs)
    loss = ce_loss(model)

    def init(key, sample_x):
        server, client = base.init(key, sample_x)
        return server, {"base": client, "tuned": start(server, client)}

    def local_update(server, client, data: ClientData, key, info):
        trained, metrics = base.local_update(server, client["base"], data, key, info)
        if reuse_trained and data.work is None:
            tuned = model_variables(trained)
        else:  # the evaluation's fine-tune runs all its epochs, straggler or not
            v = start(server, client["base"])
            p, s, _, ft_metrics = ft.run(loss, v["params"], v["batch_stats"], tx.init(v["params"]),
                                         data.replace(work=None), key)
            tuned = {"params": p, "batch_stats": s}
            metrics = dict(metrics, ft_loss=ft_metrics["loss"])
        return {"base": trained, "tuned": tuned}, metrics

    def aggregate(server, trained, weights, info):
        server, clients = base.aggregate(server, trained["base"], weights, info)
        return server, {"base": clients, "tuned": trained["tuned"]}

    def predict(server, client, x, client_id=None):
        return model.apply(client["tuned"], x, train=False)

    def predict_trained(server, trained, x, client_id=None):
        return model.apply(trained["tuned"], x, train=False)

    return Algorithm(name, init, local_update, aggregate, predict, predict_trained)


def client_lr(trainer: LocalTrainer, lr: float | None = None, name: str = "scaffold", option: str = "lr") -> float:
    """The client learning rate an update divides by: ``lr`` (the algorithm's option) if given, else the
    trainer's ``ClientOptimizer.lr``; a ConfigError naming the option when neither is known (a trainer built
    from another optax transformation)."""
    if lr is not None:
        return float(lr)
    if trainer.optimizer is None:
        raise ConfigError(f"{name} needs the client learning rate: build the LocalTrainer from a ClientOptimizer "
                          f"or pass --{name}.{option.replace('_', '-')}")
    return float(trainer.optimizer.lr)

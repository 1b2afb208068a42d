"""Sub-model training shared by HeteroFL, FedDrop, FedMP, NeFL and DapperFL: device levels, the layers of a
model in forward order, per-entry masks from per-layer unit masks, width and pruning masks, and the
sub-model algorithm whose server takes a per-entry masked mean.

A client's sub-model is the full model times a 0/1 mask M_i per entry, so every client trains in one jit: the
loss is evaluated at w * M_i (gradients of cut entries are 0), and the server averages each entry over the
clients whose sub-model holds it (``aggregation.masked_mean``):

    W[e] <- sum_i c_i M_i[e] w_i[e] / sum_i c_i M_i[e]   (W[e] unchanged when no client holds e)
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from ..core.aggregation import masked_mean, member_weights
from ..core.metrics import cross_entropy, weighted_mean_loss
from ..core.trainer import LocalTrainer
from ..core.trees import leaf_paths, map_with_paths
from ..core.types import Algorithm, RoundInfo
from ..data.clients import ClientData
from ..errors import ConfigError
from ..ops.masks import channel_mask, in_out_channel_mask, magnitude_mask, tree_count, tree_density
from ._common import init_variables, model_variables


CNN_MODELS = ("digits_cnn", "small_cnn", "fedavg_cnn", "pfl_cnn", "alexnet_bn", "resnet10", "resnet10_slim",
              "resnet18", "resnet18_imagenet")
DEVICE_RATIOS = (0.0, 0.2, 0.4, 0.6, 0.8)  # capability levels C1..C5 (paper section 4)


def client_ratio(ratios, info: RoundInfo):
    """rho of the client: its device level ``ratios[id mod L]``; ratios [L] -> []."""
    return ratios[info.client_id % ratios.shape[0]]


def check_ratios(name: str, ratios, below_one: bool = True) -> None:
    """ConfigError unless ``ratios`` holds at least one ratio, each below 1 if ``below_one`` (a sub-model
    method: a ratio of 1 leaves no model; DapperFL allows pruning everything prunable)."""
    if not ratios:
        raise ConfigError(f"{name}.device_ratios must hold at least one ratio in [0, {'1)' if below_one else '1]'}")
    if below_one and max(ratios) >= 1.0:
        raise ConfigError(f"{name}.device_ratios must be below 1 (a ratio of 1 leaves no model), got {ratios}")


class Layer(NamedTuple):
    """A conv / dense layer (``kind`` "conv" | "dense") or a BatchNorm ("bn") in forward order.

    path: its module path in the params tree; n_in / n_out: input and output units (BN: channels);
    producer: index of the layer whose output units feed it (None: the model input); tile: for a dense layer
    after a flatten, its input index e has unit e % C of the producer (tile = in // C), else 1;
    last: the model's output layer; feeds_bn: a BatchNorm normalises its output; stream: the residual stream
    (ResNet stage) its output is added to, or None.
    """
    path: tuple
    kind: str
    n_in: int
    n_out: int
    producer: int | None
    tile: int = 1
    last: bool = False
    feeds_bn: bool = False
    stream: int | None = None


def _residual_stream(path) -> int | None:
    """The ResNet stage whose residual sum this layer's output enters (``models.ResNetEncoder`` names)."""
    if path[-1] == "conv_stem":
        return 1
    if len(path) > 1 and path[-1] in ("conv2", "conv_shortcut") and path[-2].startswith("layer"):
        return int(path[-2][len("layer"):].split("_")[0])
    return None


def forward_layers(model, sample_x) -> tuple[Layer, ...]:
    """The model's conv / dense / BatchNorm layers in the order the forward pass calls them (traced once with
    ``flax.linen.intercept_methods`` on an abstract init; no computation). A layer's producer is the latest
    earlier conv / dense layer whose output width equals its input width (a dense layer whose input is a
    multiple C k of it: a flatten of C channels); a BatchNorm's producer is the latest conv / dense layer.
    """
    called = []

    def record(next_fun, args, kwargs, context):
        if context.method_name == "__call__":
            called.append((type(context.module).__name__, tuple(context.module.path)))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        shapes = jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False), sample_x)
    flat = {k: v.shape for k, v in traverse_util.flatten_dict(shapes["params"]).items()}
    layers: list[Layer] = []
    seen = set()
    for cls, path in called:
        if path in seen:
            continue
        kernel = flat.get(path + ("kernel",))
        if kernel is not None and len(kernel) in (2, 4):
            seen.add(path)
            n_in, n_out = kernel[-2], kernel[-1]
            producer, tile = None, 1
            for j in range(len(layers) - 1, -1, -1):
                p = layers[j]
                if p.kind == "bn":
                    continue
                if p.n_out == n_in:
                    producer = j
                    break
                if len(kernel) == 2 and n_in % p.n_out == 0:
                    producer, tile = j, n_in // p.n_out
                    break
            layers.append(Layer(path, "conv" if len(kernel) == 4 else "dense", n_in, n_out, producer, tile,
                                stream=_residual_stream(path)))
        elif cls == "BatchNorm" and path + ("scale",) in flat:
            seen.add(path)
            producer = max(j for j, p in enumerate(layers) if p.kind != "bn")
            c = flat[path + ("scale",)][0]
            layers.append(Layer(path, "bn", c, c, producer))
            layers[producer] = layers[producer]._replace(feeds_bn=True)
    last = max(j for j, p in enumerate(layers) if p.kind != "bn")
    layers[last] = layers[last]._replace(last=True)
    return tuple(layers)


def unit_masks_to_params(layers, units, params, stats, label_units=None):
    """Per-entry 0/1 masks {"params", "batch_stats"} of params' / stats' structure from per-layer output-unit
    masks ``units[j]`` ([n_out] floats for every conv / dense layer j; the last layer's are ignored: all kept).

    kernel [..., in, out]: in-units (the producer's units, tiled after a flatten; all ones for the model
    input) x out-units; bias: out-units; BatchNorm scale / bias / mean / var: its producer's units; every
    other leaf: ones. ``label_units`` [K]: optional out-units of the last layer (HeteroFL label masking).
    """
    flat_p = traverse_util.flatten_dict(params)
    flat_s = traverse_util.flatten_dict(stats) if stats else {}
    mp = {k: jnp.ones_like(v) for k, v in flat_p.items()}
    ms = {k: jnp.ones_like(v) for k, v in flat_s.items()}

    def out_units(j):
        layer = layers[j]
        if layer.last:
            ones = jnp.ones((layer.n_out,), jnp.float32)
            return ones if label_units is None else label_units.astype(jnp.float32)
        return units[j]

    for j, layer in enumerate(layers):
        if layer.kind == "bn":
            u = out_units(layer.producer)
            for name in ("scale", "bias"):
                if layer.path + (name,) in mp:
                    mp[layer.path + (name,)] = u
            for name in ("mean", "var"):
                if layer.path + (name,) in ms:
                    ms[layer.path + (name,)] = u
            continue
        u_out = out_units(j)
        u_in = (jnp.ones((layer.n_in,), jnp.float32) if layer.producer is None
                else jnp.tile(out_units(layer.producer), layer.tile))
        kernel = flat_p[layer.path + ("kernel",)]
        mp[layer.path + ("kernel",)] = jnp.broadcast_to(u_in[:, None] * u_out[None, :], kernel.shape)
        if layer.path + ("bias",) in mp:
            mp[layer.path + ("bias",)] = u_out
    return {"params": traverse_util.unflatten_dict(mp),
            "batch_stats": traverse_util.unflatten_dict(ms) if flat_s else stats}


def width_units(layers, rate):
    """HeteroFL's units: the first ceil(rate C) of every layer's C outputs (rate may be traced). A tolerance of
    1e-4 absorbs float error (0.6 x 5 is 3, not 4)."""
    units = {}
    for j, layer in enumerate(layers):
        if layer.kind != "bn":
            keep = jnp.ceil(rate * layer.n_out - 1e-4)
            units[j] = (jnp.arange(layer.n_out) < keep).astype(jnp.float32)
    return units


def width_masks(layers, params, stats, rate, label_units=None):
    """Per-entry masks of the width-``rate`` sub-model (``width_units`` + ``unit_masks_to_params``)."""
    return unit_masks_to_params(layers, width_units(layers, rate), params, stats, label_units)


def scaler_tree(layers, params, rate):
    """HeteroFL's Scaler as a per-leaf factor: 1 / rate on the kernel and bias of every hidden conv / dense
    layer that feeds no BatchNorm, 1 elsewhere (a tree of params' structure with scalar leaves)."""
    flat = {k: 1.0 for k in traverse_util.flatten_dict(params)}
    for layer in layers:
        if layer.kind != "bn" and not layer.last and not layer.feeds_bn:
            for name in ("kernel", "bias"):
                if layer.path + (name,) in flat:
                    flat[layer.path + (name,)] = 1.0 / rate
    return traverse_util.unflatten_dict(flat)


def present_labels(data: ClientData, num_classes: int):
    """1.0 for every class among the client's real training samples (HeteroFL's ``label_split``)."""
    real = (jnp.arange(data.y.shape[0]) < data.count).astype(jnp.float32)
    return jnp.zeros((num_classes,), jnp.float32).at[data.y].max(real)


def masked_loss(model, mask, factor=None, label_units=None):
    """LocalTrainer loss of the sub-model: CE of the model at params * mask (* factor), logits of absent
    classes set to 0 when ``label_units`` is given. Returns (loss, (new_batch_stats, logits))."""
    def loss(params, stats, x, y, w, key):
        eff = jax.tree_util.tree_map(jnp.multiply, params, mask)
        if factor is not None:
            eff = jax.tree_util.tree_map(jnp.multiply, eff, factor)
        logits, upd = model.apply({"params": eff, "batch_stats": stats}, x, train=True, mask=w,
                                  mutable=["batch_stats"], rngs={"dropout": key})
        if label_units is not None:
            logits = jnp.where(label_units > 0, logits, 0.0)
        return weighted_mean_loss(cross_entropy(logits, y), w), (upd["batch_stats"], logits)
    return loss


def tree_masked_mean_of(trained, masks, weights, previous):
    """``masked_mean`` leaf by leaf: trained / masks stacked [k, ...], previous [...]."""
    return jax.tree_util.tree_map(lambda x, m, p: masked_mean(x, weights, m, p), trained, masks, previous)


def submodel_algorithm(name: str, model, trainer: LocalTrainer, *, masks: Callable, aggregate_stats: str = "masked",
                       uniform: bool = False, factor: Callable | None = None, label_mask: bool = False,
                       prepare: Callable | None = None, finish: Callable | None = None,
                       grad_clip: float = 0.0) -> Algorithm:
    """A sub-model method: each client trains the global model under a per-entry 0/1 mask, the server takes the
    per-entry masked mean over the clients holding each entry (``masked_mean``; entries no client holds keep W).

    masks(layers, variables, rho_index_info) -> {"params", "batch_stats"} masks: called as
        masks(layers, server, client_variables, data, key, info, label_units).
    aggregate_stats: "masked" (statistics averaged per channel over the clients holding it).
    uniform: every client weighs 1 (count mean) instead of the engine's weights.
    factor(layers, params, info) -> per-leaf training factors (HeteroFL's Scaler) or None.
    label_mask: HeteroFL's label masking. prepare(server, info) -> the client's start variables (NeFL: its
    submodel's BatchNorm); finish(server, new_server, trained, weights, info) -> the server state (NeFL's table).
    grad_clip: c > 0 scales every local step's gradient g to g min(1, c / ||g||_2) (the global norm over the
    sub-model's entries; torch's ``clip_grad_norm_`` before ``optimizer.step``), 0 for none.
    """
    cache = {}
    if grad_clip > 0:  # clipped before the optimizer adds weight decay and momentum, as torch orders them
        trainer = dataclasses.replace(trainer, tx=optax.chain(optax.clip_by_global_norm(grad_clip), trainer.tx))

    def layers_of(x):
        shape = (1,) + tuple(x.shape[1:])
        if shape not in cache:
            cache[shape] = forward_layers(model, trainer.preprocess(jnp.zeros(shape, x.dtype)))
        return cache[shape]

    def init(key, sample_x):
        return init_variables(model, trainer, key, sample_x), {}  # a client keeps nothing

    def local_update(server, client, data: ClientData, key, info: RoundInfo):
        layers = layers_of(data.x)
        v = prepare(server, info) if prepare is not None else {"params": server["params"],
                                                                 "batch_stats": server["batch_stats"]}
        k_out = layers[[j for j, layer in enumerate(layers) if layer.last][0]].n_out
        labels = present_labels(data, k_out) if label_mask else None
        m, extra = masks(layers, v, data, jax.random.fold_in(key, 7), info, labels)
        f = factor(layers, v["params"], info) if factor is not None else None
        opt = trainer.tx.init(v["params"])
        params, stats, _, metrics = trainer.run(masked_loss(model, m["params"], f, labels), v["params"],
                                                v["batch_stats"], opt, data, key)
        metrics = dict(metrics, kept_params=tree_count(m["params"]), kept_fraction=tree_density(m["params"]),
                       **extra)
        return {"params": params, "batch_stats": stats, "mask": m}, metrics

    def aggregate(server, clients, weights, info: RoundInfo):
        w = member_weights(weights) if uniform else weights
        params = tree_masked_mean_of(clients["params"], clients["mask"]["params"], w, server["params"])
        if aggregate_stats == "masked":
            stats = tree_masked_mean_of(clients["batch_stats"], clients["mask"]["batch_stats"], w,
                                        server["batch_stats"])
        else:  # DapperFL's released code: statistics averaged with the weights, unmasked
            stats = jax.tree_util.tree_map(lambda x: masked_mean(x, w, 1.0, x[0]), clients["batch_stats"])
        new = dict(server, params=params, batch_stats=stats)
        if finish is not None:
            new = finish(server, new, clients, w, info)
        return new, {}

    def predict(server, client, x, client_id=None):
        return model.apply(model_variables(server), x, train=False)

    def predict_trained(server, trained, x, client_id=None):  # the client's own sub-model
        params = jax.tree_util.tree_map(jnp.multiply, trained["params"], trained["mask"]["params"])
        return model.apply({"params": params, "batch_stats": trained["batch_stats"]}, x, train=False)

    return Algorithm(name, init, local_update, aggregate, predict, predict_trained)


def pruning_masks(params, ratio):
    """The spec's per-layer pruning masks (0/1 floats of params' structure) at ``ratio`` (may be traced):

    - stem conv and stem BN (paths with "stem"), biases: never pruned;
    - the first block's first conv (``layer1_0/conv1``) and the first shortcut conv: output channels only
      (L1 norm over the other axes);
    - every other conv kernel: input mask x output mask, each at ``ratio`` (L1), the output channels scored on
      the input-masked kernel (the released code's two ``ln_structured`` calls; the spec says "independently",
      which torch does not do);
    - BN scales (not the stem's): unstructured, the round(ratio C) smallest |gamma| are zeroed;
    - the final Dense kernel [in, K] of the head: input rows by their L2 norm over the outputs.
    Kept per group: n - round(ratio n) (half to even), the largest scores; ties keep the lower index.
    """
    paths = leaf_paths(params)
    first_shortcut = next((p for p in paths if p[-2:] == ("conv_shortcut", "kernel")), None)
    head_kernels = [p for p in paths if p[0] == "head" and p[-1] == "kernel"]
    last_head = head_kernels[-1] if head_kernels else None

    def rule(path, leaf):
        name = path[-1]
        if name == "bias" or any("stem" in k for k in path):
            return jnp.ones_like(leaf)
        if name == "scale":
            return magnitude_mask(leaf, ratio)
        if name != "kernel":
            return jnp.ones_like(leaf)
        if path == last_head:
            return channel_mask(leaf, ratio, axis=0, ord=2)
        if path[-2:] == ("conv1", "kernel") and "layer1_0" in path or path == first_shortcut:
            return channel_mask(leaf, ratio, axis=-1, ord=1)
        return in_out_channel_mask(leaf, ratio, ord=1)

    return map_with_paths(rule, params)

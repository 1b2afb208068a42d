"""FedDrop / Federated Dropout (Caldas, Konecny, McMahan & Talwalkar 2018, "Expanding the reach of federated
learning by reducing client resource requirements"): each client trains a random sub-model of the global model.

Round t, client i with drop ratio rho_i = ``device_ratios[i mod L]`` (default DapperFL's capability levels
(0, 0.2, 0.4, 0.6, 0.8); the ``digits`` / ``office`` presets: 0.6 for every client), on jaxfl's sub-model
machinery (``_submodel.py``):
1. for every conv / dense layer with C output units (filters / activations) but the output layer, keep a random
   subset of C - round(rho_i C) units (``masks.keep_largest`` of uniform scores drawn from the client's round
   key, so fixed for the round and different per client and round); layers whose outputs are summed in one
   ResNet residual stream share one draw, so the residual sums stay consistent; a layer's inputs are its
   producer's kept units; the image channels and the classes are never dropped;
2. trains w * M_i for E epochs (cut entries get zero gradient);
3. the server averages each entry over the clients that trained it (``aggregation.masked_mean`` with the
   engine's client weights, FedAvg's); an entry nobody trained keeps W:

    W[e] <- sum_i n_i M_i[e] w_i[e] / sum_i n_i M_i[e].

BatchNorm: a client tracks running statistics of its kept channels; each channel's statistics are averaged over
the clients that kept it (cut channels never see data). Kept units are not rescaled (Federated Dropout trains a
smaller dense model, not inverted dropout). Nothing is kept per client; evaluation uses the global model.
With ratio 0 it is FedAvg.

Deviations:
- The default ratios are the device levels shared with the other sub-model baselines, not the paper's one
  uniform ratio for all clients (the ``digits`` / ``office`` presets are that: 0.6, DapperFL's FedDrop runs).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RunContext
from ..ops.masks import keep_largest
from ._registry import register
from ._submodel import CNN_MODELS, DEVICE_RATIOS, check_ratios, client_ratio, submodel_algorithm, unit_masks_to_params


def random_units(layers, key, ratio):
    """Per layer a random 0/1 unit mask keeping C - round(ratio C) of its C outputs; layers of one residual
    stream (``Layer.stream``) share a draw. Returns {layer index: [C] float}."""
    units = {}
    for j, layer in enumerate(layers):
        if layer.kind == "bn":
            continue
        tag = 1000 + layer.stream if layer.stream is not None else j
        scores = jax.random.uniform(jax.random.fold_in(key, tag), (layer.n_out,))
        units[j] = keep_largest(scores, ratio).astype(jnp.float32)
    return units


@dataclasses.dataclass(frozen=True)
class FedDropOptions(Options):
    name = "feddrop"
    models = CNN_MODELS
    sharing = ("everything (global model), each client's random sub-model of the round; each entry averaged "
               "over the clients that trained it", "nothing (its drop ratio follows from its id)")
    # DapperFL's runs (best_args.py, Digits and Office-Caltech): one uniform drop ratio 0.6 for every client
    presets = {"digits": {"device_ratios": (0.6,)}, "office": {"device_ratios": (0.6,)}}
    device_ratios: tuple[float, ...] | None = option(None, "drop ratio per device level, comma-separated; client "
                                                     "i gets level i mod len (default: DapperFL's levels 0, 0.2, "
                                                     "..., 0.8; digits / office: 0.6 for all, DapperFL's runs)",
                                                     lo=0.0, hi=1.0)
    grad_clip: float = option(0.0, "clip every local step's gradient to this global L2 norm (0: none, as "
                              "DapperFL's comparison code trains it)", lo=0.0)

    def check(self) -> None:
        if self.device_ratios is not None:
            check_ratios("feddrop", self.device_ratios)

@register(FedDropOptions)
def feddrop(model, trainer: LocalTrainer, o: FedDropOptions, ctx: RunContext) -> Algorithm:
    """Federated Dropout on a CNN ``Classifier``; options: ``FedDropOptions``."""
    device_ratios = DEVICE_RATIOS if o.device_ratios is None else o.device_ratios
    ratios = jnp.asarray(device_ratios, jnp.float32)

    def masks(layers, v, data, key, info, labels):
        rho = client_ratio(ratios, info)
        units = random_units(layers, key, rho)
        return unit_masks_to_params(layers, units, v["params"], v["batch_stats"]), {"ratio": rho}

    return submodel_algorithm("feddrop", model, trainer, masks=masks, grad_clip=o.grad_clip)

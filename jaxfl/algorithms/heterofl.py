"""HeteroFL (Diao, Ding & Tarokh, ICLR 2021): width-scaled sub-models of one global model, aggregated per entry.

Client i has a device level rho_i = ``device_ratios[i mod L]`` (default DapperFL's levels 0, 0.2, ..., 0.8,
``_submodel.DEVICE_RATIOS``) and trains the sub-model of width rate r_i = 1 - rho_i: in every conv / dense layer
with C outputs it keeps the first ceil(r_i C) output units; a layer's inputs are its producer's kept units (the
image channels and the classes are never cut). The sub-model is the full model times a 0/1 mask M_i per entry
(``width_masks``), so every client trains in one jit: the loss is evaluated at w * M_i (gradients of cut entries
are 0). The server averages each entry over the clients whose sub-model holds it (``aggregation.masked_mean``):

    W[e] <- sum_i c_i M_i[e] w_i[e] / sum_i c_i M_i[e]   (W[e] unchanged when no client holds e)

with c_i = 1 (``uniform`` = True, a count mean) or the engine's client weights.
- Scaler (``scale`` = True): in training a hidden layer's output is divided by r_i (identity in evaluation),
  applied to the kernels and biases of hidden layers that feed no BatchNorm.
- Label masking (``label_mask`` = True): the logits of classes absent from a client's training data are set
  to 0 in its loss, and it does not contribute to those classes' rows of the output layer.
- Per client state: none (the width follows from the client id); server: the global model. Evaluation uses the
  global (full-width) model; ``predict_trained`` a client's own sub-model. With all ratios 0 and label masking
  off it is FedAvg. The sub-model machinery, shared with FedDrop, FedMP and NeFL, is in ``_submodel.py``.

Deviations:
- BatchNorm: the official code keeps no running statistics in training and recomputes them for evaluation with
  the global model over all training data (static BN, "sBN"). A server here never sees data, so each client
  tracks running statistics of its sub-model's channels (momentum 0.1) and the server averages every channel's
  statistics over the clients that hold it, as the parameters (cut channels' statistics are never averaged in).
- A layer followed by a BatchNorm is left unscaled by the Scaler: BatchNorm cancels the factor in the training
  forward (up to eps) and the factor would only bias the running statistics averaged above.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RunContext
from ._registry import register
from ._submodel import (CNN_MODELS, DEVICE_RATIOS, check_ratios, client_ratio, scaler_tree, submodel_algorithm,
                        width_masks)


@dataclasses.dataclass(frozen=True)
class HeteroFLOptions(Options):
    name = "heterofl"
    models = CNN_MODELS
    sharing = ("everything (global model), each client's sub-model: the first ceil((1 - rho) C) units of every "
               "layer; each entry averaged over the clients holding it", "nothing (its width follows from its id)")
    device_ratios: tuple[float, ...] = option(DEVICE_RATIOS, "cut ratio rho per device level (width 1 - rho), "
                                              "comma-separated; client i gets level i mod len", lo=0.0, hi=1.0)
    uniform: bool = option(True, "average each entry uniformly over its holders (official count mean); "
                           "--no-: with the engine's client weights")
    scale: bool = option(True, "divide hidden outputs not followed by BatchNorm by the width rate in training "
                         "(the Scaler)")
    label_mask: bool = option(True, "zero the logits of classes absent from a client's data and keep its "
                              "update out of their output rows (official mask=1)")
    grad_clip: float = option(1.0, "clip every local step's gradient to this global L2 norm (the released "
                              "code's clip_grad_norm_(params, 1)); 0: no clipping", lo=0.0)

    def check(self) -> None:
        check_ratios("heterofl", self.device_ratios)

@register(HeteroFLOptions)
def heterofl(model, trainer: LocalTrainer, o: HeteroFLOptions, ctx: RunContext) -> Algorithm:
    """HeteroFL on a CNN ``Classifier``; options: ``HeteroFLOptions``."""
    ratios = jnp.asarray(o.device_ratios, jnp.float32)

    def masks(layers, v, data, key, info, labels):
        rate = 1.0 - client_ratio(ratios, info)
        return width_masks(layers, v["params"], v["batch_stats"], rate, labels), {"rate": rate}

    factor = (lambda layers, params, info: scaler_tree(layers, params, 1.0 - client_ratio(ratios, info))) \
        if o.scale else None
    return submodel_algorithm("heterofl", model, trainer, masks=masks, uniform=o.uniform, factor=factor,
                              label_mask=o.label_mask, grad_clip=o.grad_clip)

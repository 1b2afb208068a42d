"""NeFL (Kang, Cha, Shin, Lee & Kang 2023, "NeFL: Nested federated learning for heterogeneous clients"), width
scaling (NeFL-W) as DapperFL's comparison configures it: nested width-scaled submodels whose consistent
parameters are shared and averaged per entry, and inconsistent parameters (BatchNorm) kept per submodel.

Submodels: k = 0..K-1 with model size ps[k]; width-only scaling keeps the first ceil(sqrt(ps[k]) C) units of
every layer (parameter size = width^2), so the defaults are widths 0.2 ... 1. Client i with device level
rho_i = ``device_ratios[i mod L]`` trains the largest submodel of width <= 1 - rho_i (the defaults pair
DapperFL's levels 0, 0.2, ..., 0.8 with submodels 4, 3, ..., 0).

- Consistent parameters (conv / dense kernels and biases): nested per-entry average over the clients whose
  submodel holds the entry, each client weighing 1 (1 / acc_num; ``uniform``), entries no client trained keep
  W (``aggregation.masked_mean``).
- Inconsistent parameters: every BatchNorm (scale, bias and running statistics) exists once per submodel on the
  server (table [K, ...]); a client starts from its submodel's copy and the copy is averaged over that
  submodel's clients only (1 / b_k); a submodel nobody trained keeps its copy. The global model (evaluation)
  uses the largest submodel's BatchNorm.
- Per client: nothing; server: the global model and the K BatchNorm copies.

Options: ``ps`` (0.04, 0.16, 0.36, 0.64, 1), ``device_ratios`` (0, 0.2, 0.4, 0.6, 0.8), ``uniform`` True.
With one submodel of size 1 (or all clients at rho 0) it is FedAvg with BatchNorm shared.

Deviations:
- Learnable step sizes (NeFL's per-block residual scalars, ``learnable_step``, inconsistent per-submodel scalars
  initialised to 1) are not modelled: jaxfl's ResNet has no such parameter.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import traverse_util

from ..core.aggregation import masked_mean
from ..core.options import Options, option
from ..core.trainer import LocalTrainer
from ..core.types import Algorithm, RunContext
from ..errors import ConfigError
from ._registry import register
from ._submodel import CNN_MODELS, DEVICE_RATIOS, check_ratios, forward_layers, submodel_algorithm, width_masks


NEFL_PS = (0.04, 0.16, 0.36, 0.64, 1.0)


def submodel_of_level(ps, ratios) -> tuple[int, ...]:
    """Per device level the index of the largest submodel whose width sqrt(p) fits 1 - rho (the smallest if
    none fits)."""
    out = []
    for rho in ratios:
        fits = [k for k, p in enumerate(ps) if math.sqrt(p) <= 1.0 - rho + 1e-6]
        out.append(max(fits, key=lambda k: ps[k]) if fits else min(range(len(ps)), key=lambda k: ps[k]))
    return tuple(out)


def _key(path):
    return "/".join(path)


def _bn_paths(layers):
    """{"params": [paths of BN scale / bias], "stats": [paths of BN mean / var]}."""
    bn = [layer.path for layer in layers if layer.kind == "bn"]
    return ([p + (n,) for p in bn for n in ("scale", "bias")], [p + (n,) for p in bn for n in ("mean", "var")])


@dataclasses.dataclass(frozen=True)
class NeFLOptions(Options):
    name = "nefl"
    models = CNN_MODELS
    sharing = ("consistent parameters of nested width submodels, averaged per entry over their holders; "
               "BatchNorm once per submodel on the server", "nothing (its submodel follows from its id)")
    ps: tuple[float, ...] = option(NEFL_PS, "model size of each submodel (width sqrt(p)), comma-separated",
                                   lo=0.0, hi=1.0, lo_open=True)
    device_ratios: tuple[float, ...] = option(DEVICE_RATIOS, "device level rho per client (i mod len); the "
                                              "client trains the largest submodel of width <= 1 - rho",
                                              lo=0.0, hi=1.0)
    uniform: bool = option(True, "every client weighs 1 in the averages (NeFedAvg); --no-: engine weights")
    grad_clip: float = option(0.0, "clip every local step's gradient to this global L2 norm (0: none, as NeFL's "
                              "plain LocalUpdateM; its warmup-cosine trainers clip at 1)", lo=0.0)

    def check(self) -> None:
        check_ratios("nefl", self.device_ratios)
        if not self.ps:
            raise ConfigError("nefl.ps must hold at least one model size in (0, 1]")

@register(NeFLOptions)
def nefl(model, trainer: LocalTrainer, o: NeFLOptions, ctx: RunContext) -> Algorithm:
    """NeFL-W on a CNN ``Classifier``; options: ``NeFLOptions``."""
    widths = jnp.asarray([math.sqrt(p) for p in o.ps], jnp.float32)
    level_model = jnp.asarray(submodel_of_level(o.ps, o.device_ratios), jnp.int32)
    num_models = len(o.ps)
    full = max(range(num_models), key=lambda k: o.ps[k])

    def model_index(info):
        return level_model[info.client_id % level_model.shape[0]]

    def with_bn(params, stats, table, k):
        """params / stats with every BatchNorm leaf taken from submodel k's copy."""
        fp, fs = traverse_util.flatten_dict(params), traverse_util.flatten_dict(stats) if stats else {}
        for key, leaf in table["params"].items():
            fp[tuple(key.split("/"))] = leaf[k]
        for key, leaf in table["stats"].items():
            fs[tuple(key.split("/"))] = leaf[k]
        return traverse_util.unflatten_dict(fp), (traverse_util.unflatten_dict(fs) if fs else stats)

    def prepare(server, info):
        params, stats = with_bn(server["params"], server["batch_stats"], server["bn"], model_index(info))
        return {"params": params, "batch_stats": stats}

    def masks(layers, v, data, key, info, labels):
        k = model_index(info)
        return width_masks(layers, v["params"], v["batch_stats"], widths[k]), {"submodel": k}

    def finish(server, new, clients, w, info):
        idx = level_model[info.client_id % level_model.shape[0]]
        fp = traverse_util.flatten_dict(clients["params"])
        fpm = traverse_util.flatten_dict(clients["mask"]["params"])
        fs = traverse_util.flatten_dict(clients["batch_stats"]) if clients["batch_stats"] else {}
        fsm = traverse_util.flatten_dict(clients["mask"]["batch_stats"]) if fs else {}

        def per_model(x, m, table):  # table [K, ...]: copy k averaged over submodel k's clients
            def one(k, prev):
                mine = (idx == k).astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))
                return masked_mean(x, w, m * mine, prev)
            return jax.vmap(one)(jnp.arange(num_models), table)

        table = {"params": {key: per_model(fp[tuple(key.split("/"))], fpm[tuple(key.split("/"))], leaf)
                            for key, leaf in server["bn"]["params"].items()},
                 "stats": {key: per_model(fs[tuple(key.split("/"))], fsm[tuple(key.split("/"))], leaf)
                           for key, leaf in server["bn"]["stats"].items()}}
        params, stats = with_bn(new["params"], new["batch_stats"], table, full)
        return {"params": params, "batch_stats": stats, "bn": table}

    alg = submodel_algorithm("nefl", model, trainer, masks=masks, uniform=o.uniform, prepare=prepare,
                             finish=finish, grad_clip=o.grad_clip)

    def init(key, sample_x):
        variables, client = alg.init(key, sample_x)
        layers = forward_layers(model, trainer.preprocess(sample_x[:1]))
        p_paths, s_paths = _bn_paths(layers)
        fp = traverse_util.flatten_dict(variables["params"])
        fs = traverse_util.flatten_dict(variables["batch_stats"]) if variables["batch_stats"] else {}
        stack = lambda leaf: jnp.broadcast_to(leaf, (num_models,) + leaf.shape)
        table = {"params": {_key(p): stack(fp[p]) for p in p_paths},
                 "stats": {_key(p): stack(fs[p]) for p in s_paths if p in fs}}
        return dict(variables, bn=table), client

    return alg._replace(init=init)

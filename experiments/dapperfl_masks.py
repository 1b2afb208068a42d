"""DapperFL's pruning masks per layer: the fraction of each weight tensor kept at each device level.

For a model (default ``resnet10_slim``, DapperFL's CPU stand-in; ``--model resnet10`` for the paper's width) the
script builds ``pruning_masks`` of its initial weights (plus N(0, 0.1^2) noise) at every ratio and prints, per masked
leaf, the rule
that applies and the kept fraction; with ``--torch`` (needs PyTorch) it also applies the released code's torch
calls (``prune.ln_structured`` on dim 1 then dim 0 for inner convs, dim 0 only for output-only convs,
``l1_unstructured`` on BN scales, ``ln_structured(n=2, dim=1)`` on the Linear) to the same weights and reports
whether the kept entries are identical.

    python experiments/pruning_masks.py --ratios 0.2,0.4,0.6,0.8 --torch
"""
from __future__ import annotations

import argparse

import jax
import numpy as np

from jaxfl.algorithms._submodel import pruning_masks
from jaxfl.core.trees import leaf_paths
from jaxfl.errors import ConfigError
from jaxfl.models import MODELS
from jaxfl.run.script import parse_list


def torch_masks(params, ratio: float, masks):
    """The released code's masks on the same weights (flax layout in, flax layout out); the rule of each leaf
    is read from which axes our mask varies along, so only the scoring is re-done by torch."""
    import torch
    import torch.nn.utils.prune as prune

    def module_with(weight):
        m = torch.nn.Module()
        m.weight = torch.nn.Parameter(torch.tensor(weight))
        return m

    out = []
    for w, m in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(masks)):
        w, m = np.asarray(w), np.asarray(m)
        if m.all() or w.ndim not in (1, 2, 4):
            out.append(np.ones_like(w))
            continue
        if w.ndim == 4:  # flax [kh, kw, in, out] -> torch [out, in, kh, kw]
            mod = module_with(np.transpose(w, (3, 2, 0, 1)).copy())
            if not m.any(axis=(0, 1, 3)).all():  # some input channel pruned: in then out
                prune.ln_structured(mod, "weight", amount=ratio, n=1, dim=1)
            prune.ln_structured(mod, "weight", amount=ratio, n=1, dim=0)
            out.append(np.transpose(mod.weight_mask.numpy(), (2, 3, 1, 0)))
        elif w.ndim == 2:  # Dense [in, out] -> Linear [out, in], input features by L2
            mod = module_with(w.T.copy())
            prune.ln_structured(mod, "weight", amount=ratio, n=2, dim=1)
            out.append(mod.weight_mask.numpy().T)
        else:  # BN scale
            mod = module_with(w.copy())
            prune.l1_unstructured(mod, "weight", amount=ratio)
            out.append(mod.weight_mask.numpy())
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet10_slim")
    p.add_argument("--ratios", default="0.2,0.4,0.6,0.8")
    p.add_argument("--torch", action="store_true", help="compare with torch's pruning calls on the same weights")
    args = p.parse_args(argv)
    ratios = parse_list(args.ratios, "--ratios", float)
    if not all(0 <= r < 1 for r in ratios):
        raise ConfigError(f"--ratios {args.ratios!r}: give pruning ratios in [0, 1)")
    if args.model not in MODELS:
        raise ConfigError(f"--model {args.model!r}: one of {', '.join(MODELS)}")
    model = MODELS[args.model](10)
    params = model.init(jax.random.key(0), np.zeros((1, 32, 32, 3), np.float32), train=False)["params"]
    # the initial BN scales are all 1: ties, which torch's topk breaks in no specified order; noise (as training
    # brings) makes every score distinct
    keys = jax.random.split(jax.random.key(1), len(jax.tree_util.tree_leaves(params)))
    params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), [
        x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(jax.tree_util.tree_leaves(params), keys)])
    paths = leaf_paths(params)
    per_ratio = {r: pruning_masks(params, r) for r in ratios}
    header = "| leaf | shape | " + " | ".join(f"kept at {r}" for r in ratios) + " |"
    rows = [header, "|" + "---|" * (2 + len(ratios))]
    leaves = jax.tree_util.tree_leaves(params)
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        fractions = [float(np.mean(np.asarray(jax.tree_util.tree_leaves(per_ratio[r])[i]))) for r in ratios]
        if all(f == 1.0 for f in fractions):
            continue
        rows.append(f"| {'/'.join(path)} | {tuple(leaf.shape)} | " + " | ".join(f"{f:.3f}" for f in fractions) + " |")
    total = sum(np.size(x) for x in leaves)
    kept = [sum(float(np.sum(np.asarray(m))) for m in jax.tree_util.tree_leaves(per_ratio[r])) for r in ratios]
    rows.append(f"| all parameters | {total:,} | " + " | ".join(f"{k / total:.3f}" for k in kept) + " |")
    print("\n".join(rows))
    if args.torch:
        for r in ratios:
            ours = [np.asarray(m) for m in jax.tree_util.tree_leaves(per_ratio[r])]
            theirs = torch_masks(params, r, per_ratio[r])
            same = sum(np.array_equal(a, b) for a, b in zip(ours, theirs))
            print(f"ratio {r}: {same} of {len(ours)} leaves keep exactly the entries torch's calls keep")


if __name__ == "__main__":
    from jaxfl.run.script import run_script
    raise SystemExit(run_script(main))

"""FedCP's first local epoch on one client, the official code (TsingZ0/FedCP) beside jaxfl's, from the same
initial weights on the same batches: does the MMD term (lam = 5) destabilise training at a large client lr in
both codes, or only in jaxfl?

    FEDCP_OFFICIAL=/path/to/TsingZ0+FedCP JAXFL_DATA_DIR=../shared/data OMP_NUM_THREADS=1 \\
        python experiments/official/fedcp_steps.py --lrs 0.005,0.05 --out DIR

Run it from any directory but the repository root, in an environment with PyTorch, scikit-learn and jaxfl.
Official code imported unchanged (commit 7110e97): ``Ensemble`` and ``MMD`` (``system/flcore/clients/
clientcp.py``), ``ConditionalSelection`` (``servers/servercp.py``), ``LocalModel`` (``trainmodel/models.py``);
the loop mirrors ``clientCP.train_cs_model`` (one SGD over the ensemble, CE + lam MMD(rep, rep_base), batches
in order, no shuffle). jaxfl: ``fedcp_loss`` and ``policy_init`` of ``jaxfl/algorithms/fedcp.py`` under
``optax.sgd``, the same batches.

Inputs: client 0 of ``jaxfl run --dataset mnist --channels 1 --num-clients 20 --partition dirichlet
--dirichlet-alpha 0.1 --samples-per-client 500`` (seed 0), (x/255 - 0.5)/0.5, batch 10; the model is the 2NN
(784-200-200 with ReLU | Linear(200, 10)), the policy network Linear(200, 400)-LayerNorm-ReLU, the context
U[0, 1)^200; torch's initial weights are copied into jaxfl's (kernels transposed), so the two sides differ only
in their Gumbel noise (torch samples its own; jaxfl draws from its keys). Prints and writes (``steps.md``) the
loss, the MMD and the fraction of active ReLU features every 5 steps.
"""
from __future__ import annotations

import argparse
import copy
import sys
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import official_repo  # noqa: E402


def client_batches(batch: int = 10):
    from jaxfl.data import DataConfig, load_dataset
    ds = load_dataset(DataConfig("mnist", num_clients=20, partition="dirichlet", dirichlet_alpha=0.1,
                                 samples_per_client=500, channels=1, seed=0))
    x, y = ds.train[0]
    x = ((x.astype(np.float32) / 255.0 - 0.5) / 0.5).reshape(len(y), -1)
    n = len(y) // batch * batch  # the official loader's drop_last
    return [(x[i:i + batch], y[i:i + batch].astype(np.int64)) for i in range(0, n, batch)]


def official_side(repo: Path, batches, lr: float, lam: float, seed: int = 0):
    """(rows, initial torch modules) of the official loop: per step (loss, mmd, active fraction)."""
    import torch
    import torch.nn as nn
    if str(repo / "system") not in sys.path:  # called once per lr
        sys.path.insert(0, str(repo / "system"))
    sys.modules.setdefault("utils.data_utils", types.SimpleNamespace(read_client_data=None))  # data loading only
    from flcore.clients.clientcp import MMD, Ensemble
    from flcore.servers.servercp import ConditionalSelection
    from flcore.trainmodel.models import LocalModel
    torch.manual_seed(seed)
    fe = nn.Sequential(nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU())
    model = LocalModel(fe, nn.Linear(200, 10))
    cs = ConditionalSelection(200, 200)
    context = torch.rand(1, 200)
    init = copy.deepcopy((fe, model.head, cs, context))
    ens = Ensemble(model=model, cs=cs, head_g=copy.deepcopy(model.head), feature_extractor=copy.deepcopy(fe))
    opt = torch.optim.SGD(ens.parameters(), lr=lr)
    ce = nn.CrossEntropyLoss()
    ens.train()
    rows = []
    for xb, yb in batches:
        out, rep, rep_base = ens(torch.tensor(xb), is_rep=True, context=context)
        mmd = MMD(rep, rep_base, "rbf")
        loss = ce(out, torch.tensor(yb)) + lam * mmd
        opt.zero_grad()
        loss.backward()
        opt.step()
        rows.append((loss.item(), mmd.item(), (rep > 0).float().mean().item()))
    return rows, init


def jaxfl_side(init, batches, lr: float, lam: float, seed: int = 0):
    """Per step (loss, mmd, active fraction) of jaxfl's FedCP loss from the official initial weights."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxfl.algorithms.fedcp import MMD_BANDWIDTHS, fedcp_loss
    from jaxfl.models import mlp_2nn
    from jaxfl.ops.losses import gaussian_mmd
    fe, head, cs, context = init
    t = lambda p: jnp.asarray(p.detach().numpy())  # noqa: E731
    lin = lambda m: {"kernel": t(m.weight).T, "bias": t(m.bias)}  # noqa: E731
    model = mlp_2nn()
    params = {"encoder": {"fc1": {"linear": lin(fe[0])}, "fc2": {"linear": lin(fe[2])}},
              "head": {"fc1": {"linear": lin(head)}},
              "cs": {"dense": lin(cs.fc[0]), "ln": {"scale": t(cs.fc[1].weight), "bias": t(cs.fc[1].bias)}}}
    want = model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)), False)["params"]
    shapes = lambda tree: jax.tree_util.tree_map(jnp.shape, tree)  # noqa: E731
    assert shapes({k: params[k] for k in want}) == shapes(want), "the 2NN's parameter layout changed"
    loss_fn = fedcp_loss(model, lam, 1.0)
    ctx, enc_bar, head_g = t(context)[0], params["encoder"], params["head"]
    tx = optax.sgd(lr)

    @jax.jit
    def step(p, st, xb, yb, key):
        w = jnp.ones(len(yb))
        f = lambda q: loss_fn(q, {}, xb, yb, w, key, head_g, ctx, enc_bar)  # noqa: E731
        (loss, _), g = jax.value_and_grad(f, has_aux=True)(p)
        z = model.apply({"params": {"encoder": p["encoder"]}}, xb, True, method="features")
        zb = model.apply({"params": {"encoder": enc_bar}}, xb, True, method="features")
        upd, st = tx.update(g, st, p)
        return optax.apply_updates(p, upd), st, (loss, gaussian_mmd(z, zb, w, MMD_BANDWIDTHS), jnp.mean(z > 0))

    st, rows = tx.init(params), []
    for i, (xb, yb) in enumerate(batches):
        params, st, row = step(params, st, jnp.asarray(xb.reshape(-1, 28, 28, 1)), jnp.asarray(yb),
                               jax.random.fold_in(jax.random.key(seed), i))
        rows.append(tuple(float(r) for r in row))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lrs", default="0.005,0.05")
    p.add_argument("--lam", type=float, default=5.0)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    repo = official_repo("FEDCP_OFFICIAL", "TsingZ0/FedCP")
    batches = client_batches()
    lines = [f"FedCP, one client's first local epoch ({len(batches)} steps of 10), lam {args.lam:g}; per step: "
             "loss / MMD^2 / fraction of active features, official | jaxfl (same initial weights and batches)", ""]
    for lr in map(float, args.lrs.split(",")):
        off, init = official_side(repo, batches, lr, args.lam)
        jx = jaxfl_side(init, batches, lr, args.lam)
        lines += [f"lr {lr:g}:", "", "| step | official loss | MMD^2 | active | jaxfl loss | MMD^2 | active |",
                  "|---|---|---|---|---|---|---|"]
        for i in range(0, len(batches), args.every):
            lines.append(f"| {i} | " + " | ".join(f"{v:.3f}" for v in off[i] + jx[i]) + " |")
        mean = lambda rows, j: np.mean([r[j] for r in rows])  # noqa: E731
        lines += ["", f"epoch means: official loss {mean(off, 0):.3f}, active {mean(off, 2):.3f}; "
                      f"jaxfl loss {mean(jx, 0):.3f}, active {mean(jx, 2):.3f}", ""]
    text = "\n".join(lines)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "steps.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

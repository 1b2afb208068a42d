"""FedFomo's official code (NVlabs/FedFomo) on the inputs of ``experiments/pfl_methods.py``'s runs.

    FEDFOMO_OFFICIAL=/path/to/FedFomo JAXFL_DATA_DIR=../shared/data python experiments/official/fedfomo.py \\
        --method fedfomo --jaxfl-run experiments/logs/pfl_methods/seed0/fedfomo_lr0.005 \\
        --out ../runs/official/fedfomo/seed0/fedfomo
    # 3 seeds, then the comparison
    FEDFOMO_OFFICIAL=... JAXFL_DATA_DIR=... python experiments/official/fedfomo.py --all \\
        --seeds 0,1,2 --out ../runs/official/fedfomo --figure fedfomo.png

The official round loop is the ``__main__`` block of its ``main.py`` (module-level argument parsing, CSV and
per-round model files, pandas); ``round_loop`` below is that block's FedFomo path, statement by statement, with
the logging and file output left out. Everything it calls runs unchanged from the checkout named by
``$FEDFOMO_OFFICIAL`` (imported, never copied): ``server.GlobalServer`` (``initialize_clients``,
``local_train``, ``update_server_models``), ``federation.Federation`` (``compute_client_weights``: candidates,
FOMO weights on the validation split, affinity update; ``federate``: the model update), ``client.Client``
(``get_federating_clients``: epsilon-greedy picks, ``save_first_model``, ``train``, ``eval``) and
``federated/train.py`` (minibatch SGD, evaluation), with its arguments parsed by its own ``federated.args`` from
the command line the official README gives for FedFomo, changed where jaxfl's setting differs (``official_args``).

What is replaced, and how it is matched:
- Data. The population (the official code builds CIFAR-10/100 populations only) is the clients of the jaxfl run
  named by ``--jaxfl-run`` (``common.jaxfl_inputs``: MNIST, one channel, 20 clients, Dirichlet(0.1) labels, at
  most 500 training images, a test set following each client's label mix), normalised as jaxfl does, built with
  the official ``Client`` (``initialize`` with the client's test set, as the CIFAR-10 population does). Each
  client's train/validation split is jaxfl's (``jaxfl.algorithms.fedfomo.split_rows`` of ``split_seed`` and the
  client id: 20 % of the samples, rounded down, validate) in place of the official ``random_split`` draw, so both
  codes weigh models on the same samples.
- Model. ``pfl_setting.two_nn``: jaxfl's ``mlp_2nn`` with jaxfl's initial weights of the run's seed, returned by
  ``federated.network.get_net`` (the official code knows three CNNs).
- Device. The official client and server name ``cuda:<i>`` devices; the ``torch`` those two modules see maps any
  device to the CPU (``CpuTorch``). ``torchvision`` and ``torch.utils.tensorboard`` (imported, used only for
  CIFAR and differential privacy) are stubs.
- Hierarchical candidates. After each ``update_server_models`` (which clusters the affinity matrix and averages
  each cluster), the server's sub-federation and global models are dropped, so a client's candidates are its own
  model and the M epsilon-greedy picks: the paper's algorithm, and the one jaxfl implements.
- Hyperparameters. jaxfl's setting: the jaxfl run's lr, constant (``-lr_decay 1``), batch 10, one local epoch
  (``-fe 1``), plain SGD without weight decay, every client every round, M = 4, epsilon 0.3, decay 0.05, the
  ``first_model`` baseline and the l1 distance (the README's, and jaxfl's defaults). Validation losses are taken
  in one batch (``--bs_val`` 100000): the official loss is a mean of batch means, jaxfl's a mean over samples.
- Seeds. torch and numpy seeded with the run's seed before the server is built (data order); the official loop
  reseeds numpy with it every round (its quirk, kept).
- Metric. After each round's local training: each client's accuracy on its test set of the model it just trained
  (the official ``local_train`` evaluates it and records it in ``client.metrics``), what jaxfl's ``fedfomo``
  predicts with; also ``fomo_accuracy``, the official evaluation point (the combined model before training, as
  its ``local_eval`` measures it), and ``train_helpers``, each client's count of candidates with a positive
  weight this round (jaxfl logs the same count under that key), as extra columns.

``--compare``: final and last-5 mean accuracy of both sides, the difference and the agreement criterion
(``pfl_setting.compare_methods``). See experiments/official/fedfomo.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import types
from pathlib import Path

import numpy as np

os.environ.setdefault("TQDM_DISABLE", "1")  # the official loops' progress bars (read when tqdm is imported)

from common import MetricsLog, jaxfl_inputs, stub_unimportable, to_nchw_float
from pfl_setting import Library, check_setting, load_jaxfl_init, two_nn

REPO = "NVlabs/FedFomo"


def official_args(cfg, opts: dict, num_clients: int) -> list[str]:
    """The official ``main.py`` command line for jaxfl's run ``cfg`` with FedFomo options ``opts``: the README's
    CIFAR-10 FedFomo command (``-fr 1.0 -fe 5 --num_update_clients 4 --baseline_model first_model
    --client_weight_epsilon 0.3 --client_weight_epsilon_decay 0.05 --train_split 0.8 --lr 0.1 -lr_decay 0.99
    --bs_trn 50``) with jaxfl's setting where it differs."""
    return ["--federation_method", "fomo", "--num_clients", str(num_clients),
            "--num_update_clients", str(opts["num_update_clients"]), "--baseline_model", "first_model",
            "--client_weight_epsilon", str(opts["epsilon"]), "--client_weight_epsilon_decay",
            str(opts["epsilon_decay"]), "--model_delta_norm", opts["norm"],
            "--train_split", str(1 - opts["val_frac"]), "-fr", "1.0", "-fe", str(cfg.local_epochs),
            "--max_epoch", str(cfg.rounds), "--lr", str(cfg.lr), "-lr_decay", "1.0", "--optimizer", "sgd",
            "--momentum", "0", "--weight_decay", "0", "--bs_trn", str(cfg.batch_size), "--bs_val", "100000",
            "--num_workers", "0", "--seed", str(cfg.seed), "--data_seed", str(cfg.seed)]


class CpuTorch(types.ModuleType):
    """``torch`` as the official client and server modules see it: every ``torch.device(...)`` is the CPU."""

    def __init__(self, torch):
        super().__init__("torch")
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def device(self, *_a, **_k):
        return self._torch.device("cpu")


def import_official(argv: list[str]):
    """The official modules, imported with ``argv`` as the command line their ``federated.args`` parses, with the
    stubs and the CPU device described in the module docstring. Returns (client, server, configs) modules."""
    import torch
    stub_unimportable("torchvision")
    stub_unimportable("torch.utils.tensorboard")
    saved, sys.argv = sys.argv, ["main.py", *argv]
    try:
        import client as client_module
        import federated.configs as configs
        import server as server_module
    finally:
        sys.argv = saved
    client_module.torch = server_module.torch = CpuTorch(torch)
    return client_module, server_module, configs


def split_indices(count: int, client_id: int, opts: dict) -> tuple[np.ndarray, np.ndarray]:
    """jaxfl's fixed split of a client's ``count`` samples: (train indices, validation indices)."""
    import jax
    from jaxfl.algorithms.fedfomo import split_rows
    key = jax.random.fold_in(jax.random.key(opts["split_seed"]), client_id)
    order, n_train = split_rows(key, np.int32(count), count, opts["val_frac"])
    order = np.asarray(order)
    return order[:int(n_train)], order[int(n_train):count]


def build_population(inputs, client_module, opts: dict):
    """The official ``Client`` objects on jaxfl's clients, in a population with the attributes the official server
    and federation read (``clients``, ``num_clients``, ``num_classes``, ``distributions``,
    ``num_distributions``)."""
    import torch
    from torch.utils.data import Subset, TensorDataset

    def dataset(x, y):
        return TensorDataset(torch.from_numpy(to_nchw_float(x, inputs.normalize)),
                             torch.from_numpy(np.asarray(y, np.int64)))

    population = types.SimpleNamespace(num_clients=inputs.num_clients, num_classes=inputs.num_classes,
                                       num_distributions=5, clients=[], test_data=None)  # 5 clusters: README's -nf 5
    population.distributions = [{"id": 0, "clients": population.clients}]
    for i, ((x, y), (tx, ty)) in enumerate(zip(inputs.train, inputs.test)):
        c = client_module.Client(client_id=i)
        c.population = population
        c.local_val_ratio, c.shared_val = 1.0, True
        train = dataset(x, y)
        c.initialize(train, population.distributions[0], dataset(tx, ty))
        tr, va = split_indices(len(y), i, opts)
        c.datasets[0], c.datasets[1] = Subset(train, tr.tolist()), Subset(train, va.tolist())
        c.train_size = len(tr)
        c.EMD = None
        population.clients.append(c)
    return population


def round_loop(server, population, args, cfg_fl, on_round) -> None:
    """``main.py``'s training loop (FedFomo, ``federating_ratio`` 1), its file output left out and the server's
    hierarchical models dropped after each upload; ``on_round(epoch, clients, fomo_accuracy)`` after each
    round's local training."""
    all_activated_clients = []
    np.random.seed(cfg_fl.SEED)
    for epoch in range(args.max_epoch):
        server.round = epoch
        args.federation_round = epoch
        np.random.seed(cfg_fl.SEED)
        m = max(int(args.federating_ratio * population.num_clients), 1)
        client_indices = np.random.choice(range(population.num_clients), m, replace=False)
        federating_clients = [population.clients[ix] for ix in client_indices]
        server.last_active_clients = federating_clients
        for client in federating_clients:
            client.last_active_round = epoch
            if client not in all_activated_clients:
                all_activated_clients.append(client)
        federating_clients = server.initialize_clients(epoch, selected_clients=federating_clients)
        for client in federating_clients:
            client.save_first_model()
        # local_eval's per-client part (its population-wide test set is CIFAR's): the combined model, before training
        fomo = {c.id: c.eval(epoch=epoch, client=c, val_dataset=c.datasets[2], log=False, test=False, args=server.args,
                             output_metrics=True)[1] for c in federating_clients}
        server.local_train(federating_clients, epoch * args.federation_epoch)
        for ix, pix in enumerate(client_indices):
            server.population.clients[pix] = federating_clients[ix]
        for client in federating_clients:
            client.participated = True
        server.update_server_models(federating_clients, all_activated_clients)
        server.federated_model_dicts = []  # no hierarchical (cluster / global) candidates: see the docstring
        server.args.lr = np.max([args.min_learning_rate, server.args.lr * args.learning_rate_decay])
        on_round(epoch, federating_clients, fomo)


def run(args) -> None:
    """One official FedFomo run on the inputs, lr, seed and rounds of the jaxfl run ``args.jaxfl_run``."""
    import warnings

    import torch
    from jaxfl.run.config import RunConfig

    warnings.simplefilter("ignore")
    cfg = RunConfig.from_dict(json.loads((Path(args.jaxfl_run) / "config.json").read_text()))
    check_setting(cfg, args.jaxfl_run, "fedfomo", algorithm="fedfomo")
    opts = dataclasses.asdict(cfg.algorithm_options())
    inputs = jaxfl_inputs(cfg)
    torch.set_num_threads(1)
    argv = official_args(cfg, opts, inputs.num_clients)
    client_module, server_module, configs = import_official(argv)
    import federated.network
    from federated.args import args as official
    cfg_fl = configs.assert_and_infer_cfg_fl(configs.cfg_fl, official, make_immutable=False)
    official.ngpu = 0  # main.py sets these three
    official.model_path, official.experiment_name = str(args.out), "fedfomo"
    init = two_nn(inputs.num_classes)
    load_jaxfl_init(init, cfg)
    state = {k: v.clone() for k, v in init.state_dict().items()}

    def get_net(_args, _criterion=None):
        net = two_nn(inputs.num_classes)
        net.load_state_dict(state)
        return net

    federated.network.get_net = get_net
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    quiet = contextlib.redirect_stdout(io.StringIO()) if not args.verbose else contextlib.nullcontext()
    with quiet:
        population = build_population(inputs, client_module, opts)
        server = server_module.GlobalServer(population=population)
        server.cfg = cfg_fl

    config = {"official": REPO, "commit": args.commit, "algorithm": "fedfomo", "jaxfl_variant": args.method,
              "jaxfl_run": Path(args.jaxfl_run).name, "seed": cfg.seed, "lr": cfg.lr, "rounds": cfg.rounds,
              "official_args": " ".join(argv).replace(f"--seed {cfg.seed} --data_seed {cfg.seed}",
                                                      "--seed SEED --data_seed SEED"),  # one group over seeds
              "out": str(args.out)}
    log = MetricsLog(args.out, inputs.client_names, config)
    ids = list(range(inputs.num_clients))

    def on_round(epoch, clients, fomo):
        by_id = {c.id: c for c in clients}
        acc = [by_id[i].metrics["val_acc"][-1] for i in ids]  # local_train's evaluation on the test split
        rec = log.round(epoch + 1, sorted(by_id),
                        train_loss=[by_id[i].metrics["train_loss"][-1] for i in sorted(by_id)],
                        test_accuracy=acc, test_count=[len(t[1]) for t in inputs.test],
                        test_loss=[by_id[i].metrics["val_loss"][-1] for i in ids],
                        fomo_accuracy=float(np.mean([fomo[i] for i in ids])),
                        train_helpers=[float(sum(d > 0 for d in by_id[i].model_deltas)) for i in sorted(by_id)])
        if args.progress:
            print(f"round {epoch + 1}: mean accuracy {rec['mean_accuracy']:.4f} (combined model before training "
                  f"{rec['fomo_accuracy']:.4f})", file=sys.stderr, flush=True)

    with quiet:
        round_loop(server, population, official, cfg_fl, on_round)


LIBRARY = Library("official", REPO, "fe04f6641407bce4fc58ea3fbf8cb314f9af8629", "FEDFOMO_OFFICIAL",
                  {"fedfomo": True}, name="FedFomo's official code")


def main(argv=None) -> None:
    LIBRARY.main(argv, __doc__, __file__, run, lambda p: p.add_argument(
        "--verbose", action="store_true", help="show the official code's own printing"))


if __name__ == "__main__":
    main()

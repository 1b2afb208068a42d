"""Which model, which clients: each method's personal and global model on its training clients, and on clients
held out of training with the global model and after one local update from it (``jaxfl.run.evaluation``).

Setting: MNIST, the 2NN (``mlp_2nn``), 50 clients of 2 label shards each (``--partition shards``), 10 of them
held out (``--new-clients 10``, drawn from the seed), 10 of the other 40 a round, 50 rounds, batch 10, one
local epoch, SGD lr 0.05, each method's default options. Reported: the mean test accuracy over clients after
the last round (mean ± population std over seeds) of

- personal: each training client's own model (``mean_accuracy``);
- global: the server's model with the initial client state, on the training clients (``global_mean_accuracy``);
- new, global: the same on the held-out clients (``new_mean_accuracy``);
- new, tuned: the held-out clients after one local update of the method from the global model on their
  training split (``new_tuned_mean_accuracy``).

    JAXFL_DATA_DIR=../shared/data python experiments/new_clients.py --seeds 0,1,2 --out runs/new_clients
    python experiments/new_clients.py --seeds 0 --methods fedavg,fedper --rounds 5 --out /tmp/nc

Outputs in --out: one run folder per (seed, method) (reused when finished, resumed when not), ``table.md`` and
``table.json`` (each seed's four numbers per method).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from common import check_at_least, check_variants, parse_list, parse_seeds, run_script, run_seeds

from jaxfl.algorithms import REGISTRY
from jaxfl.run.config import RunConfig

METHODS = ("fedavg", "fedper", "fedrep", "fedbabu", "ditto", "local")
COLUMNS = (("personal", "mean_accuracy"), ("global", "global_mean_accuracy"),
           ("new, global", "new_mean_accuracy"), ("new, tuned", "new_tuned_mean_accuracy"))


def final(hist: list[dict], key: str) -> float | None:
    """The last evaluation's ``key`` in %, None where the run has none (a method without a tuned prediction)."""
    value = [h for h in hist if "mean_accuracy" in h][-1].get(key)
    return None if value is None else 100 * value


def table(results: dict, seeds, rounds: int) -> str:
    rows = ["| method | " + " | ".join(c for c, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for method, hists in results.items():
        cells = []
        for _, key in COLUMNS:
            vals = [final(h, key) for h in hists]
            cells.append("-" if None in vals else f"{np.mean(vals):.1f} ± {np.std(vals):.1f}")
        rows.append(f"| {method} | " + " | ".join(cells) + " |")
    return (f"MNIST, 2NN, 50 clients of 2 label shards, 10 held out of training, 10 of the other 40 a round; mean "
            f"test accuracy % over clients after round {rounds} (mean ± population std over seeds "
            f"{','.join(map(str, seeds))})\n\n" + "\n".join(rows) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--out", default="runs/new_clients")
    args = p.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    methods = parse_list(args.methods, "--methods", choices=tuple(REGISTRY))
    check_at_least("--rounds", args.rounds, 1)
    base = RunConfig(algorithm="fedavg", dataset="mnist", model="mlp_2nn", num_clients=50, partition="shards",
                     classes_per_client=2, new_clients=10, clients_per_round=10, rounds=args.rounds, batch_size=10,
                     lr=0.05, momentum=0.0, eval_model="both", eval_every=max(1, args.rounds // 5))
    check_variants(methods, base)
    results = {}
    for m in methods:
        results[m] = run_seeds(m, base, args.out, seeds)
        print(m, {c: final(results[m][0], k) for c, k in COLUMNS}, flush=True)
    text = table(results, seeds, args.rounds)
    out = Path(args.out)
    (out / "table.md").write_text(text)
    (out / "table.json").write_text(json.dumps(
        {m: {key: [final(h, key) for h in hs] for _, key in COLUMNS} for m, hs in results.items()}, indent=1))
    print(text)


if __name__ == "__main__":
    raise SystemExit(run_script(main))

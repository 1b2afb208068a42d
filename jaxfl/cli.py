"""Command line: ``jaxfl run --algorithm NAME --dataset NAME [options]`` (``jaxfl run --help``)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing

from .config import RunConfig, load_config_file
from .errors import JaxflError

HELP = {
    "algorithm": "local | fedavg | fedbn | fedprox | fedper | fedrep | lg_fedavg | ditto | fedpick | rfeddis | fedselect | fedtp | dapperfl",
    "dataset": "default (embedded, offline) | digits | pacs | cifar10 | mnist | tfds:NAME | folder:PATH",
    "model": "digits_cnn | alexnet_bn | resnet10 | resnet10_slim | resnet18 | resnet18_imagenet | vit_small | vit_tiny | fedavg_cnn | pfl_cnn | small_cnn (default: per dataset)",
    "data_dir": "folder with the .npz benchmarks (default: $JAXFL_DATA_DIR)",
    "strategy": "vmap | map | chunked (default: map on CPU, vmap on GPU/TPU)",
    "devices": "split the clients over this many devices (0: all; clients per round must divide evenly)",
    "client_sizes": "dirichlet_quantity: client sizes equal | lognormal (then each client's labels ~ Dir(alpha p))",
    "size_sigma": "dirichlet_quantity with lognormal sizes: sigma of the log client size (>= 0)",
    "client_store": "where per-client persistent state lives: auto (device if it fits in a quarter of its "
                    "memory) | device | host",
    "participation": "fraction of clients sampled per round",
    "out": "output folder: metrics.jsonl, summary.json, accuracy.png, checkpoints/",
    "checkpoint_every": "save a checkpoint every N rounds (0: never)",
    "resume": "continue from the newest checkpoint in --out",
    "prox_mu": "fedprox: weight of mu/2 ||w - w_global||^2",
    "ditto_lambda": "ditto: weight of lambda/2 ||v - w_global||^2 on the personal model",
    "head_epochs": "fedrep: head-only epochs before the body epochs (--local-epochs)",
    "warmup_rounds": "lg_fedavg: rounds of full averaging before the body goes personal",
    "local_bn": "fedprox/fedper/fedrep/lg_fedavg: keep BatchNorm per client",
    "tau": "fedpick: Gumbel-sigmoid temperature (default: 10 digits, 1 otherwise)",
    "lam_lce": "fedpick: weight of the personal head's CE (default: 10 digits, 1 otherwise)",
    "lam_ent": "fedpick: weight of the irrelevant head's negative entropy (default: 0.001)",
    "lam_dis": "fedpick: weight of the symmetric KL between global and personal predictions (10 / 1)",
    "use_pfsm": "fedpick: --no-use-pfsm drops the PFSM (the FedBN ablation)",
    "soft_mask": "fedpick ablation: use the soft mask m_s, no threshold",
    "no_ensemble": "fedpick ablation: predict with the global head only",
    "share_bn": "fedpick ablation: average BatchNorm too",
    "share_pfsm": "fedpick ablation: average the PFSM too",
    "pfsm_head": "fedpick: same (copy the global head) | linear",
    "share_global_head": "rfeddis: average the global head (--no-...: the released Office/DomainNet code)",
    "use_local_head": "rfeddis: --no-use-local-head keeps only the global evidential head",
    "use_dis": "rfeddis: the annealed disentangling loss exp(-symmetric KL)",
    "head_ce": "rfeddis: the softmax CE terms on both heads",
    "fusion": "rfeddis: ds (Dempster-Shafer on evidence) | sum (summed logits, the ablation)",
    "kl_reduction": "rfeddis: mean_all (official code) | batchmean (KL summed over features)",
    "alpha": "fedselect: personalization limit per tensor (grows while personal fraction <= alpha; 0: never)",
    "grow_rate": "fedselect: fraction p of a tensor's global entries made personal per growth",
    "grow_every": "fedselect: K, rounds between mask growths (rounds r %% K == 0, r > 0)",
    "la_epochs": "fedselect: E, LocalAlt alternations (personal pass + global pass) per round",
    "delta_ref": "fedselect: snapshot (|W - W at last growth|, official code) | round_start (paper)",
    "weight_by_n": "fedselect: weight the per-entry mean by sample counts (default unweighted)",
    "mask_biases": "fedselect: biases can become personal too (default: always global, the code)",
    "aggregate_batch_stats": "fedselect: average BatchNorm statistics over the round's clients (default local)",
    "fedtp_variant": "fedtp: hypernet (server hypernetwork generates Q/K/V) | vanilla (each client keeps its own)",
    "personalize": "fedtp vanilla: --no-personalize averages Q/K/V too (FedAvg on the ViT)",
    "embed_dim": "fedtp: client embedding size",
    "hyper_hidden": "fedtp: hypernetwork trunk width",
    "hyper_layers": "fedtp: hidden layers of the hypernetwork trunk after the first",
    "hyper_lr": "fedtp: hypernetwork SGD learning rate",
    "hyper_momentum": "fedtp: hypernetwork SGD momentum",
    "hyper_decay": "fedtp: hypernetwork weight decay",
    "device_ratios": "dapperfl: pruning ratio per device level, comma-separated; client i gets level i mod len",
    "gamma": "dapperfl: weight of the DAR term ||z||",
    "use_fusion": "dapperfl: fuse local and global weights before pruning (--no-use-fusion: released code)",
    "recover_mode": "dapperfl: global (pruned entries keep W, paper) | zero (averaged as zeros, released code)",
    "dar_norm": "dapperfl: l2 (||z||, code) | sq_l2 (||z||^2, paper)",
    "alpha0": "dapperfl: initial fusion weight of the global model",
    "alpha_min": "dapperfl: floor of the fusion weight",
    "fusion_eps": "dapperfl: decay of the fusion weight per round",
    "dis_feature": "rfeddis: head tap used as the disentangling feature: relu1 | fc1 | relu2 | fc2 ...",
}


def _arg_type(tp):
    if isinstance(tp, str):
        tp = eval(tp, vars(typing), {})  # annotations are strings under `from __future__ import annotations`
    if isinstance(tp, types.UnionType):
        tp = next(t for t in tp.__args__ if t is not type(None))
    return tp


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxfl", description="Vectorized personalized federated learning.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train and evaluate one configuration",
                         argument_default=argparse.SUPPRESS)
    run.add_argument("--config", help="TOML or JSON file of options; flags override it")
    run.add_argument("--quiet", action="store_true", help="no progress bar or table")
    launch = run.add_argument_group("multi-process launch (one process per host; see README, Scale-out)")
    launch.add_argument("--coordinator-address", help="host:port of process 0, the same for every process")
    launch.add_argument("--num-processes", type=int, help="processes in the run (default 1)")
    launch.add_argument("--process-id", type=int, help="this process's index in [0, num_processes)")
    for f in dataclasses.fields(RunConfig):
        flag = "--" + f.name.replace("_", "-")
        tp = _arg_type(f.type)
        default = f"default: {f.default}" if f.default is not None else ""
        text = "; ".join(s for s in (HELP.get(f.name, ""), default) if s)
        if tp is bool:
            run.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=text)
        elif tp is tuple:  # comma-separated numbers, e.g. --device-ratios 0,0.2,0.4
            run.add_argument(flag, dest=f.name, type=lambda v: tuple(float(x) for x in v.split(",")), help=text)
        else:
            run.add_argument(flag, dest=f.name, type=tp, help=text)
    return parser


def format_table(summary: dict) -> str:
    """Plain-text per-client table: last round, best-mean round, each client's best."""
    names = summary["clients"]
    last, best, own = summary["last"], summary["best_mean_round"], summary["best_per_client"]
    w = max(12, max(len(n) for n in names) + 2)
    head = f"{'client':<{w}}{'last (r' + str(last['round']) + ')':>14}{'best-mean (r' + str(best['round']) + ')':>20}{'own best':>12}"
    rows = [head, "-" * len(head)]
    for j, n in enumerate(names):
        rows.append(f"{n:<{w}}{last['accuracy'][j]:>14.4f}{best['accuracy'][j]:>20.4f}{own['accuracy'][j]:>12.4f}")
    rows.append("-" * len(head))
    rows.append(f"{'mean':<{w}}{last['mean_accuracy']:>14.4f}{best['mean_accuracy']:>20.4f}{own['mean_accuracy']:>12.4f}")
    rows.append(f"{'weighted':<{w}}{last['weighted_accuracy']:>14.4f}{best['weighted_accuracy']:>20.4f}{'':>12}")
    return "\n".join(rows)


def main(argv=None) -> int:
    args = vars(build_parser().parse_args(argv))
    args.pop("command")
    quiet = args.pop("quiet", False)
    launch = {k: args.pop(k) for k in ("coordinator_address", "num_processes", "process_id") if k in args}
    from .distributed import initialize, is_primary  # imports jax: kept out of `jaxfl --help`'s start-up
    try:
        if launch.get("num_processes", 1) > 1:
            initialize(launch.get("coordinator_address", ""), launch["num_processes"], launch.get("process_id", 0))
            quiet = quiet or not is_primary()  # one process prints
        values = load_config_file(args.pop("config")) if "config" in args else {}
        values.update(args)
        cfg = RunConfig(**values)
        from .runner import Experiment
        exp = Experiment(cfg)
        if not quiet:
            print(f"jaxfl: {cfg.algorithm} on {cfg.dataset}: {len(exp.dataset.client_names)} clients "
                  f"{exp.dataset.client_names}, train sizes {exp.dataset.train_counts().tolist()}, "
                  f"strategy {exp.strategy}", file=sys.stderr)
        result = exp.run(progress=not quiet)
    except JaxflError as e:
        print(f"jaxfl: error: {e}", file=sys.stderr)
        return 2
    summary = result.summary()
    if summary and is_primary():
        print(format_table(summary) if not quiet else json.dumps(summary["last"]))
    if cfg.out and not quiet:
        print(f"wrote {cfg.out}/metrics.jsonl, summary.json, accuracy.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

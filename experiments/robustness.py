"""FedAvg under attack, with each robust aggregator (the defense x attack table), and with each update codec
(accuracy against bits sent).

Setting: MNIST, logistic regression, 500 clients (jaxfl's default label split), 100 a round, 20 rounds, batch
10, one local epoch, SGD lr 0.01; a fraction ``--malicious`` (default 0.2) of the clients, fixed per run and
drawn from the seed, runs each attack (``jaxfl.ops.attacks``; defaults: sign flip s = 1, scaling s = 10,
Gaussian std 1, ALIE with the cohort's z, IPM eps 0.5, label flipping, a backdoor with target 0 on half of
the malicious clients' images: its success rate is given beside the accuracy); each aggregator runs with its default
parameters (``jaxfl.ops.robust_aggregation``; Krum and Multi-Krum assume f = 1). Reported: the mean test
accuracy over the clients after the last round (mean ± std over seeds, population std), and each aggregator's
mean round seconds over the clean runs (rounds 2 onward: round 1 compiles) against the plain mean's. The codec
table (``--compressions``) runs the clean setting with each codec at its default parameters
(``jaxfl.ops.compression``) and gives each client message's bits against 32-bit floats.

    JAXFL_DATA_DIR=../shared/data python experiments/robustness.py --seeds 0,1,2 --out runs/robustness
    python experiments/robustness.py --seeds 0 --aggregators mean,median --attacks none,alie --rounds 5 --out /tmp/r
    python experiments/robustness.py --seeds 0,1,2 --aggregators mean --attacks none --out runs/robustness \
        --compressions none topk topk:feedback=1 sign sign:feedback=1 quantize:bits=2,rotate=1

Outputs in --out: one run folder per (seed, aggregator, attack) (reused when finished, resumed when not) and
``table.md`` (and ``compression.md``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from common import check_at_least, check_variants, parse_list, parse_seeds, run_script, run_seeds

from jaxfl.ops.attacks import ATTACKS
from jaxfl.ops.compression import CODECS
from jaxfl.ops.robust_aggregation import AGGREGATORS
from jaxfl.run.config import RunConfig


def spec(aggregator: str, attack: str, malicious: float) -> str:
    """The variant of FedAvg with this aggregator and attack (``common.parse_variant``'s syntax)."""
    return f"fedavg:aggregator={aggregator}:attack={attack}:malicious={malicious if attack != 'none' else 0.0}"


def final_accuracy(hist: list[dict]) -> float:
    return 100 * [h for h in hist if "mean_accuracy" in h][-1]["mean_accuracy"]


def backdoor_accuracy(hist: list[dict]) -> float | None:
    """The last evaluation's backdoor success rate, %, or None (no backdoor attack)."""
    rate = [h for h in hist if "mean_accuracy" in h][-1].get("backdoor_accuracy")
    return None if rate is None else 100 * rate


def round_seconds(hist: list[dict]) -> float:
    times = [h["time_s"] for h in hist[1:] if "time_s" in h]
    return float(np.mean(times)) if times else float("nan")


def table(results: dict, aggregators, attacks, malicious: float, seeds) -> str:
    cell = lambda v: f"{np.mean(v):.1f} ± {np.std(v):.1f}"  # noqa: E731
    base = np.mean([round_seconds(h) for h in results[("mean", "none")]]) if ("mean", "none") in results else None
    head = ["aggregator"] + [a if a == "none" else f"{a} ({malicious:.0%})" for a in attacks] + \
           ["round s (clean)", "x the mean's"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for agg in aggregators:
        cells = [agg]
        for att in attacks:
            hists = results[(agg, att)]
            text = cell([final_accuracy(h) for h in hists])
            rates = [backdoor_accuracy(h) for h in hists]
            if all(r is not None for r in rates):  # the backdoor's success rate beside the clean accuracy
                text += f" (backdoor {np.mean(rates):.1f} ± {np.std(rates):.1f})"
            cells.append(text)
        if (agg, "none") in results:
            sec = np.mean([round_seconds(h) for h in results[(agg, "none")]])
            cells += [f"{sec:.4f}", f"{sec / base:.2f}" if base else "-"]
        else:
            cells += ["-", "-"]
        rows.append("| " + " | ".join(cells) + " |")
    return (f"FedAvg, MNIST, logistic regression, 500 clients, 100 a round; final mean test accuracy % over the "
            f"clients (mean ± population std over seeds {','.join(map(str, seeds))})\n\n" + "\n".join(rows) + "\n")


def model_size(cfg: RunConfig) -> int:
    """The parameters a client's update holds (FedAvg shares them all)."""
    import jax
    import jax.numpy as jnp

    from jaxfl.core.trees import count_params
    from jaxfl.models import build_model
    shape = (1, 28, 28, cfg.channels)  # MNIST at the run's channel count
    return count_params(jax.eval_shape(build_model(cfg.model, 10).init, jax.random.key(0), jnp.zeros(shape))["params"])


def codec_dir(codec: str) -> str:
    """The folder name of a codec's runs ("quantize:bits=2,rotate=1" -> "quantize_bits2_rotate1")."""
    return codec.replace(":", "_").replace(",", "_").replace("=", "")


def compression_table(results: dict, seeds, size: int) -> str:
    plain = 32 * size
    rows = ["| codec (default parameters) | final accuracy % (mean ± std) | bits a client message | "
            "x fewer than 32-bit floats |", "|---|---|---|---|"]
    for codec, hists in results.items():
        acc = [final_accuracy(h) for h in hists]
        bits = hists[0][-1].get("train_upload_bits")
        bits = float(bits[0]) if bits else float(plain)
        rows.append(f"| {codec} | {np.mean(acc):.1f} ± {np.std(acc):.1f} | {bits:,.0f} | {plain / bits:.1f} |")
    return (f"FedAvg, MNIST, logistic regression, 500 clients, 100 a round, no attack; final mean test accuracy % "
            f"over the clients (mean ± population std over seeds {','.join(map(str, seeds))})\n\n"
            + "\n".join(rows) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0")
    p.add_argument("--aggregators", default=",".join(AGGREGATORS))
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--malicious", type=float, default=0.2)
    p.add_argument("--compressions", nargs="*", default=[], metavar="CODEC",
                   help=f"codecs to run clean, each a --compression value (NAME[:key=value,...], NAME of "
                        f"{', '.join(CODECS)}; none: the plain mean; e.g. topk:feedback=1); none given: no codec "
                        f"table")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out", default="runs/robustness")
    args = p.parse_args(argv)
    seeds = parse_seeds(args.seeds)
    aggregators = parse_list(args.aggregators, "--aggregators", choices=AGGREGATORS)
    attacks = parse_list(args.attacks, "--attacks", choices=tuple(ATTACKS))
    check_at_least("--rounds", args.rounds, 1)
    base = RunConfig(algorithm="fedavg", dataset="mnist", model="logreg", num_clients=500, clients_per_round=100,
                     rounds=args.rounds, batch_size=10, lr=0.01, momentum=0.0, eval_every=args.rounds)
    specs = {(a, t): spec(a, t, args.malicious) for a in aggregators for t in attacks}
    check_variants(specs.values(), base)
    codecs = list(dict.fromkeys(args.compressions))
    for c in codecs:  # each codec checked before the first run (a ConfigError: one line, exit 2)
        check_variants(["fedavg"], base.replace(compression=c))
    results = {}
    for key, s in specs.items():
        results[key] = run_seeds(s, base, args.out, seeds)
        print(key, round(float(np.mean([final_accuracy(h) for h in results[key]])), 2), flush=True)
    text = table(results, aggregators, attacks, args.malicious, seeds)
    (Path(args.out) / "table.md").write_text(text)
    # the table's inputs, per (aggregator|attack): each seed's final accuracy and mean round seconds
    (Path(args.out) / "table.json").write_text(json.dumps(
        {f"{a}|{t}": {"final_accuracy": [final_accuracy(h) for h in hs], "round_s": [round_seconds(h) for h in hs],
                      "backdoor_accuracy": [backdoor_accuracy(h) for h in hs]} for (a, t), hs in results.items()},
        indent=1))
    print(text)
    if codecs:
        # (the "none" codec is the clean mean's run, reused; a codec's runs live in codecs/<its spec>)
        found = {c: run_seeds(spec("mean", "none", 0.0), base, args.out, seeds) if c == "none" else
                 run_seeds("fedavg", base.replace(compression=c), Path(args.out) / "codecs" / codec_dir(c), seeds)
                 for c in codecs}
        size = model_size(base)
        text = compression_table(found, seeds, size)
        (Path(args.out) / "compression.md").write_text(text)
        (Path(args.out) / "compression.json").write_text(json.dumps(
            {c: {"final_accuracy": [final_accuracy(h) for h in hs],
                 "upload_bits": (hs[0][-1].get("train_upload_bits") or [32 * size])[0]}
             for c, hs in found.items()},
            indent=1))
        print(text)


if __name__ == "__main__":
    raise SystemExit(run_script(main))

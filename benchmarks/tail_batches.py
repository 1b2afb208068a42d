"""Partial last batches at a smaller size (``LocalTrainer.tail_sizes``, the CLI's ``--tail-batches``): one
cohort's local training with every step at B against the partial last batches at the smallest size that holds
them, of the eighths of B the clients' last batches take.

The clients of a ``throughput.py`` workload (``--workload``, e.g. the label-skewed FedAvg CNN over 1,000 clients),
``--cohort`` of them drawn once; each client trains one local epoch from the same initial model, one client at a
time (``lax.map``, one jitted call for the cohort, one device). The two programs run alternately, ``--reps``
times each after compiling, so that a load change on the machine falls on both; reported: each one's median and
least seconds a call, its compile seconds (the first call, minus a timed one), the computed/real samples of the
epoch (``buckets.padded_work``), each one's roofline (``roofline.py``: the real samples' FLOP/s and bytes/s
against the machine's measured peaks) and the largest difference of the trained parameters between them (the
same numbers up to float reassociation).

    python benchmarks/tail_batches.py --workload fedavg_cnn_dir0.3 --clients 1000 --cohort 50 --json out.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
import roofline  # noqa: E402
from throughput import SMALL, lognormal_counts, skewed_counts, small_population  # noqa: E402

from jaxfl.algorithms._common import ce_loss  # noqa: E402
from jaxfl.core.buckets import padded_work  # noqa: E402
from jaxfl.core.cohort import sample_cohort  # noqa: E402
from jaxfl.core.trainer import ClientRows, LocalTrainer  # noqa: E402
from jaxfl.models import build_model  # noqa: E402
from jaxfl.run.build import tails_chosen  # noqa: E402
from jaxfl.run.script import check_at_least, check_output_file, parse_list, run_script  # noqa: E402


def cohort_training(trainer: LocalTrainer, model, data, ids):
    """A jitted function of the initial params: the cohort ``ids`` trained one client at a time (trained params
    stacked over the cohort)."""
    loss = ce_loss(model)
    starts = np.concatenate([[0], np.cumsum(data.counts)[:-1]])
    counts = jnp.asarray(data.counts[ids], jnp.int32)
    length = int(data.counts[ids].max())
    rows = jnp.asarray(np.minimum(starts[ids][:, None] + np.arange(length), len(data.y) - 1), jnp.int32)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(1), i))(jnp.asarray(ids))
    x, y = jnp.asarray(data.x), jnp.asarray(data.y)

    def one(params, r, c, k):
        rows_ = ClientRows(x, y, r, c)
        return trainer.run(loss, params, {}, trainer.tx.init(params), rows_, k)[0]
    return jax.jit(lambda params: jax.lax.map(lambda a: one(params, *a), (rows, counts, keys)))


def measure(workload: str, clients: int, cohort: int, reps: int, seed: int = 0) -> dict:
    w = dict(SMALL[workload])
    batch = w["batch"]
    counts = (skewed_counts(w["dirichlet"], clients, w["samples"]) if "dirichlet" in w
              else lognormal_counts(clients, w["median"], w["sigma"]))
    data = small_population(w, counts)
    ids = np.asarray(sample_cohort(jax.random.key(seed), 0, clients, cohort))
    model = build_model(w["model"], w["classes"])
    params = model.init(jax.random.key(0), jnp.zeros((1,) + data.x.shape[1:], jnp.float32))["params"]
    base = LocalTrainer(optax.sgd(w["lr"]), batch, 1)
    sizes = tails_chosen("on", counts, batch) or (batch,)  # the sizes the last batches take
    programs = {"every step at B": cohort_training(base, model, data, ids),
                "tail sizes " + "/".join(map(str, sizes)):
                    cohort_training(dataclasses.replace(base, tail_sizes=sizes), model, data, ids)}
    out, first, trained = {}, {}, {}
    for name, fn in programs.items():
        t = time.perf_counter()
        trained[name] = jax.block_until_ready(fn(params))
        first[name] = time.perf_counter() - t
    times = {name: [] for name in programs}
    for _ in range(reps):  # alternately, so that a load change falls on both
        for name, fn in programs.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(params))
            times[name].append(time.perf_counter() - t)
    real = int(data.counts[ids].sum())
    work = {"every step at B": padded_work([], data.counts[ids], batch, per_client_trips=True)[0],
            list(programs)[1]: padded_work([], data.counts[ids], batch, per_client_trips=True, tail_sizes=sizes)[0]}
    cost, peaks = roofline.train_step_cost(model, data.x[:1], batch, w["lr"]), roofline.machine_peaks()
    for name in programs:
        median = float(np.median(times[name]))
        out[name] = {"median_s": median, "min_s": float(min(times[name])),
                     "compile_s": first[name] - median, "padded_work": work[name] / real,
                     **roofline.roofline(real / median, cost, peaks)}
    a, b = (jax.tree_util.tree_leaves(trained[n]) for n in programs)
    diff = max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(a, b))
    names = list(programs)
    return {"workload": workload, "clients": clients, "cohort": cohort, "batch": batch, "reps": reps,
            "real_samples": real, "runs": out, "max_abs_param_diff": diff,
            "speedup_median": out[names[0]]["median_s"] / out[names[1]]["median_s"],
            "train_step_cost": cost, **peaks,
            "device": jax.devices()[0].device_kind, "machine": platform.processor() or platform.machine(),
            "jax": jax.__version__}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="fedavg_cnn_dir0.3", help=f"one of {', '.join(SMALL)}")
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--cohort", type=int, default=50)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    parse_list(a.workload, "--workload", choices=tuple(SMALL))
    for flag, v in (("--clients", a.clients), ("--cohort", a.cohort), ("--reps", a.reps)):
        check_at_least(flag, v, 1)
    check_output_file(a.json, "--json")
    r = measure(a.workload, a.clients, min(a.cohort, a.clients), a.reps)
    for name, v in r["runs"].items():
        print(f"{name}: median {v['median_s']:.3f} s, least {v['min_s']:.3f} s, compile {v['compile_s']:.2f} s, "
              f"padded/real {v['padded_work']:.3f}, FLOP/s / peak {v['flops_fraction']:.3f}, "
              f"bytes/s / peak {v['bytes_fraction']:.3f}")
    print(f"speed-up (medians) {r['speedup_median']:.2f}x; largest parameter difference {r['max_abs_param_diff']:.2e}")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    raise SystemExit(run_script(main))

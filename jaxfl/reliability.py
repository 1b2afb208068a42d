"""Reliability of personalized predictions: calibration and uncertainty-based out-of-distribution detection.

For every client, on its own test set: accuracy, mean uncertainty, expected calibration error (confidence =
max class probability), and how well the uncertainty tells clean inputs from (a) the same inputs with
Gaussian noise of std ``noise_sigma`` added after normalisation (no clipping; RFedDis Fig. 3 uses 1.5) and
(b) another client's inputs (client i sees client (i + ood_shift) mod N's test set): AUROC with the noisy or
foreign inputs as positives. The uncertainty is the algorithm's own (``predict`` returning
{"uncertainty": [B]}, e.g. RFedDis's u_F = K / S_F) or, for softmax models, 1 - max probability.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .distributed import fetch
from .engine import ClientData, make_predict, normalizer, split_output
from .metrics import auroc, expected_calibration_error


def gaussian_noise(sigma: float):
    """transform(x, key) = x + sigma * N(0, 1), for ``make_predict``."""
    return lambda x, key: x + sigma * jax.random.normal(key, x.shape, x.dtype)


def probabilities_and_uncertainty(logits, extra):
    """(softmax(logits), extra["uncertainty"] or 1 - max probability), per sample."""
    probs = jax.nn.softmax(logits, -1)
    return probs, extra.get("uncertainty", 1.0 - jnp.max(probs, -1))


def predict_proba(alg, server, clients, client_id: int, x, preprocess=normalizer()):
    """Class probabilities [B, K] and uncertainty [B] of client ``client_id``'s personalized model on new raw
    inputs x [B, ...] (``preprocess`` must be the run's normaliser). For RFedDis: alpha_F / S_F and K / S_F."""
    client = jax.tree_util.tree_map(lambda a: a[client_id], clients)
    out = alg.predict(server, client, preprocess(x), jnp.asarray(client_id, jnp.int32))
    return probabilities_and_uncertainty(*split_output(out))


def reliability_report(alg, server, clients, test: ClientData, key, *, preprocess=normalizer(),
                       noise_sigma: float = 1.5, ood_shift: int = 1, n_bins: int = 15,
                       eval_batch_size: int = 256, strategy: str = "map", train: ClientData | None = None) -> dict:
    """Per-client lists: accuracy, ece, uncertainty (clean), uncertainty_noisy, uncertainty_other,
    auroc_noisy, auroc_other; and the raw per-sample uncertainties ``u_clean``/``u_noisy``/``u_other`` (real
    samples only) for density plots. ``test.y`` padding must be a multiple of ``eval_batch_size``. train: the
    clients' training sets, for an algorithm that predicts from them (``prepare_predict``, e.g. pFedGP); the
    "other" run keeps each client's own training set while its test inputs come from another client."""
    kw = dict(eval_batch_size=eval_batch_size, strategy=strategy, preprocess=preprocess)
    clean_fn = jax.jit(make_predict(alg, **kw))
    noisy_fn = jax.jit(make_predict(alg, transform=gaussian_noise(noise_sigma), **kw))
    other = jax.tree_util.tree_map(lambda a: jnp.roll(a, -ood_shift, axis=0), test)
    runs = {"clean": (clean_fn(server, clients, test, train=train), test),
            "noisy": (noisy_fn(server, clients, test, key, train=train), test),
            "other": (clean_fn(server, clients, other, train=train), other)}
    report = {k: [] for k in ("accuracy", "ece", "uncertainty", "uncertainty_noisy", "uncertainty_other",
                              "auroc_noisy", "auroc_other", "u_clean", "u_noisy", "u_other")}
    # fetch: gathered from every process when the clients are split over several (jaxfl.distributed)
    per_run = {name: fetch((probabilities_and_uncertainty(*out), d.count)) for name, (out, d) in runs.items()}
    labels = fetch(test.y)
    for i in range(test.num_clients):
        u = {name: np.asarray(pu[1][i][:counts[i]]) for name, (pu, counts) in per_run.items()}
        n = u["clean"].shape[0]
        probs = np.asarray(per_run["clean"][0][0][i][:n])
        correct = probs.argmax(-1) == labels[i, :n]
        report["accuracy"].append(float(correct.mean()))
        report["ece"].append(float(expected_calibration_error(probs.max(-1), correct, n_bins)))
        report["uncertainty"].append(float(u["clean"].mean()))
        report["uncertainty_noisy"].append(float(u["noisy"].mean()))
        report["uncertainty_other"].append(float(u["other"].mean()))
        report["auroc_noisy"].append(float(auroc(u["noisy"], u["clean"])))
        report["auroc_other"].append(float(auroc(u["other"], u["clean"])))
        for name in ("clean", "noisy", "other"):
            report[f"u_{name}"].append(u[name].tolist())
    return report


def plot_uncertainty_density(reports: dict, names: list[str], path, bins: int = 30) -> None:
    """PNG, one panel per client: histograms (densities) of the uncertainty on clean and noisy test inputs,
    one pair per algorithm in ``reports`` ({label: reliability_report(...)})."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
    for j, (ax, name) in enumerate(zip(axes[0], names)):
        for label, rep in reports.items():
            for kind, style in (("clean", "-"), ("noisy", "--")):
                u = np.asarray(rep[f"u_{kind}"][j])
                hist, edges = np.histogram(u, bins=bins, range=(0, 1), density=True)
                ax.plot(0.5 * (edges[1:] + edges[:-1]), hist, style, label=f"{label} {kind}")
        ax.set(title=name, xlabel="uncertainty", ylabel="density")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

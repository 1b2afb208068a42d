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

from ..core.evaluate import Evaluator
from ..core.trainer import normalizer
from ..core.types import split_output
from ..ops.diagnostics import auroc, expected_calibration_error


def gaussian_noise(sigma: float):
    """transform(x, key) = x + sigma * N(0, 1), for ``Evaluator.predictions``."""
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


def reliability_report(evaluator: Evaluator, server, clients, key, *, noise_sigma: float = 1.5, ood_shift: int = 1,
                       n_bins: int = 15) -> dict:
    """Per-client lists: accuracy, ece, uncertainty (clean), uncertainty_noisy, uncertainty_other,
    auroc_noisy, auroc_other; and the raw per-sample uncertainties ``u_clean``/``u_noisy``/``u_other`` (real
    samples only) for density plots. evaluator: the run's ``Evaluator`` (its test sets and, for an algorithm
    that predicts from them, e.g. pFedGP, its training sets: the "other" run keeps each client's own training
    set while its test inputs come from another client); clients: a ClientStore or the states stacked [N]."""
    runs = {"clean": evaluator.predictions(server, clients),
            "noisy": evaluator.predictions(server, clients, key, transform=gaussian_noise(noise_sigma)),
            "other": evaluator.predictions(server, clients, inputs_shift=ood_shift)}
    report = {k: [] for k in ("accuracy", "ece", "uncertainty", "uncertainty_noisy", "uncertainty_other",
                              "auroc_noisy", "auroc_other", "u_clean", "u_noisy", "u_other")}
    for i, (logits, extra, labels) in enumerate(runs["clean"]):
        u = {name: np.asarray(probabilities_and_uncertainty(run[i][0], run[i][1])[1]) for name, run in runs.items()}
        probs = np.asarray(jax.nn.softmax(logits, -1))
        correct = probs.argmax(-1) == labels
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

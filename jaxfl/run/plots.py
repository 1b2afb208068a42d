"""The PNG figures of a run: accuracy per round, and uncertainty densities of reliability reports."""
from __future__ import annotations

import numpy as np


# file types matplotlib writes without extra packages (what --plot may end in)
IMAGE_FORMATS = ("png", "pdf", "svg", "svgz", "jpg", "jpeg", "tif", "tiff", "eps", "ps")


def plotting_available() -> bool:
    """Whether matplotlib imports. It is a declared dependency; without it (a bare environment) a run skips its
    figure rather than failing after its last round, and says so."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_accuracy(history, names, path, title=""):
    """PNG: each client's test accuracy per round (thin; a gap where it was not evaluated), the unweighted mean
    (thick) and the global model's and the held-out clients' means where the run evaluated them (dashed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    evals = [h for h in history if "test_accuracy" in h]
    rounds = [h["round"] for h in evals]
    value = lambda v: np.nan if v is None else v  # noqa: E731  (a client or round without a value)
    acc = np.array([[value(a) for a in h["test_accuracy"]] for h in evals], float)
    from matplotlib.ticker import MaxNLocator
    fig, ax = plt.subplots(figsize=(7.5, 4))
    markers = "os^vD<>pXh"
    few = len(names) <= 12  # more clients: thin unlabelled lines, the mean stands out
    for j, name in enumerate(names):
        ax.plot(rounds, acc[:, j], lw=1 if few else 0.5, alpha=0.8 if few else 0.3,
                marker=markers[j % len(markers)] if few else None, ms=3, label=name if few else None)
    ax.plot(rounds, [value(h["mean_accuracy"]) for h in evals], lw=2.5, color="k", marker="o", ms=4,
            label="mean over clients")
    for key, label in (("global_mean_accuracy", "global model, mean"), ("new_mean_accuracy", "new clients, global"),
                       ("new_tuned_mean_accuracy", "new clients, after a local update")):
        if key in evals[-1]:
            ax.plot(rounds, [value(h.get(key)) for h in evals], lw=2, ls="--", marker="s", ms=3, label=label)
    ax.set(xlabel="round", ylabel="test accuracy", title=title, ylim=(0, 1))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside the curves
    ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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

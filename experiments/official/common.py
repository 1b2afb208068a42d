"""Shared plumbing of the official-code adapters: jaxfl's exact inputs, and jaxfl's metrics.jsonl format.

An adapter (``experiments/official/<method>.py``) runs a method's *official* training loop, from a checkout
named by an environment variable (never copied here), on the inputs a jaxfl run of the same ``RunConfig``
sees:

- ``jaxfl_inputs(cfg)``: the clients' train and test arrays after jaxfl's loading, partitioning, resizing and
  channel conversion (uint8 NHWC, the same samples in the same order), jaxfl's normalisation, and the cohort
  jaxfl draws in each round (``jaxfl.core.cohort.sample_cohort`` on the run's root key);
- ``to_nchw_float``: those images as the float NCHW arrays a PyTorch model takes, normalised as jaxfl's
  ``normalizer`` does;
- ``MetricsLog``: writes ``config.json`` and one ``metrics.jsonl`` record per round with jaxfl's keys
  (``round``, ``clients_trained``, ``train_loss``, ``test_accuracy``, ``test_loss``, ``mean_accuracy``,
  ``weighted_accuracy``, ``time_s``), so ``experiments/common.py``'s tables and plots read either run.

Adapters run in an environment with PyTorch and jaxfl installed (the official code needs PyTorch; jaxfl only
supplies the data), e.g. ``python -m venv ../venvs/torch; pip install torch==2.13.0 -e .``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import sys
import time
import types
from pathlib import Path

import numpy as np


class _AnyType(type):
    """An attribute of a stub module: a class constructible with any arguments, usable in annotations and as a
    base class, whose attributes are again such classes (``transforms.Compose([...])``,
    ``models.ResNet18_Weights.DEFAULT``)."""

    def __getattr__(cls, name):
        return _any_attribute(name)


def _any_attribute(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return _AnyType(name, (), {"__init__": lambda self, *a, **k: None})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        return _any_attribute(name)


def read_log(path: Path) -> list[dict]:
    """The records of a metrics.jsonl in jaxfl's format, or of its gzipped twin ``metrics.jsonl.gz`` where only that
    exists (committed logs are compacted: ``tools/compact_logs.py``); blank lines skipped. Without jaxfl, so that
    the official code's environment can read them too."""
    import gzip
    path = Path(path)
    packed = path.with_name(path.name + ".gz")
    if not path.is_file() and packed.is_file():
        path = packed
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def log_exists(path: Path) -> bool:
    """Whether a metrics.jsonl (or its gzipped twin) exists at ``path``."""
    path = Path(path)
    return path.is_file() or path.with_name(path.name + ".gz").is_file()


def stub_unimportable(name: str, submodules: tuple[str, ...] = ()) -> bool:
    """Stand-ins for a module the official code imports but an adapter's run never uses, when it does not import
    (absent, or built for another torch, as PyPI's torchvision is for the CPU torch): ``name`` and
    ``name.<sub>`` for each of ``submodules`` (in order; ``a.b`` after ``a``) become ``_StubModule``s, each set
    as its parent's attribute. Their attributes are classes constructible with anything whose instances do
    nothing and cannot be called (applying a stubbed transform is a TypeError). Returns whether it stubbed."""
    try:
        importlib.import_module(name)
        return False
    except Exception:
        pass
    for full in (name, *(f"{name}.{sub}" for sub in submodules)):
        sys.modules[full] = _StubModule(full)
        parent, _, child = full.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, sys.modules[full])
    return True


def official_repo(env_var: str, name: str) -> Path:
    """The official checkout named by ``env_var``; exits with one line if it is unset or missing."""
    path = os.environ.get(env_var)
    if not path or not Path(path).is_dir():
        raise SystemExit(f"official: error: set {env_var} to a checkout of {name} "
                         f"(git clone https://github.com/{name}); got {path!r}")
    return Path(path).resolve()


@dataclasses.dataclass
class JaxflInputs:
    """What a jaxfl run of ``cfg`` trains and tests on."""
    cfg: object                                   # the jaxfl RunConfig, resolved
    client_names: list[str]
    train: list[tuple[np.ndarray, np.ndarray]]    # per client: uint8 [n, H, W, C], int labels [n]
    test: list[tuple[np.ndarray, np.ndarray]]
    num_classes: int
    normalize: tuple[float, float]                # jaxfl's (mean, std) on [0, 1] pixels
    cohorts: list[np.ndarray]                     # per round: the sorted client ids jaxfl trains

    @property
    def num_clients(self) -> int:
        return len(self.client_names)


def jaxfl_inputs(cfg) -> JaxflInputs:
    """The data, normalisation and per-round cohorts of a jaxfl run of ``cfg`` (a ``jaxfl.run.config.RunConfig``)."""
    import jax

    from jaxfl.run.config import validate
    from jaxfl.data.federated import load_dataset, with_normalization
    from jaxfl.core.cohort import sample_cohort
    from jaxfl.run.build import cohort_size

    cfg = validate(cfg)
    ds = with_normalization(load_dataset(cfg.data_config()), cfg.normalize)
    n = len(ds.client_names)
    k = cohort_size(cfg, n)
    root = jax.random.key(cfg.seed)
    cohorts = [np.asarray(sample_cohort(root, r, n, k)) for r in range(cfg.rounds)]
    return JaxflInputs(cfg, list(ds.client_names), ds.train, ds.test, ds.num_classes, tuple(ds.normalize), cohorts)


def to_nchw_float(images: np.ndarray, normalize: tuple) -> np.ndarray:
    """uint8 [n, H, W, C] -> float32 [n, C, H, W], (x / 255 - mean) / std (jaxfl's ``normalizer``; mean and std
    scalars or one per channel)."""
    mean, std = (np.asarray(v, np.float32) for v in normalize)
    x = (images.astype(np.float32) / 255.0 - mean) / std
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


class MetricsLog:
    """``out/config.json`` and ``out/metrics.jsonl`` in jaxfl's format; ``round(...)`` appends one record.

    A rerun into the same directory starts the log afresh (adapters do not resume)."""

    def __init__(self, out: str | Path, client_names: list[str], config: dict):
        self.out = Path(out).resolve()  # (the official loops may change the working directory)
        self.out.mkdir(parents=True, exist_ok=True)
        self.names = client_names
        (self.out / "config.json").write_text(json.dumps(config, indent=2, default=str))
        self.path = self.out / "metrics.jsonl"
        self.path.write_text("")
        self.t0 = time.perf_counter()

    def round(self, round_1based: int, trained_ids, train_loss=None, test_accuracy=None, test_count=None,
              test_loss=None, **extra) -> dict:
        """Append round ``round_1based``: the trained clients' ids and train losses, and (on evaluated rounds)
        every client's test accuracy, loss and test-set size. Returns the record."""
        rec = {"round": int(round_1based), "clients_trained": [self.names[int(i)] for i in trained_ids]}
        if train_loss is not None:
            rec["train_loss"] = [float(v) for v in train_loss]
        if test_accuracy is not None:
            acc = np.asarray(test_accuracy, float)
            cnt = np.asarray(test_count, float)
            rec["test_accuracy"] = acc.tolist()
            if test_loss is not None:
                rec["test_loss"] = np.asarray(test_loss, float).tolist()
            rec["mean_accuracy"] = float(acc.mean())
            rec["weighted_accuracy"] = float((acc * cnt).sum() / cnt.sum())
        rec.update(extra)
        now = time.perf_counter()
        rec["time_s"], self.t0 = now - self.t0, now
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rec


def common_rounds(results: dict[str, list[list[dict]]]) -> dict[str, list[list[dict]]]:
    """The histories with only the evaluations at rounds every run evaluated (e.g. a run evaluated every 10th
    round beside one evaluated every round), so that "final" and "last 5" compare the same rounds."""
    evaluated = [{r["round"] for r in h if "mean_accuracy" in r} for hists in results.values() for h in hists]
    keep = set.intersection(*evaluated)
    return {k: [[r for r in h if "mean_accuracy" not in r or r["round"] in keep] for h in hists]
            for k, hists in results.items()}


def pooled_std(std_a: float, std_b: float) -> float:
    """sqrt((s_a^2 + s_b^2) / 2): the pooled seed-std of two sides with equal seed counts."""
    return float(np.sqrt((std_a ** 2 + std_b ** 2) / 2))


def agreement_bound(std_a: float, std_b: float) -> float:
    """The agreement criterion for two sides' mean accuracies (points): they agree when
    |mean_a - mean_b| <= max(2 pooled_std(std_a, std_b), 1.5)."""
    return max(2 * pooled_std(std_a, std_b), 1.5)


def experiments_common(path: str | Path | None = None):
    """``experiments/common.py`` (its tables and plots), loaded as module ``experiments_common`` (this directory
    has its own ``common``): ``path`` if given, else the file beside this folder or, if that one needs a newer
    jaxfl than the installed one, the installed checkout's copy."""
    def load(file):
        spec = importlib.util.spec_from_file_location("experiments_common", file)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    if path:
        return load(Path(path))
    candidates = [Path(__file__).resolve().parents[1] / "common.py"]
    with contextlib.suppress(ImportError):
        import jaxfl
        candidates.append(Path(jaxfl.__file__).resolve().parents[1] / "experiments" / "common.py")
    for candidate in candidates:
        with contextlib.suppress(ImportError):
            return load(candidate)
    raise SystemExit("cannot import experiments/common.py")

"""TensorFlow Federated's HDF5 files of the standard federated benchmarks, with their natural clients.

TFF (and FedML, which serves the same files) stores a split as one HDF5 file: a group ``examples`` with one
group per client id, holding that client's arrays, one row per example:

    EMNIST (Caldas et al. 2018, Reddi et al. 2021)  fed_emnist_train.h5 / fed_emnist_test.h5: ``pixels`` float32
        [n, 28, 28] in [0, 1] (white background: 1 is paper), ``label`` int [n] in [0, 62)
        (fed_emnist_digitsonly_*.h5: [0, 10)); 3,400 writers, the same ids in both splits.
    Shakespeare                                     shakespeare_train.h5 / shakespeare_test.h5: ``snippets``, the
        client's lines as byte strings [n]; 715 speaking roles, the same ids in both splits.
    CIFAR-100 (Reddi et al.'s Pachinko split)       fed_cifar100_train.h5 / fed_cifar100_test.h5: ``image`` uint8
        [n, 32, 32, 3], ``label`` int [n] in [0, 100) (``coarse_label`` unused); 500 training clients of 100
        images and 100 test clients, different ids.

What jaxfl makes of them (``--dataset tff_emnist:PATH``, ``tff_shakespeare:PATH``, ``tff_cifar100:PATH``; PATH is the
folder holding both files, or the training file itself, whose test file is the same name with ``train`` ->
``test``):

- EMNIST: one client per writer present in both splits; images as uint8 255 (1 - pixels), rounded, so ink is
  high and paper 0 as in MNIST (FedML's loader inverts them the same way); 62 classes (10 for a digits-only
  file, named ``digitsonly``).
- Shakespeare: one client per role present in both splits; its snippets joined by newlines, each split's text
  cut into every 80-character window and the character after it (``text.windows`` over LEAF's vocabulary,
  ``text.encode``: the ``char_lstm`` task of the LEAF loader), where FedOpt's TFF pipeline predicts every
  position of each snippet's 80-character chunks.
- CIFAR-100: one client per training client; a client's test split is a seeded 20% of its own images, since
  the test file's clients are other clients (TFF evaluates centrally on them); the test file is not read.

Deviations: the whole file is read into memory (EMNIST-62 is about 0.5 GB as uint8); nothing is read lazily.
Nothing is downloaded: TFF's ``tff.simulation.datasets.*.load_data`` caches these files (or FedML's download
scripts fetch them); h5py reads them (``pip install h5py``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import DataError
from . import text

FILES = {"emnist": "fed_emnist_train.h5", "shakespeare": "shakespeare_train.h5", "cifar100": "fed_cifar100_train.h5"}
Split = tuple[np.ndarray, np.ndarray]


def split_files(path: str | Path, kind: str) -> tuple[Path, Path]:
    """(train file, test file) of ``kind`` at ``path``: a folder holding ``FILES[kind]`` and its test twin, or a
    training file (its test file: the same name with ``train`` -> ``test``). DataError naming what is missing."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"TFF path {str(p)!r} does not exist; --dataset tff_{kind}:PATH takes the folder holding "
                        f"{FILES[kind]} and {FILES[kind].replace('train', 'test')}, or the training file")
    train = p / FILES[kind] if p.is_dir() else p
    if "train" not in train.name:
        raise DataError(f"{str(train)!r}: give TFF's training file (its name has 'train', e.g. {FILES[kind]}) or "
                        f"the folder holding it")
    test = train.with_name(train.name.replace("train", "test"))
    for f in (train, test):
        if not f.is_file():
            raise DataError(f"TFF file {str(f)!r} does not exist; --dataset tff_{kind}:PATH needs "
                            f"{train.name} and {test.name} in one folder (TFF's load_data caches them)")
    return train, test


def read_examples(path: Path, fields: tuple[str, ...]) -> dict[str, dict[str, np.ndarray]]:
    """{client id: {field: its array}} of a TFF HDF5 file (``examples/<client>/<field>``), clients sorted.
    DataError naming the file for one that is not HDF5, has no ``examples`` group, or lacks a field."""
    try:
        import h5py
    except ImportError:
        raise DataError(f"reading {str(path)!r} needs h5py: pip install h5py") from None
    try:
        with h5py.File(path, "r") as f:
            if "examples" not in f:
                raise DataError(f"{str(path)!r} has no 'examples' group; TFF's files hold examples/<client>/<field>")
            out = {}
            for cid in sorted(f["examples"]):
                group = f["examples"][cid]
                missing = [k for k in fields if k not in group]
                if missing:
                    raise DataError(f"{str(path)!r}: client {cid!r} has no {', '.join(missing)} (it has "
                                    f"{', '.join(sorted(group)) or 'nothing'}); expected {', '.join(fields)}")
                out[cid] = {k: group[k][()] for k in fields}
            return out
    except DataError:
        raise
    except (OSError, KeyError, TypeError) as e:
        raise DataError(f"{str(path)!r} is not a TFF HDF5 file ({e})") from None


def _labels(y, classes: int, where: str, cid: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:  # (a column: some exports keep it)
        y = y[:, 0]
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{where}: client {cid!r} has labels of shape {y.shape} and type {y.dtype}; expected "
                        f"integers [n]")
    if len(y) and not ((y >= 0) & (y < classes)).all():
        raise DataError(f"{where}: client {cid!r} has a label {int(y[(y < 0) | (y >= classes)][0])} outside "
                        f"[0, {classes})")
    return y.astype(np.int32)


def _emnist_images(pixels, where: str, cid: str) -> np.ndarray:
    x = np.asarray(pixels, np.float32)
    if x.ndim != 3 or x.shape[1:] != (28, 28):
        raise DataError(f"{where}: client {cid!r} has pixels of shape {x.shape}; EMNIST's are [n, 28, 28]")
    if not (np.isfinite(x).all() and (x >= 0).all() and (x <= 1).all()):
        raise DataError(f"{where}: client {cid!r} has pixel values outside [0, 1] (or NaN); TFF's EMNIST stores "
                        f"floats in [0, 1]")
    return np.round(255 * (1 - x)).astype(np.uint8)[..., None]


def load_tff_emnist(path: str | Path) -> tuple[dict[str, tuple[Split, Split]], int]:
    """({writer: ((x_train, y_train), (x_test, y_test))}, classes) of TFF's EMNIST: uint8 [n, 28, 28, 1] images
    (ink high), int32 labels; writers in both splits, sorted."""
    train_file, test_file = split_files(path, "emnist")
    classes = 10 if "digitsonly" in train_file.name else 62
    splits = [read_examples(f, ("pixels", "label")) for f in (train_file, test_file)]
    users = sorted(set(splits[0]) & set(splits[1]))
    if not users:
        raise DataError(f"no client appears in both {str(train_file)!r} and {str(test_file)!r}")
    return {u: tuple((_emnist_images(s[u]["pixels"], str(f), u), _labels(s[u]["label"], classes, str(f), u))
                     for s, f in zip(splits, (train_file, test_file))) for u in users}, classes


def load_tff_shakespeare(path: str | Path, seq_len: int = 80) -> dict[str, tuple[Split, Split]]:
    """{role: ((x_train, y_train), (x_test, y_test))}: each split's snippets joined by newlines, cut into every
    ``seq_len``-character window and the next character (token ids of ``text.LEAF_CHARS``); roles in both
    splits, sorted."""
    train_file, test_file = split_files(path, "shakespeare")
    splits = [read_examples(f, ("snippets",)) for f in (train_file, test_file)]

    def windows(snippets, where, cid):
        try:
            lines = [s.decode("utf-8", errors="replace") if isinstance(s, bytes) else str(s)
                     for s in np.asarray(snippets, object).reshape(-1)]
        except (TypeError, ValueError):
            raise DataError(f"{where}: client {cid!r} has snippets that are not strings") from None
        return text.windows(text.encode("\n".join(lines)), seq_len)
    roles = sorted(set(splits[0]) & set(splits[1]))
    if not roles:
        raise DataError(f"no client appears in both {str(train_file)!r} and {str(test_file)!r}")
    return {r: tuple(windows(s[r]["snippets"], str(f), r) for s, f in zip(splits, (train_file, test_file)))
            for r in roles}


def load_tff_cifar100(path: str | Path, rng: np.random.Generator,
                      test_fraction: float = 0.2) -> dict[str, tuple[Split, Split]]:
    """{client: ((x_train, y_train), (x_test, y_test))} of TFF's CIFAR-100 training clients: uint8 [n, 32, 32, 3]
    images, int32 fine labels; each client's test split a ``test_fraction`` of its images drawn from ``rng``."""
    train_file, _ = split_files(path, "cifar100")
    out = {}
    for cid, d in read_examples(train_file, ("image", "label")).items():
        x = np.asarray(d["image"])
        if x.ndim != 4 or x.shape[1:] != (32, 32, 3) or x.dtype != np.uint8:
            raise DataError(f"{str(train_file)!r}: client {cid!r} has images of shape {x.shape} and type {x.dtype}; "
                            f"CIFAR-100's are uint8 [n, 32, 32, 3]")
        y = _labels(d["label"], 100, str(train_file), cid)
        order = rng.permutation(len(y))
        cut = len(y) - max(1, int(round(test_fraction * len(y)))) if len(y) > 1 else len(y)
        tr, te = np.sort(order[:cut]), np.sort(order[cut:])
        out[cid] = ((x[tr], y[tr]), (x[te], y[te]))
    return out

"""FLAIR (Song et al. 2022: Flickr images, multi-label, one client per Flickr user) in pfl-research's HDF5 file.

pfl-research's ``benchmarks/dataset/flair/download_preprocess.py`` writes the federated dataset as one HDF5 file
(``flair_federated.hdf5``): per partition (``train``, ``val``, ``test``) and user, ``images`` uint8
[n, 256, 256, 3], the user's labels as sparse (row, column) pairs ``labels_row`` / ``labels_col`` (the 17 coarse
labels) and ``fine_grained_labels_row`` / ``fine_grained_labels_col`` (1,628 fine labels), ``image_ids``; and
``/metadata/label_mapping``, ``/metadata/fine_grained_label_mapping``, JSON {label: column}.

What jaxfl makes of it (``--dataset flair:PATH``, PATH the file): one client per user of the ``train``
partition (sorted; ``--num-clients N`` keeps the first N and reads only those), its images and the multi-hot rows
[n, 17] of its coarse labels (a multi-label task: ``core.metrics``' per-label binary cross-entropy and recall@5);
each client's test split is a seeded 20% of its own images, as for TFF's CIFAR-100, since FLAIR's ``val`` and
``test`` users are other users (pfl-research evaluates them centrally). Deviations: FLAIR's benchmark reports
averaged precision, not recall@5; the fine-grained labels are not read. The images are read lazily
(``jaxfl.data.lazy``: their shapes at load time, their values when used), the labels at load time.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import DataError
from .tff import Split, _h5py, lazy_dataset, own_test_split


def load_flair(path: str | Path, rng: np.random.Generator, test_fraction: float = 0.2,
               max_clients: int | None = None) -> tuple[dict[str, tuple[Split, Split]], int]:
    """({user: ((x_train, y_train), (x_test, y_test))}, labels) of pfl-research's FLAIR file: the ``train``
    users (the first ``max_clients``, sorted), uint8 images [n, H, W, 3] (``lazy.LazyArray``s, read when used),
    multi-hot uint8 coarse labels [n, L]
    (L from ``/metadata/label_mapping``); each user's test split a ``test_fraction`` of its images drawn from
    ``rng``. DataError naming the file for anything not in that layout."""
    h5py = _h5py()
    p = Path(path)
    if not p.is_file():
        raise DataError(f"FLAIR file {str(p)!r} does not exist; --dataset flair:PATH takes pfl-research's "
                        f"flair_federated.hdf5 (benchmarks/dataset/flair/download_preprocess.py writes it)")
    try:
        with h5py.File(p, "r") as f:
            if "train" not in f or "metadata" not in f or "label_mapping" not in f["metadata"]:
                raise DataError(f"{str(p)!r} is not pfl-research's FLAIR file: it needs /train/<user>/... and "
                                f"/metadata/label_mapping (it has {', '.join(sorted(f)) or 'nothing'})")
            labels = len(json.loads(f["metadata"]["label_mapping"][()]))
            users = sorted(f["train"])[:max_clients] if max_clients else sorted(f["train"])
            out = {}
            for u in users:
                g = f["train"][u]
                missing = [k for k in ("images", "labels_row", "labels_col") if k not in g]
                if missing:
                    raise DataError(f"{str(p)!r}: user {u!r} has no {', '.join(missing)}")
                x = lazy_dataset(p, ("train", u, "images"), g["images"].shape, g["images"].dtype)
                rows, cols = np.asarray(g["labels_row"], np.int64), np.asarray(g["labels_col"], np.int64)
                if x.ndim != 4 or x.shape[-1] != 3 or x.dtype != np.uint8:
                    raise DataError(f"{str(p)!r}: user {u!r} has images of shape {x.shape} and type {x.dtype}; "
                                    f"FLAIR's are uint8 [n, H, W, 3]")
                if len(rows) != len(cols) or (len(rows) and (rows.max() >= len(x) or cols.max() >= labels
                                                             or min(rows.min(), cols.min()) < 0)):
                    raise DataError(f"{str(p)!r}: user {u!r} has label pairs outside its {len(x)} images and "
                                    f"{labels} labels")
                y = np.zeros((len(x), labels), np.uint8)
                y[rows, cols] = 1
                out[u] = own_test_split(x, y, rng, test_fraction)
            return out, labels
    except DataError:
        raise
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise DataError(f"{str(p)!r} is not pfl-research's FLAIR file ({e})") from None

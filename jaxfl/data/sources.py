"""Where images come from: the ``.npz`` directory format, an image-folder tree, tensorflow-datasets, and
the embedded offline benchmark. Every loader returns ``(images uint8 [N, H, W, C], labels int64 [N])``.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import DataError


DATA_DIR_ENV = "JAXFL_DATA_DIR"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")


def data_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The data directory: ``explicit`` if given, else $JAXFL_DATA_DIR; DataError if neither is set."""
    path = explicit or os.environ.get(DATA_DIR_ENV)
    if not path:
        raise DataError(f"no data directory: pass --data-dir or set {DATA_DIR_ENV} (for example "
                        f"{DATA_DIR_ENV}=../shared/data), or use --dataset default, which needs no files")
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"data directory {str(path)!r} does not exist")
    return path


def npz_path(root: str | os.PathLike, benchmark: str, domain: str, split: str) -> Path:
    """Where a benchmark's split lives: ``root/benchmark/{domain}_{split}.npz``."""
    return Path(root) / benchmark / f"{domain}_{split}.npz"


def load_npz(root: Path, benchmark: str, domain: str, split: str, num_classes: int | None = None):
    """Read ``npz_path(root, benchmark, domain, split)`` with keys ``images`` [N,H,W,C] uint8, ``labels`` [N]
    (in [0, num_classes) when given: a label outside would give NaN losses)."""
    path = npz_path(root, benchmark, domain, split)
    if not path.is_file():
        raise DataError(f"missing data file {str(path)!r}; expected {benchmark}/{domain}_{split}.npz "
                        f"under the data directory")
    try:
        with np.load(path) as f:
            if "images" not in f or "labels" not in f:
                raise DataError(f"{str(path)!r} must hold arrays 'images' and 'labels', has {list(f.keys())}")
            images, labels = f["images"], f["labels"]
    except DataError:
        raise
    except Exception as e:  # a truncated or corrupt archive: zipfile, pickle or value errors of every kind
        raise DataError(f"{str(path)!r} is not a readable .npz archive ({type(e).__name__}: {e}); "
                        f"re-create or re-download it") from None
    labels = checked_labels(path, labels)
    images = checked_images(path, images)
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or len(images) != len(labels):
        raise DataError(f"{str(path)!r}: images {images.shape} and labels {labels.shape} do not match "
                        f"[N, H, W, C] and [N]")
    if not len(labels):
        raise DataError(f"{str(path)!r} holds no samples (images {images.shape}); every {split} split needs at "
                        f"least one per client: re-create the file")
    if num_classes is not None:
        bad = labels[(labels < 0) | (labels >= num_classes)]
        if bad.size:
            raise DataError(f"{str(path)!r}: label {int(bad[0])} is outside [0, {num_classes}) "
                            f"({bad.size} such labels); {benchmark} has {num_classes} classes")
    return images.astype(np.uint8), labels


def checked_labels(path, labels) -> np.ndarray:
    """Labels as int64 [N]: a column [N, 1] is taken as [N]; other shapes, fractions and non-numbers are one
    DataError naming the file."""
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1:
        raise DataError(f"{str(path)!r}: labels have shape {labels.shape}; give one integer class per sample, [N]")
    if labels.dtype.kind not in "iub" and not (labels.dtype.kind == "f" and np.all(np.isfinite(labels))
                                                and np.all(labels == np.round(labels))):
        raise DataError(f"{str(path)!r}: labels must be integer class ids, got {labels.dtype} values such as "
                        f"{labels.reshape(-1)[:1].tolist()}")
    return labels.astype(np.int64)


def checked_images(path, images) -> np.ndarray:
    """Images as uint8: uint8 as they are; integer or float arrays only when every value is a whole number in
    [0, 255] (what uint8 would store exactly). NaN/Inf, floats scaled to [0, 1] and values outside [0, 255]
    are one DataError naming the file (a cast would silently train on other pixels)."""
    images = np.asarray(images)
    if images.dtype == np.uint8:
        return images
    if images.dtype.kind not in "iuf":
        raise DataError(f"{str(path)!r}: images are {images.dtype}; give uint8 pixels in [0, 255]")
    if images.dtype.kind == "f" and not np.all(np.isfinite(images)):
        raise DataError(f"{str(path)!r}: images hold NaN or Inf ({int(np.sum(~np.isfinite(images)))} values); "
                        f"give uint8 pixels in [0, 255]")
    if images.size and (images.min() < 0 or images.max() > 255 or np.any(images != np.round(images))):
        lo, hi = float(images.min()), float(images.max())
        hint = " (floats in [0, 1]: multiply by 255 and save as uint8)" if 0 <= lo and hi <= 1 else ""
        raise DataError(f"{str(path)!r}: {images.dtype} images with values in [{lo:g}, {hi:g}]{hint}; give uint8 "
                        f"pixels in [0, 255]")
    return images.astype(np.uint8)


def load_image_folder(root: str | os.PathLike, size: int, channels: int = 3) -> dict:
    """Read ``root/<domain>/<class>/*.png|jpg`` -> {domain: (images [N,size,size,channels], labels)}.

    Class ids follow the sorted class-folder names, taken from the union over domains so every domain
    uses the same ids. For sets tfds lacks (Office-Caltech10, PACS). DataError naming an image that cannot be
    read, or a domain folder without any image (it would be a client with no data).
    """
    from PIL import Image, UnidentifiedImageError
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"image folder {str(root)!r} does not exist")
    domains = sorted(d for d in root.iterdir() if d.is_dir())
    classes = sorted({c.name for d in domains for c in d.iterdir() if c.is_dir()})
    if not domains or not classes:
        raise DataError(f"{str(root)!r} must contain <domain>/<class>/<image> folders")
    mode = "L" if channels == 1 else "RGB"
    out = {}
    for d in domains:
        images, labels = [], []
        for label, cls in enumerate(classes):
            for f in sorted((d / cls).glob("*")) if (d / cls).is_dir() else []:
                if f.suffix.lower() in IMAGE_SUFFIXES:
                    try:
                        with Image.open(f) as im:
                            im = im.convert(mode).resize((size, size), Image.BILINEAR)
                            images.append(np.asarray(im, np.uint8).reshape(size, size, channels))
                    except (OSError, UnidentifiedImageError) as e:  # (a damaged or truncated file)
                        raise DataError(f"image {str(f)!r} cannot be read ({e}); remove or replace it") from None
                    labels.append(label)
        if not images:
            raise DataError(f"domain folder {str(d)!r} holds no image ({', '.join(sorted(IMAGE_SUFFIXES))}) in "
                            f"<class> folders; add its images or remove the folder")
        out[d.name] = (np.stack(images), np.asarray(labels, np.int64))
    return out


def load_tfds(name: str, split: str, tfds_dir: str | None = None):
    """Load a tensorflow-datasets split as numpy (needs the ``tfds`` extra and, the first time, network).

    Never called by the tests: tfds retries downloads for minutes when offline.
    """
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise DataError(f"dataset tfds:{name} needs tensorflow-datasets: pip install 'jaxfl[tfds]'") from e
    ds = tfds.as_numpy(tfds.load(name, split=split, batch_size=-1, as_supervised=True, data_dir=tfds_dir))
    images, labels = ds
    if images.ndim == 3:
        images = images[..., None]
    return images.astype(np.uint8), labels.astype(np.int64)

"""LEAF's image benchmarks in their own file format, with their natural clients (one client per writer or
celebrity).

FEMNIST (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018): LEAF's preprocessing writes
``train/*.json`` and ``test/*.json``, each ``{"users": [...], "num_samples": [...], "user_data": {user: {"x":
[[784 floats in [0, 1]], ...], "y": [int in [0, 62)]}}}``; a writer's samples may be spread over several files.
``load_leaf_femnist`` reads both splits, keeps the writers present in both, and returns 28x28x1 uint8 images
(255 v, rounded; the values as LEAF stores them, background included) and int32 labels.

Nothing is downloaded: produce the files with LEAF's ``preprocess.sh`` (e.g. ``./preprocess.sh -s niid --sf 0.05
-k 0 -t sample`` in ``leaf/data/femnist``) and pass ``--dataset leaf_femnist:PATH`` with PATH holding ``train/``
and ``test/``.

CelebA (``--dataset leaf_celeba:PATH``): LEAF's json inputs name images (``"000001.jpg"``) and its labels are 0/1
(smiling); PATH is LEAF's ``data/celeba/data`` (``train/``, ``test/`` and ``raw/img_align_celeba/`` with the
CelebA images, which LEAF's README says where to get); ``load_leaf_celeba`` returns each celebrity's images
resized as LEAF's model reads them (84 x 84 RGB by default, ``--image-size``).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import DataError

FEMNIST_CLASSES = 62
SENT140_VOCAB = 10000  # the words ``load_leaf_sent140`` numbers for ``models.sent_lstm`` (one more id: the rest)
FEMNIST_PIXELS = 28 * 28


def read_leaf_split(root: Path, split: str, check=None) -> dict[str, tuple[list, list]]:
    """{user: (xs, ys)} of LEAF's json files ``root/split/*.json``, a user's samples from every file joined;
    ``check(file, user, data)`` (optional) may refuse a user's entry with a DataError. DataError naming the file
    for one that is not LEAF json or pairs a user's inputs and targets badly."""
    files = sorted((root / split).glob("*.json"))
    if not files:
        raise DataError(f"no LEAF json files in {str(root / split)!r}; expected train/*.json and test/*.json")
    data: dict[str, tuple[list, list]] = {}
    for f in files:
        try:
            blob = json.loads(f.read_text())
            for user in blob["users"]:
                d = blob["user_data"][user]
                if len(d["x"]) != len(d["y"]):
                    raise DataError(f"{str(f)!r}: LEAF user {user!r} has {len(d['x'])} inputs (x) and "
                                    f"{len(d['y'])} targets (y); they must pair up")
                if check is not None:
                    check(f, user, d)
                xs, ys = data.setdefault(user, ([], []))
                xs.extend(d["x"])
                ys.extend(d["y"])
        except DataError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{str(f)!r} is not LEAF json (users, user_data[user].x / .y): {e}") from None
    return data


def _images(user: str, xs: list, ys: list, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A writer's samples as uint8 [n, 28, 28, 1] and int32 [n]; DataError naming the writer and the split for
    an image that is not 784 values in [0, 1] or a label outside [0, 62)."""
    bad = [v for v in xs if not (isinstance(v, list) and len(v) == FEMNIST_PIXELS)]
    if bad:
        got = f"{len(bad[0])} values" if isinstance(bad[0], list) else f"a {type(bad[0]).__name__}"
        raise DataError(f"{where}: LEAF user {user!r} has an image of {got}; FEMNIST's have {FEMNIST_PIXELS} "
                        f"(28 x 28)")
    try:
        x = np.asarray(xs, np.float32).reshape(len(xs), -1) if xs else np.zeros((0, FEMNIST_PIXELS), np.float32)
        y = np.asarray(ys, np.int64).reshape(-1) if ys else np.zeros((0,), np.int64)
    except (ValueError, TypeError):
        raise DataError(f"{where}: LEAF user {user!r} has an image that is not a list of {FEMNIST_PIXELS} numbers "
                        f"or a label that is not an integer") from None
    if not (np.isfinite(x).all() and (x >= 0).all() and (x <= 1).all()):
        raise DataError(f"{where}: LEAF user {user!r} has pixel values outside [0, 1] (or NaN); FEMNIST stores "
                        f"floats in [0, 1]")
    if len(y) and not ((y >= 0).all() and (y < FEMNIST_CLASSES).all()):
        raise DataError(f"{where}: LEAF user {user!r} has a label {int(y[(y < 0) | (y >= FEMNIST_CLASSES)][0])} "
                        f"outside [0, {FEMNIST_CLASSES})")
    images = np.round(x * 255).astype(np.uint8).reshape(-1, 28, 28, 1)
    return images, y.astype(np.int32)


Split = tuple[np.ndarray, np.ndarray]


def read_leaf_users(root: Path, check=None, holds: str = "train/*.json and test/*.json"):
    """(train, test, users) of LEAF's json under ``root``: ``read_leaf_split`` of each split (``check`` as there)
    and the users in both, sorted. DataError for a folder that does not exist (``holds``: what it should hold)
    or no user in both splits."""
    if not root.is_dir():
        raise DataError(f"LEAF folder {str(root)!r} does not exist (it should hold {holds})")
    train, test = read_leaf_split(root, "train", check), read_leaf_split(root, "test", check)
    users = sorted(set(train) & set(test))
    if not users:
        raise DataError(f"no LEAF user appears in both {str(root / 'train')!r} and {str(root / 'test')!r}")
    return train, test, users


def load_leaf_femnist(path: str | Path) -> dict[str, tuple[Split, Split]]:
    """{writer: ((x_train, y_train), (x_test, y_test))} from LEAF's FEMNIST json under ``path``
    (``train/``, ``test/``), writers sorted, those missing from either split dropped."""
    root = Path(path)
    train, test, users = read_leaf_users(root)
    return {u: (_images(u, *train[u], str(root / "train")), _images(u, *test[u], str(root / "test")))
            for u in users}


def _celeba_images(root: Path, names: list, where: str, user: str, size: int) -> np.ndarray:
    """The named CelebA images of ``root/raw/img_align_celeba`` as uint8 [n, size, size, 3], each resized as LEAF's
    CelebA model reads it (``Image.resize((size, size))``, RGB). DataError naming a missing or unreadable file."""
    from PIL import Image, UnidentifiedImageError
    folder = root / "raw" / "img_align_celeba"
    out = np.zeros((len(names), size, size, 3), np.uint8)
    for i, name in enumerate(names):
        if not isinstance(name, str):
            raise DataError(f"{where}: LEAF user {user!r} has an input {name!r}; CelebA's are image file names")
        try:
            with Image.open(folder / name) as img:
                out[i] = np.asarray(img.resize((size, size)).convert("RGB"), np.uint8)
        except (OSError, UnidentifiedImageError) as e:
            raise DataError(f"{where}: LEAF user {user!r}'s image {str(folder / name)!r} cannot be read ({e}); "
                            f"CelebA's images belong in {str(folder)!r}") from None
    return out


def _celeba_labels(ys: list, where: str, user: str) -> np.ndarray:
    y = np.asarray(ys, np.float64).reshape(-1) if ys else np.zeros(0)
    if not np.isin(y, (0, 1)).all():
        raise DataError(f"{where}: LEAF user {user!r} has a label {y[~np.isin(y, (0, 1))][0]}; CelebA's are 0 or 1 "
                        f"(smiling)")
    return y.astype(np.int32)


def load_leaf_celeba(path: str | Path, size: int = 84) -> dict[str, tuple[Split, Split]]:
    """{celebrity: ((x_train, y_train), (x_test, y_test))} from LEAF's CelebA under ``path`` (LEAF's
    ``data/celeba/data``: ``train/*.json`` and ``test/*.json``, whose inputs name images in
    ``raw/img_align_celeba/``, labels 0/1: smiling): uint8 [n, size, size, 3] images (LEAF's model reads them at
    84 x 84), int32 labels; celebrities in both splits, sorted."""
    root = Path(path)
    train, test, users = read_leaf_users(root, holds="train/*.json, test/*.json and raw/img_align_celeba/")
    out = {}
    for u in users:
        out[u] = tuple((_celeba_images(root, xs, str(root / split), u, size), _celeba_labels(ys, str(root / split), u))
                       for split, (xs, ys) in (("train", train[u]), ("test", test[u])))
    return out


def sent140_words(text: str) -> list[str]:
    """LEAF's Sent140 tokenizer (``language_utils.split_line``): runs of word characters and apostrophes, and
    the marks . , ! ? ; each a token; case kept."""
    import re
    return re.findall(r"[\w']+|[.,!?;]", text)


def sent140_ids(text: str, vocab: dict[str, int], length: int = 25) -> np.ndarray:
    """The first ``length`` tokens' ids (``vocab``; an unknown word: len(vocab)), padded with len(vocab) as LEAF
    pads: int32 [length]."""
    unknown = len(vocab)
    ids = [vocab.get(w, unknown) for w in sent140_words(text)[:length]]
    return np.array(ids + [unknown] * (length - len(ids)), np.int32)


def load_leaf_sent140(path: str | Path, vocab_size: int = 10000,
                      length: int = 25) -> dict[str, tuple[Split, Split]]:
    """{user: ((x_train, y_train), (x_test, y_test))} from LEAF's Sent140 json under ``path`` (``train/``,
    ``test/``; each input LEAF's tweet record, its text at index 4; labels 0/1): each tweet's first ``length``
    tokens as ids of the ``vocab_size`` most frequent training words (ties by the word; ``sent140_ids``), int32
    labels; users in both splits, sorted. Deviation: LEAF numbers words by its GloVe vocabulary."""
    from .text import frequent_words
    root = Path(path)

    def tweets(f, user, d):
        if not all(isinstance(e, list) and len(e) > 4 and isinstance(e[4], str) for e in d["x"]):
            raise DataError(f"{str(f)!r}: LEAF user {user!r} has an input that is not a tweet record (a list with "
                            f"its text at index 4)")
    train, test, users = read_leaf_users(root, tweets)
    words = (w for u in train for e in train[u][0] for w in sent140_words(e[4]))
    vocab = {w: i for i, w in enumerate(frequent_words(words, vocab_size))}

    def split(xs, ys, where, user):
        y = np.asarray([int(float(v)) for v in ys], np.int32) if ys else np.zeros(0, np.int32)
        if len(y) and not np.isin(y, (0, 1)).all():
            raise DataError(f"{where}: LEAF user {user!r} has a label outside 0/1 (Sent140's sentiment)")
        x = np.stack([sent140_ids(e[4], vocab, length) for e in xs]) if xs else np.zeros((0, length), np.int32)
        return x, y
    return {u: (split(*train[u], str(root / "train"), u), split(*test[u], str(root / "test"), u)) for u in users}

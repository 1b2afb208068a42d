"""Per-client text for next-character prediction (LEAF's Shakespeare task): each client is one text; a sample is
``seq_len`` consecutive characters (token ids) and its label the character that follows.

Sources (all return ``{client name: text}``):
- ``synthetic_texts``: generated offline, per client a Markov chain over the vocabulary with its own
  character preferences (so clients differ), client lengths log-normal (LEAF-like);
- ``load_text_folder``: a folder of ``<client>.txt`` files;
- ``load_leaf_json``: LEAF's Shakespeare output (``train/*.json`` and ``test/*.json`` with ``users`` and
  ``user_data[user] = {"x": [80-character strings], "y": [next characters]}``), kept as LEAF split it.

``text_client`` turns a text into (x [n, seq_len] int32, y [n] int32) windows, split by position into train and
test (the test windows come after the training ones, with no shared characters, so overlapping windows do not
leak test text into training).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import DataError


# LEAF's Shakespeare vocabulary (models/utils/language_utils.py ALL_LETTERS): 80 characters
LEAF_CHARS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
VOCAB = len(LEAF_CHARS)
_INDEX = {c: i for i, c in enumerate(LEAF_CHARS)}
_SPACE = _INDEX[" "]


def encode(text: str) -> np.ndarray:
    """Token ids [len(text)] int32 in [0, 80); a character outside the vocabulary becomes a space (LEAF's
    ``letter_to_index`` would give -1, an invalid label)."""
    return np.fromiter((_INDEX.get(c, _SPACE) for c in text), np.int32, len(text))


def frequent_words(words, size: int) -> list[str]:
    """The ``size`` most frequent of ``words`` (an iterable of tokens), the most frequent first, ties by the
    word: a word-level vocabulary's order."""
    from collections import Counter
    return [w for w, _ in sorted(Counter(words).items(), key=lambda kv: (-kv[1], kv[0]))[:size]]


def windows(ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Every window of ``seq_len`` ids and the id after it: x [n, seq_len], y [n], n = len(ids) - seq_len."""
    n = max(len(ids) - seq_len, 0)
    if n == 0:
        return np.zeros((0, seq_len), np.int32), np.zeros((0,), np.int32)
    x = np.lib.stride_tricks.sliding_window_view(ids, seq_len)[:n]
    return np.ascontiguousarray(x, np.int32), ids[seq_len:seq_len + n].astype(np.int32)


def text_client(text: str, seq_len: int = 80, test_fraction: float = 0.2):
    """((x_train, y_train), (x_test, y_test)) of one client's text: its first 1 - test_fraction of the
    characters give the training windows, the rest the test windows (disjoint characters)."""
    ids = encode(text)
    cut = int(round(len(ids) * (1.0 - test_fraction)))
    return windows(ids[:cut], seq_len), windows(ids[cut:], seq_len)


def synthetic_texts(num_clients: int, rng: np.random.Generator, mean_chars: int = 2000, sigma: float = 0.5,
                    min_chars: int = 200) -> dict[str, str]:
    """Generated per-client texts: client i's characters follow a first-order Markov chain whose transition
    rows are a shared sparse "language" times client-specific preferences for some characters, so a model can
    learn the shared part and the clients differ; lengths are log-normal with median ``mean_chars`` and
    log-std ``sigma`` (at least ``min_chars``)."""
    letters = np.array([_INDEX[c] for c in "etaoinshrdlu etaoinshrdlu.,\n"])
    shared = rng.gamma(0.3, size=(VOCAB, VOCAB))
    shared[:, letters] += 2.0  # frequent characters everywhere
    out = {}
    for i in range(num_clients):
        taste = np.ones(VOCAB)
        taste[rng.choice(VOCAB, 8, replace=False)] = rng.uniform(3.0, 10.0, 8)
        p = shared * taste[None, :]
        p /= p.sum(1, keepdims=True)
        cum = np.cumsum(p, 1)
        n = max(min_chars, int(rng.lognormal(np.log(mean_chars), sigma)))
        u = rng.random(n)
        ids = np.empty(n, np.int64)
        ids[0] = rng.choice(letters)
        for t in range(1, n):  # inverse-CDF sampling of each next character
            ids[t] = min(int(np.searchsorted(cum[ids[t - 1]], u[t])), VOCAB - 1)
        out[f"speaker{i}"] = "".join(LEAF_CHARS[j] for j in ids)
    return out


def load_text_folder(path: str | Path) -> dict[str, str]:
    """{file stem: text} of every ``*.txt`` in ``path`` (one client per file), sorted by name."""
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"text folder {str(root)!r} does not exist")
    files = sorted(root.glob("*.txt"))
    if not files:
        raise DataError(f"text folder {str(root)!r} holds no .txt files (one per client)")
    return {f.stem: f.read_text(encoding="utf-8", errors="replace") for f in files}


def load_leaf_json(path: str | Path, seq_len: int = 80):
    """LEAF's split Shakespeare data: {user: ((x_train, y_train), (x_test, y_test))} from ``path/train/*.json``
    and ``path/test/*.json``; users missing from either split are dropped."""
    from .leaf import read_leaf_split

    def strings(f, user, d):
        if not all(isinstance(v, str) for v in (*d["x"], *d["y"])):
            raise DataError(f"{str(f)!r}: LEAF user {user!r} has an input or target that is not a string "
                            f"(Shakespeare's x are {seq_len}-character strings, y characters)")

    root = Path(path)
    splits = {split: read_leaf_split(root, split, strings) for split in ("train", "test")}
    out = {}
    for user in sorted(set(splits["train"]) & set(splits["test"])):
        pair = []
        for split in ("train", "test"):
            xs, ys = splits[split][user]
            bad = [s for s in xs if len(s) != seq_len]
            if bad:
                raise DataError(f"LEAF user {user!r}: an input of {len(bad[0])} characters, expected {seq_len}")
            x = np.stack([encode(s) for s in xs]) if xs else np.zeros((0, seq_len), np.int32)
            y = np.concatenate([encode(c[:1] or " ") for c in ys]) if ys else np.zeros((0,), np.int32)
            pair.append((x, y))
        out[user] = tuple(pair)
    if not out:
        raise DataError(f"no LEAF user appears in both {str(root / 'train')!r} and {str(root / 'test')!r}")
    return out

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
    Stack Overflow                                  stackoverflow_train.h5 / stackoverflow_test.h5: ``tokens``,
        each post's sentence as space-separated words (bytes) [n], ``title`` (bytes) [n], ``tags``, its tags
        joined by "|" (bytes) [n] (``score``, ``type``, ... unused); one client per user.

What jaxfl makes of them (``--dataset tff_emnist:PATH``, ``tff_shakespeare:PATH``, ``tff_cifar100:PATH``,
``tff_stackoverflow:PATH``, ``tff_stackoverflow_tags:PATH``; PATH is the
folder holding both files, or the training file itself, whose test file is the same name with ``train`` ->
``test``):

- EMNIST: one client per writer present in both splits; images as uint8 255 (1 - pixels), rounded, so ink is
  high and paper 0 as in MNIST (FedML's loader inverts them the same way); 62 classes (10 for a digits-only
  file, named ``digitsonly``).
- EMNIST autoencoder (``tff_emnist_ae:PATH``, FedOpt's EMNIST AE): the same clients and images as inputs, and
  as labels the reconstruction targets FedOpt's task uses, 1 - pixels flattened (float32 [n, 784] in [0, 1]):
  a reconstruction task (``core.metrics.squared_error`` of sigmoid outputs).
- Shakespeare: one client per role present in both splits; its snippets joined by newlines, each split's text
  cut into every 80-character window and the character after it (``text.windows`` over LEAF's vocabulary,
  ``text.encode``: the ``char_lstm`` task of the LEAF loader), where FedOpt's TFF pipeline predicts every
  position of each snippet's 80-character chunks.
- CIFAR-100: one client per training client; a client's test split is a seeded 20% of its own images, since
  the test file's clients are other clients (TFF evaluates centrally on them); the test file is not read.
- Stack Overflow (``tff_stackoverflow:PATH``): next-word prediction as FedOpt's task numbers words (pad 0, the
  10,000 most frequent words 1..10,000, one OOV id, beginning and end of sentence; ``word_lstm``): a user's
  first 1,000 sentences of each split as one stream, every 20-token window and the token after it. The
  vocabulary comes from the selected users' training sentences (FedOpt reads TFF's word counts of the whole
  training split), and every target counts in the accuracy (FedOpt leaves out pad, OOV and the sentence
  marks) and each window has one target (FedOpt predicts every position).

- Stack Overflow tags (``tff_stackoverflow_tags:PATH``): FedOpt's tag prediction ("Stack Overflow LR"), a
  multi-label task: a user's first 1,000 posts of each split, each post's ``tokens`` and ``title`` as word ids
  into the 10,000 most frequent words (``bow_logreg`` makes the normalised bag of words of them: the mean
  one-hot over the words and one OOV id, the OOV entry dropped, as FedOpt's pipeline), its ``tags`` as a
  multi-hot row over the 500 most frequent tags; trained with the per-tag binary cross-entropy, scored by
  recall@5 (``core.metrics``). Both vocabularies come from the selected users' training posts (FedOpt reads
  TFF's word and tag counts of the whole corpus); the score is recall@5 averaged over posts (Keras' Recall
  adds the hits and the tags of all posts before dividing), and test posts without any of the 500 tags are
  left out.

``--num-clients N`` keeps the first N clients by id (all by default), and only those are read from the files.

The images of EMNIST and CIFAR-100 are read lazily (``jaxfl.data.lazy``): at load time only their shapes,
and their values when a round, an evaluation or ``--lazy-inputs no`` (read them all at load) needs them; the
labels and the text datasets, whose vocabularies need every training sentence, are read at load time.
Nothing is downloaded: TFF's ``tff.simulation.datasets.*.load_data`` caches these files (or FedML's download
scripts fetch them); h5py reads them (``pip install h5py``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import DataError
from . import text
from .lazy import LazyArray, apply, take

FILES = {"emnist": "fed_emnist_train.h5", "shakespeare": "shakespeare_train.h5", "cifar100": "fed_cifar100_train.h5",
         "stackoverflow": "stackoverflow_train.h5"}
Split = tuple[np.ndarray, np.ndarray]


def split_files(path: str | Path, kind: str, prefix: str | None = None) -> tuple[Path, Path]:
    """(train file, test file) of ``kind`` at ``path``: a folder holding ``FILES[kind]`` and its test twin, or a
    training file (its test file: the same name with ``train`` -> ``test``). DataError naming what is missing and
    the ``--dataset`` prefix (default ``tff_<kind>``)."""
    prefix = prefix or f"tff_{kind}"
    p = Path(path)
    if not p.exists():
        raise DataError(f"TFF path {str(p)!r} does not exist; --dataset {prefix}:PATH takes the folder holding "
                        f"{FILES[kind]} and {FILES[kind].replace('train', 'test')}, or the training file")
    train = p / FILES[kind] if p.is_dir() else p
    if "train" not in train.name:
        raise DataError(f"{str(train)!r}: give TFF's training file (its name has 'train', e.g. {FILES[kind]}) or "
                        f"the folder holding it")
    test = train.with_name(train.name.replace("train", "test"))
    for f in (train, test):
        if not f.is_file():
            raise DataError(f"TFF file {str(f)!r} does not exist; --dataset {prefix}:PATH needs "
                            f"{train.name} and {test.name} in one folder (TFF's load_data caches them)")
    return train, test


def _h5py():
    try:
        import h5py
    except ImportError:
        raise DataError("reading TFF's HDF5 files needs h5py: pip install h5py (or 'jaxfl[data]')") from None
    return h5py


def client_ids(path: Path) -> list[str]:
    """The client ids of a TFF HDF5 file, sorted. DataError naming the file if it is not one."""
    h5py = _h5py()
    try:
        with h5py.File(path, "r") as f:
            if "examples" not in f:
                raise DataError(f"{str(path)!r} has no 'examples' group; TFF's files hold examples/<client>/<field>")
            return sorted(f["examples"])
    except DataError:
        raise
    except (OSError, KeyError, TypeError) as e:
        raise DataError(f"{str(path)!r} is not a TFF HDF5 file ({e})") from None


def lazy_dataset(path: Path, keys: tuple[str, ...], shape, dtype) -> LazyArray:
    """The HDF5 dataset ``path``/keys[0]/keys[1]/... as a ``LazyArray`` (read when used: the file is opened
    for each read); DataError naming the file if it cannot be read then."""
    def read():
        h5py = _h5py()
        try:
            with h5py.File(path, "r") as f:
                node = f
                for k in keys:
                    node = node[k]
                return node[()]
        except (OSError, KeyError, TypeError) as e:
            raise DataError(f"{str(path)!r}: cannot read {'/'.join(keys)} ({e})") from None
    return LazyArray(read, shape, dtype)


def read_examples(path: Path, fields: tuple[str, ...], ids=None,
                  lazy: tuple[str, ...] = ()) -> dict[str, dict]:
    """{client id: {field: its array}} of a TFF HDF5 file (``examples/<client>/<field>``), clients sorted; only
    the clients ``ids`` (default all) are read, and the fields in ``lazy`` only as ``lazy.LazyArray`` (their
    shape and dtype now, their values when used). DataError naming the file for one that is not HDF5, has no
    ``examples`` group, or lacks a field."""
    h5py = _h5py()
    wanted = client_ids(path) if ids is None else sorted(ids)
    try:
        with h5py.File(path, "r") as f:
            out = {}
            for cid in wanted:
                group = f["examples"][cid]
                missing = [k for k in fields if k not in group]
                if missing:
                    raise DataError(f"{str(path)!r}: client {cid!r} has no {', '.join(missing)} (it has "
                                    f"{', '.join(sorted(group)) or 'nothing'}); expected {', '.join(fields)}")
                out[cid] = {k: lazy_dataset(path, ("examples", cid, k), group[k].shape, group[k].dtype) if k in lazy
                            else group[k][()] for k in fields}
            return out
    except DataError:
        raise
    except (OSError, KeyError, TypeError) as e:
        raise DataError(f"{str(path)!r} is not a TFF HDF5 file ({e})") from None


def shared_clients(train: Path, test: Path, max_clients: int | None = None) -> list[str]:
    """The client ids in both files, sorted; the first ``max_clients`` of them (None: all). DataError if none."""
    ids = sorted(set(client_ids(train)) & set(client_ids(test)))
    if not ids:
        raise DataError(f"no client appears in both {str(train)!r} and {str(test)!r}")
    return ids[:max_clients] if max_clients else ids


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


def _check_emnist_shape(shape, where: str, cid: str) -> None:
    """DataError unless ``shape`` is EMNIST's pixels' [n, 28, 28] (known before the values of a lazy read)."""
    if len(shape) != 3 or tuple(shape[1:]) != (28, 28):
        raise DataError(f"{where}: client {cid!r} has pixels of shape {tuple(shape)}; EMNIST's are [n, 28, 28]")


def _emnist_images(pixels, where: str, cid: str) -> np.ndarray:
    """TFF's EMNIST pixels (float [n, 28, 28] in [0, 1], 1 is paper) as uint8 images [n, 28, 28, 1], ink high."""
    x = np.asarray(pixels, np.float32)
    _check_emnist_shape(x.shape, where, cid)
    if not (np.isfinite(x).all() and (x >= 0).all() and (x <= 1).all()):
        raise DataError(f"{where}: client {cid!r} has pixel values outside [0, 1] (or NaN); TFF's EMNIST stores "
                        f"floats in [0, 1]")
    return np.round(255 * (1 - x)).astype(np.uint8)[..., None]


def load_tff_emnist(path: str | Path, max_clients: int | None = None) -> tuple[dict[str, tuple[Split, Split]], int]:
    """({writer: ((x_train, y_train), (x_test, y_test))}, classes) of TFF's EMNIST: uint8 [n, 28, 28, 1] images
    (ink high; ``lazy.LazyArray``s, read when used), int32 labels; writers in both splits, sorted (the first
    ``max_clients`` of them)."""
    train_file, test_file = split_files(path, "emnist")
    classes = 10 if "digitsonly" in train_file.name else 62
    users = shared_clients(train_file, test_file, max_clients)
    splits = [read_examples(f, ("pixels", "label"), users, lazy=("pixels",)) for f in (train_file, test_file)]

    def images(pixels, where, cid):  # (bound now: the lazy reads run later)
        _check_emnist_shape(pixels.shape, where, cid)  # (with the file's row count, before any value is read)
        return apply(lambda p: _emnist_images(p, where, cid), pixels)
    return {u: tuple((images(s[u]["pixels"], str(f), u), _labels(s[u]["label"], classes, str(f), u))
                     for s, f in zip(splits, (train_file, test_file))) for u in users}, classes


def load_tff_emnist_ae(path: str | Path, max_clients: int | None = None) -> dict[str, tuple[Split, Split]]:
    """{writer: ((x_train, t_train), (x_test, t_test))} of TFF's EMNIST as FedOpt's autoencoder task: the inputs
    as ``load_tff_emnist``'s images (uint8 [n, 28, 28, 1], ink high), the targets FedOpt's 1 - pixels
    flattened (its ``_reshape_for_autoencoder``), float32 [n, 784] in [0, 1]; the labels are not read. Writers in
    both splits, sorted (the first ``max_clients``). Read at load time (the targets are the labels the loss
    reads: 3 KB a sample)."""
    train_file, test_file = split_files(path, "emnist", prefix="tff_emnist_ae")
    users = shared_clients(train_file, test_file, max_clients)
    splits = [read_examples(f, ("pixels",), users) for f in (train_file, test_file)]

    def pair(pixels, where, cid):
        x = _emnist_images(pixels, where, cid)  # (checks the shape and the range [0, 1])
        return x, (1 - np.asarray(pixels, np.float32)).reshape(len(x), 28 * 28)
    return {u: tuple(pair(s[u]["pixels"], str(f), u) for s, f in zip(splits, (train_file, test_file)))
            for u in users}


def _strings(values, where: str, cid: str, field: str) -> list[str]:
    """A client's byte strings [n] as str (UTF-8, bad bytes replaced); DataError if they are not strings."""
    try:
        return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)
                for v in np.asarray(values, object).reshape(-1)]
    except (TypeError, ValueError):
        raise DataError(f"{where}: client {cid!r} has {field} that are not strings") from None


def load_tff_shakespeare(path: str | Path, seq_len: int = 80,
                         max_clients: int | None = None) -> dict[str, tuple[Split, Split]]:
    """{role: ((x_train, y_train), (x_test, y_test))}: each split's snippets joined by newlines, cut into every
    ``seq_len``-character window and the next character (token ids of ``text.LEAF_CHARS``); roles in both
    splits, sorted (the first ``max_clients``)."""
    train_file, test_file = split_files(path, "shakespeare")
    roles = shared_clients(train_file, test_file, max_clients)
    splits = [read_examples(f, ("snippets",), roles) for f in (train_file, test_file)]

    def windows(snippets, where, cid):
        return text.windows(text.encode("\n".join(_strings(snippets, where, cid, "snippets"))), seq_len)
    return {r: tuple(windows(s[r]["snippets"], str(f), r) for s, f in zip(splits, (train_file, test_file)))
            for r in roles}


def load_tff_cifar100(path: str | Path, rng: np.random.Generator, test_fraction: float = 0.2,
                      max_clients: int | None = None) -> dict[str, tuple[Split, Split]]:
    """{client: ((x_train, y_train), (x_test, y_test))} of TFF's CIFAR-100 training clients (the first
    ``max_clients``, sorted): uint8 [n, 32, 32, 3] images (``lazy.LazyArray``s, read when used), int32 fine
    labels; each client's test split a ``test_fraction`` of its images drawn from ``rng``."""
    train_file, _ = split_files(path, "cifar100")
    out = {}
    ids = client_ids(train_file)[:max_clients] if max_clients else None
    for cid, d in read_examples(train_file, ("image", "label"), ids, lazy=("image",)).items():
        x = d["image"]
        if x.ndim != 4 or x.shape[1:] != (32, 32, 3) or x.dtype != np.uint8:
            raise DataError(f"{str(train_file)!r}: client {cid!r} has images of shape {x.shape} and type {x.dtype}; "
                            f"CIFAR-100's are uint8 [n, 32, 32, 3]")
        out[cid] = own_test_split(x, _labels(d["label"], 100, str(train_file), cid), rng, test_fraction)
    return out


def own_test_split(x: np.ndarray, y: np.ndarray, rng: np.random.Generator, fraction: float) -> tuple[Split, Split]:
    """((x_train, y_train), (x_test, y_test)) of one client: a ``fraction`` of its samples (at least one, none of a
    client with one sample) drawn from ``rng`` for testing, both parts in their original order (``x`` may be a
    ``lazy.LazyArray``: its parts are then lazy too)."""
    order = rng.permutation(len(y))
    cut = len(y) - max(1, int(round(fraction * len(y)))) if len(y) > 1 else len(y)
    tr, te = np.sort(order[:cut]), np.sort(order[cut:])
    return (take(x, tr), y[tr]), (take(x, te), y[te])


# Stack Overflow next-word prediction: the token ids FedOpt's task uses (pad 0, the V words 1..V, one OOV id,
# beginning and end of a sentence)
def stackoverflow_vocab(sentences, size: int = 10000) -> dict[str, int]:
    """{word: id in 1..size}: the ``size`` most frequent space-separated words of ``sentences`` (ties by the word),
    in that order."""
    return {w: i + 1 for i, w in enumerate(text.frequent_words((w for s in sentences for w in s.split()), size))}


def stackoverflow_ids(sentence: str, vocab: dict[str, int]) -> np.ndarray:
    """[bos] + each word's id (OOV: V + 1) + [eos], V = len(vocab), bos = V + 2, eos = V + 3: int32."""
    v = len(vocab)
    return np.array([v + 2] + [vocab.get(w, v + 1) for w in sentence.split()] + [v + 3], np.int32)


def load_tff_stackoverflow(path: str | Path, vocab_size: int = 10000, seq_len: int = 20, max_sentences: int = 1000,
                           max_clients: int | None = None) -> tuple[dict[str, tuple[Split, Split]], int]:
    """({user: ((x_train, y_train), (x_test, y_test))}, classes) of TFF's Stack Overflow for next-word
    prediction: each user's first ``max_sentences`` sentences (``tokens``, FedOpt's max elements per user) of
    each split as one stream of ``stackoverflow_ids``, cut into every ``seq_len``-token window and the token
    after it; the vocabulary of the ``vocab_size`` most frequent words of the selected users' training
    sentences; classes = vocab_size + 4 (pad, OOV, bos, eos). Users in both splits, sorted (the first
    ``max_clients``)."""
    train_file, test_file = split_files(path, "stackoverflow")
    users = shared_clients(train_file, test_file, max_clients)
    splits = [{u: _strings(d["tokens"], str(f), u, "tokens")[:max_sentences]
               for u, d in read_examples(f, ("tokens",), users).items()} for f in (train_file, test_file)]
    vocab = stackoverflow_vocab((s for sents in splits[0].values() for s in sents), vocab_size)
    classes = vocab_size + 4

    def windows(sentences):
        stream = np.concatenate([stackoverflow_ids(s, vocab) for s in sentences]) if sentences else \
            np.zeros(0, np.int32)
        return text.windows(stream, seq_len)
    return {u: (windows(splits[0][u]), windows(splits[1][u])) for u in users}, classes


# Stack Overflow tag prediction (FedOpt's "Stack Overflow LR"): a post's words as ids into the V most frequent
# words (OOV: V; padding: -1), its tags as a multi-hot row over the T most frequent tags
def load_tff_stackoverflow_tags(path: str | Path, vocab_size: int = 10000, tag_vocab_size: int = 500,
                                max_examples: int = 1000, max_clients: int | None = None
                                ) -> tuple[dict[str, tuple[Split, Split]], int]:
    """({user: ((x_train, y_train), (x_test, y_test))}, T) of TFF's Stack Overflow for tag prediction: each
    user's first ``max_examples`` posts of each split; a post's words are its ``tokens`` and ``title`` joined by
    a space, as ids into the ``vocab_size`` most frequent words of the selected users' training posts (an
    out-of-vocabulary word: ``vocab_size``), padded with -1 to the longest post read (int32 [n, L], what
    ``models.BagOfWordsEncoder`` reads); its ``tags`` ("|"-separated) as a multi-hot uint8 row [n, T] over the
    ``tag_vocab_size`` most frequent tags of those training posts (other tags are dropped). Test posts with none
    of the T tags are left out (their recall is undefined). Users in both splits, sorted (the first
    ``max_clients``)."""
    train_file, test_file = split_files(path, "stackoverflow", prefix="tff_stackoverflow_tags")
    users = shared_clients(train_file, test_file, max_clients)
    fields = ("tokens", "title", "tags")
    splits = []
    for f in (train_file, test_file):
        posts = {}
        for u, d in read_examples(f, fields, users).items():
            words, titles, tags = (_strings(d[k], str(f), u, k)[:max_examples] for k in fields)
            if not len(words) == len(titles) == len(tags):
                raise DataError(f"{str(f)!r}: client {u!r} has {len(words)} tokens, {len(titles)} titles and "
                                f"{len(tags)} tags; each post has one of each")
            posts[u] = ([f"{w} {t}".split() for w, t in zip(words, titles)], [[t for t in g.split("|") if t]
                                                                               for g in tags])
        splits.append(posts)
    vocab = {w: i for i, w in enumerate(text.frequent_words(
        (w for sents, _ in splits[0].values() for s in sents for w in s), vocab_size))}
    tag_vocab = {t: i for i, t in enumerate(text.frequent_words(
        (t for _, tags in splits[0].values() for g in tags for t in g), tag_vocab_size))}
    longest = max([len(s) for posts in splits for sents, _ in posts.values() for s in sents] + [1])

    def arrays(sentences, tags, test: bool):
        x = np.full((len(sentences), longest), -1, np.int32)
        y = np.zeros((len(sentences), tag_vocab_size), np.uint8)
        for i, (s, g) in enumerate(zip(sentences, tags)):
            x[i, :len(s)] = [vocab.get(w, vocab_size) for w in s]
            y[i, [tag_vocab[t] for t in g if t in tag_vocab]] = 1
        keep = y.any(1) if test else np.ones(len(y), bool)
        return x[keep], y[keep]
    return {u: (arrays(*splits[0][u], False), arrays(*splits[1][u], True)) for u in users}, tag_vocab_size

"""Federated datasets: per-client train/test arrays, named presets, and stacking into padded ClientData."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from ..errors import DataError, check_choice
from . import partition as part
from .embedded import load_embedded
from .sources import data_dir, load_image_folder, load_npz, load_tfds, npz_path
from .lazy import LazyArray, apply, take
from .transforms import prepare


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What to load and how to split it. ``None`` means the preset's default."""
    dataset: str = "default"
    data_dir: str | None = None
    num_clients: int | None = None          # label-skew presets (cifar10, mnist, tfds:*); tff_*: the first N
    clients_per_domain: int = 1             # domain presets (default, digits, pacs, folder:*)
    partition: str | None = None            # iid | dirichlet | shards | dirichlet_quantity
    dirichlet_alpha: float = 0.5
    client_sizes: str = "equal"             # dirichlet_quantity: equal | lognormal
    size_sigma: float = 0.5                 # dirichlet_quantity lognormal: sigma of the log client size
    classes_per_client: int = 2
    samples_per_client: int | None = None   # training samples per client (cap)
    test_per_client: int | None = None      # test samples per client (cap)
    image_size: int | None = None
    channels: int = 3
    lazy_inputs: str = "auto"               # natural-client files: read inputs when used (yes) | at load (no) | auto
    seed: int = 0


@dataclasses.dataclass
class FederatedDataset:
    """Per-client arrays (uint8 images, int labels) of a benchmark, before stacking."""
    name: str
    client_names: list[str]
    train: list[tuple[np.ndarray, np.ndarray]]
    test: list[tuple[np.ndarray, np.ndarray]]
    num_classes: int
    normalize: tuple[float, float] = (0.5, 0.5)
    # what the labels are: class ids [n] (classification), multi-hot rows [n, num_classes] (multilabel:
    # ``core.metrics.multilabel``) or float targets [n, num_classes] (reconstruction: ``core.metrics.reconstruction``)
    task: str = "classification"

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.train[0][0].shape[1:]

    def train_counts(self) -> np.ndarray:
        return np.array([len(y) for _, y in self.train])


def _cap(x, y, n, rng):
    """The first n samples of a seeded permutation (all if n is None or larger); a lazy ``x`` stays lazy."""
    idx = np.sort(rng.permutation(len(y))[: len(y) if n is None else n])
    return take(x, idx), y[idx]


def _domain_clients(name, domains: dict, cfg: DataConfig, rng, num_classes, size, defaults=None):
    """One client per domain (or ``clients_per_domain`` IID shares of it).

    domains: {domain: (train_x, train_y, test_x, test_y)} already in the model's input format.
    """
    k = cfg.clients_per_domain
    if k < 1:
        raise DataError(f"clients_per_domain={k} must be at least 1")
    spc = cfg.samples_per_client if cfg.samples_per_client is not None else (defaults or {}).get("spc")
    names, train, test = [], [], []
    for dom, (tx, ty, vx, vy) in domains.items():
        tx, ty = _cap(tx, ty, None if spc is None else spc * k, rng)
        fewest = min(len(ty), len(vy))  # (each client needs a training and a test sample)
        if k > fewest:
            raise DataError(f"--clients-per-domain {k}: domain {dom!r} of {name} has {len(ty)} training and "
                            f"{len(vy)} test samples; give at most {fewest}")
        for j, (ti, vi) in enumerate(zip(part.iid(ty, k, rng), part.iid(vy, k, rng))):
            names.append(dom if k == 1 else f"{dom}-{j}")
            train.append((tx[ti], ty[ti]))
            test.append(_cap(vx[vi], vy[vi], cfg.test_per_client, rng))
    return FederatedDataset(name, names, train, test, num_classes)


def _label_skew_clients(name, train_xy, test_xy, cfg: DataConfig, rng, num_classes, default_partition):
    """Split one source over ``num_clients`` by a label-skew partitioner; tests follow each train mix."""
    (tx, ty), (vx, vy) = train_xy, test_xy
    n = cfg.num_clients or 10
    kind = cfg.partition or default_partition
    parts = part.partition(kind, ty, n, rng, alpha=cfg.dirichlet_alpha,
                           classes_per_client=cfg.classes_per_client, sizes=cfg.client_sizes, sigma=cfg.size_sigma)
    if cfg.samples_per_client is not None:
        parts = [np.sort(rng.permutation(p)[: cfg.samples_per_client]) for p in parts]
    test_parts = part.split_like(parts, ty, vy, rng)
    train = [(tx[p], ty[p]) for p in parts]
    test = [_cap(vx[p], vy[p], cfg.test_per_client, rng) for p in test_parts]
    return FederatedDataset(name, [f"client{i}" for i in range(n)], train, test, num_classes)


def _split_fraction(x, y, rng, test_fraction=0.2):
    idx = rng.permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    te, tr = np.sort(idx[:n_test]), np.sort(idx[n_test:])
    return x[tr], y[tr], x[te], y[te]


def _default(cfg, rng):
    size = cfg.image_size or 32
    doms = {d: _split_fraction(prepare(x, size, cfg.channels), y, rng)
            for d, (x, y) in load_embedded(size).items()}
    return _domain_clients("default", doms, cfg, rng, 10, size)


DIGITS_DOMAINS = ("mnistm", "mnist", "usps")
DIGITS_OPTIONAL = ("synth", "svhn")  # used when a user supplies {domain}_{train,test}.npz


def _digits(cfg, rng):
    root = data_dir(cfg.data_dir)
    size = cfg.image_size or 32
    found = [d for d in DIGITS_OPTIONAL if npz_path(root, "digits", d, "train").is_file()]
    doms = {}
    for d in DIGITS_DOMAINS + tuple(found):
        tx, ty = load_npz(root, "digits", d, "train", 10)
        vx, vy = load_npz(root, "digits", d, "test", 10)
        tx, ty = _cap(tx, ty, (cfg.samples_per_client or 1000) * cfg.clients_per_domain, rng)
        doms[d] = (prepare(tx, size, cfg.channels), ty, prepare(vx, size, cfg.channels), vy)
    return _domain_clients("digits", doms, cfg, rng, 10, size, {"spc": 1000})


PACS_DOMAINS = ("art_painting", "cartoon", "photo", "sketch")


def _pacs(cfg, rng):
    root = data_dir(cfg.data_dir)
    size = cfg.image_size or 32
    doms = {}
    for d in PACS_DOMAINS:
        tx, ty = load_npz(root, "pacs", d, "train", 7)
        vx, vy = load_npz(root, "pacs", d, "val", 7)
        doms[d] = (prepare(tx, size, cfg.channels), ty, prepare(vx, size, cfg.channels), vy)
    ds = _domain_clients("pacs", doms, cfg, rng, 7, size)
    ds.normalize = (0.0, 1.0)  # FedBN's Office/DomainNet pipeline: ToTensor, no mean/std
    return ds


def _npz_label_skew(benchmark, domain, test_split, num_classes, default_size, default_partition):
    def build(cfg, rng):
        root = data_dir(cfg.data_dir)
        size = cfg.image_size or default_size
        tx, ty = load_npz(root, benchmark, domain, "train", num_classes)
        vx, vy = load_npz(root, benchmark, domain, test_split, num_classes)
        return _label_skew_clients(domain, (prepare(tx, size, cfg.channels), ty),
                                   (prepare(vx, size, cfg.channels), vy), cfg, rng, num_classes,
                                   default_partition)
    return build


def _tfds(cfg, rng, name):
    size = cfg.image_size or 32
    tx, ty = load_tfds(name, "train", cfg.data_dir)
    vx, vy = load_tfds(name, "test", cfg.data_dir)
    k = int(max(ty.max(), vy.max())) + 1
    return _label_skew_clients(name, (prepare(tx, size, cfg.channels), ty),
                               (prepare(vx, size, cfg.channels), vy), cfg, rng, k, "dirichlet")


def _folder(cfg, rng, path):
    size = cfg.image_size or 32
    found = load_image_folder(path, size, cfg.channels)
    doms = {d: _split_fraction(x, y, rng) for d, (x, y) in found.items()}
    k = int(max(y.max() for _, y in found.values())) + 1
    return _domain_clients(Path(path).name, doms, cfg, rng, k, size)


def _text_clients(name, texts: dict, cfg, rng):
    """Next-character clients from {client: text} (``text.text_client``: train / test windows split by position),
    capped at samples_per_client / test_per_client windows."""
    from . import text
    train, test = [], []
    for t in texts.values():
        (tx, ty), (vx, vy) = text.text_client(t)
        train.append(_cap(tx, ty, cfg.samples_per_client, rng))
        test.append(_cap(vx, vy, cfg.test_per_client, rng))
    return FederatedDataset(name, list(texts), train, test, text.VOCAB)


def _synthetic_text(cfg, rng):
    from . import text
    n = cfg.num_clients or 100
    return _text_clients("synthetic_text", text.synthetic_texts(n, rng, sigma=cfg.size_sigma), cfg, rng)


def _text_folder(cfg, rng, path):
    from . import text
    return _text_clients(Path(path).name, text.load_text_folder(path), cfg, rng)


def _leaf(cfg, rng, path):
    from . import text
    users = text.load_leaf_json(path)
    train = [_cap(*tr, cfg.samples_per_client, rng) for tr, _ in users.values()]
    test = [_cap(*te, cfg.test_per_client, rng) for _, te in users.values()]
    return FederatedDataset(Path(path).name, list(users), train, test, text.VOCAB)


def _leaf_femnist(cfg, rng, path):
    from .leaf import FEMNIST_CLASSES, load_leaf_femnist
    users = load_leaf_femnist(path)
    size = cfg.image_size or 28
    train = [_cap(prepare(x, size, cfg.channels), y, cfg.samples_per_client, rng) for (x, y), _ in users.values()]
    test = [_cap(prepare(x, size, cfg.channels), y, cfg.test_per_client, rng) for _, (x, y) in users.values()]
    return FederatedDataset(Path(path).name, list(users), train, test, FEMNIST_CLASSES)


def _leaf_celeba(cfg, rng, path):
    from .leaf import load_leaf_celeba
    size = cfg.image_size or 84
    users = load_leaf_celeba(path, size)
    train = [_cap(prepare(x, size, cfg.channels), y, cfg.samples_per_client, rng) for (x, y), _ in users.values()]
    test = [_cap(prepare(x, size, cfg.channels), y, cfg.test_per_client, rng) for _, (x, y) in users.values()]
    return FederatedDataset(Path(path).name, list(users), train, test, 2)


def _leaf_sent140(cfg, rng, path):
    from .leaf import SENT140_VOCAB, load_leaf_sent140
    users = load_leaf_sent140(path, SENT140_VOCAB)
    train = [_cap(*tr, cfg.samples_per_client, rng) for tr, _ in users.values()]
    test = [_cap(*te, cfg.test_per_client, rng) for _, te in users.values()]
    return FederatedDataset(Path(path).name, list(users), train, test, 2)


LAZY_INPUTS = ("auto", "yes", "no")
LAZY_SHARE = 4  # auto: inputs read when used once they would take more than 1 / LAZY_SHARE of the host's memory


def host_memory_bytes() -> int:
    """The host's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _natural(path, clients: dict, classes: int, cfg, rng, fit=None, task: str = "classification") -> FederatedDataset:
    """The dataset of a file's natural clients {name: ((x_train, y_train), (x_test, y_test))}: each split's
    inputs through ``fit`` (resizing, channels; None: as they are), then capped by --samples-per-client and
    --test-per-client (every client's training split, then every test split, drawing from ``rng``).

    Inputs a loader gives as ``lazy.LazyArray`` stay lazy (read when a round or an evaluation uses them) under
    ``cfg.lazy_inputs`` yes, and under auto where all of them would take more than 1 / ``LAZY_SHARE`` of the
    host's memory; otherwise they are read here."""
    train = [_cap(x if fit is None else apply(fit, x), y, cfg.samples_per_client, rng)
             for (x, y), _ in clients.values()]
    test = [_cap(x if fit is None else apply(fit, x), y, cfg.test_per_client, rng) for _, (x, y) in clients.values()]
    inputs = [x for x, _ in train + test]
    if any(isinstance(x, LazyArray) for x in inputs):
        size = sum(x.nbytes for x in inputs)
        lazy = {"yes": True, "no": False}.get(cfg.lazy_inputs, size * LAZY_SHARE > host_memory_bytes())
        if not lazy:
            train, test = ([(np.asarray(x), y) for x, y in split] for split in (train, test))
    return FederatedDataset(Path(path).name, list(clients), train, test, classes, task=task)


def _tff_emnist(cfg, rng, path):
    from .tff import load_tff_emnist
    users, classes = load_tff_emnist(path, max_clients=cfg.num_clients)
    return _natural(path, users, classes, cfg, rng, lambda x: prepare(x, cfg.image_size or 28, cfg.channels))


def _tff_emnist_ae(cfg, rng, path):
    from .tff import load_tff_emnist_ae
    if cfg.image_size not in (None, 28):
        raise DataError(f"--dataset {cfg.dataset}: the autoencoder reconstructs EMNIST's 28 x 28 pixels; drop "
                        f"--image-size {cfg.image_size}")
    ds = _natural(path, load_tff_emnist_ae(path, max_clients=cfg.num_clients), 28 * 28, cfg, rng,
                  lambda x: prepare(x, 28, cfg.channels), task="reconstruction")
    ds.normalize = (0.0, 1.0)  # the input FedOpt feeds: 1 - pixels in [0, 1] (here x / 255)
    return ds


def _tff_shakespeare(cfg, rng, path):
    from . import text
    from .tff import load_tff_shakespeare
    return _natural(path, load_tff_shakespeare(path, max_clients=cfg.num_clients), text.VOCAB, cfg, rng)


def _tff_cifar100(cfg, rng, path):
    from .tff import load_tff_cifar100
    clients = load_tff_cifar100(path, rng, max_clients=cfg.num_clients)
    return _natural(path, clients, 100, cfg, rng, lambda x: prepare(x, cfg.image_size or 32, cfg.channels))


def _tff_stackoverflow(cfg, rng, path):
    from .tff import load_tff_stackoverflow
    return _natural(path, *load_tff_stackoverflow(path, max_clients=cfg.num_clients), cfg, rng)


def _tff_stackoverflow_tags(cfg, rng, path):
    from .tff import load_tff_stackoverflow_tags
    return _natural(path, *load_tff_stackoverflow_tags(path, max_clients=cfg.num_clients), cfg, rng,
                    task="multilabel")


def _flair(cfg, rng, path):
    from .flair import load_flair
    users, labels = load_flair(path, rng, max_clients=cfg.num_clients)
    # (FLAIR's images are 256x256: --image-size resizes them)
    return _natural(path, users, labels, cfg, rng, lambda x: prepare(x, cfg.image_size or x.shape[1], cfg.channels),
                    task="multilabel")


PRESETS = {
    "default": _default,
    "digits": _digits,
    "pacs": _pacs,
    "cifar10": _npz_label_skew("cifar10", "cifar10", "test", 10, 32, "shards"),
    "mnist": _npz_label_skew("digits", "mnist", "test", 10, 28, "dirichlet"),
    "synthetic_text": _synthetic_text,
}
PREFIXES = {"tfds:": _tfds, "folder:": _folder, "text:": _text_folder, "leaf:": _leaf, "leaf_femnist:": _leaf_femnist,
            "leaf_celeba:": _leaf_celeba, "leaf_sent140:": _leaf_sent140,
            "tff_emnist:": _tff_emnist, "tff_emnist_ae:": _tff_emnist_ae, "tff_shakespeare:": _tff_shakespeare,
            "tff_cifar100:": _tff_cifar100,
            "tff_stackoverflow:": _tff_stackoverflow, "tff_stackoverflow_tags:": _tff_stackoverflow_tags,
            "flair:": _flair}
# Input scalings of uint8 images a run can choose instead of its dataset's own (``FederatedDataset.normalize``):
# (mean, std) of x / 255, scalars or one value per channel.
NORMALIZATIONS = {"imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # torchvision's ImageNet statistics
                  # CIFAR-10's per-channel statistics as FedTP's code (utils.py:1292) and many others use them
                  # (the std is that of a per-image statistic, not the dataset's 0.247, 0.243, 0.261)
                  "cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
                  "unit": (0.0, 1.0)}


def with_normalization(ds: FederatedDataset, name: str) -> FederatedDataset:
    """``ds`` scaled by ``NORMALIZATIONS[name]`` ("dataset": as it is); DataError where per-channel statistics
    do not match its images' channels."""
    if name == "dataset":
        return ds
    mean, std = NORMALIZATIONS[name]
    channels = ds.input_shape[-1] if len(ds.input_shape) == 3 else None
    if isinstance(mean, tuple) and channels != len(mean):
        raise DataError(f"--normalize {name} scales {len(mean)} channels; the images of this dataset have shape "
                         f"{ds.input_shape} (for grey images use --channels 3, or --normalize unit)")
    return dataclasses.replace(ds, normalize=(mean, std))


# token ids, for the char_lstm, word_lstm, sent_lstm and bow_logreg models
TEXT_DATASETS = ("synthetic_text", "text:", "leaf:", "leaf_sent140:", "tff_shakespeare:",
                 "tff_stackoverflow:", "tff_stackoverflow_tags:")
# multi-hot labels [n, classes]: a multi-label task (binary cross-entropy per class, recall@5)
MULTILABEL_DATASETS = ("tff_stackoverflow_tags:", "flair:")
# float targets [n, D] in [0, 1]: a reconstruction task (squared error of sigmoid outputs, scored by 1 - MSE)
RECONSTRUCTION_DATASETS = ("tff_emnist_ae:",)
TFDS_NAMES = ("mnist", "svhn_cropped", "cifar10", "cifar100", "domainnet")
# what follows each prefix
PREFIX_ARGUMENT = {"tfds:": "NAME", "folder:": "PATH", "text:": "PATH", "leaf:": "PATH", "leaf_femnist:": "PATH",
                   "leaf_celeba:": "PATH", "leaf_sent140:": "PATH",
                   "tff_emnist:": "PATH", "tff_emnist_ae:": "PATH", "tff_shakespeare:": "PATH", "tff_cifar100:": "PATH",
                   "tff_stackoverflow:": "PATH", "tff_stackoverflow_tags:": "PATH", "flair:": "PATH"}
DATASET_NAMES = tuple(PRESETS) + tuple(p + PREFIX_ARGUMENT[p] for p in PREFIXES)


def load_dataset(cfg: DataConfig) -> FederatedDataset:
    """Build a FederatedDataset from a preset name, ``tfds:NAME``, ``folder:PATH`` (images), ``text:PATH`` (a
    folder of per-client .txt files), ``leaf:PATH`` (LEAF's Shakespeare json), ``leaf_femnist:PATH`` (LEAF's
    FEMNIST json, one client per writer: ``jaxfl.data.leaf``) or ``tff_emnist:PATH``, ``tff_emnist_ae:PATH``
    (FedOpt's autoencoder task), ``tff_shakespeare:PATH``,
    ``tff_cifar100:PATH``, ``tff_stackoverflow:PATH``, ``tff_stackoverflow_tags:PATH`` (TFF's HDF5 files, natural
    clients: ``jaxfl.data.tff``) or ``flair:PATH`` (pfl-research's FLAIR file: ``jaxfl.data.flair``), seeded by
    cfg.seed."""
    rng = np.random.default_rng(cfg.seed)
    if cfg.channels not in (1, 3):
        raise DataError(f"channels={cfg.channels}; allowed: 1 or 3")
    for prefix, build in PREFIXES.items():
        if cfg.dataset.startswith(prefix):
            if not cfg.dataset[len(prefix):].strip():  # (an empty PATH would be the current folder)
                raise DataError(f"--dataset {cfg.dataset!r}: give the {PREFIX_ARGUMENT[prefix]} after "
                                f"{prefix!r} ({prefix}{PREFIX_ARGUMENT[prefix]})")
            return _checked(build(cfg, rng, cfg.dataset[len(prefix):]))
    check_choice("dataset", cfg.dataset, DATASET_NAMES)
    return _checked(PRESETS[cfg.dataset](cfg, rng))


def _checked(ds: FederatedDataset) -> FederatedDataset:
    for name, (x, y), (_, vy) in zip(ds.client_names, ds.train, ds.test):
        if len(y) == 0 or len(vy) == 0:
            raise DataError(f"client {name!r} of --dataset {ds.name} has {len(y)} training and {len(vy)} test "
                            f"samples; every client needs at least one of each: use fewer clients (--num-clients, "
                            f"--clients-per-domain) or data files with more samples per client")
    return ds

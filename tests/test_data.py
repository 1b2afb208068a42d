import numpy as np
import pytest
from PIL import Image

from jaxfl.data.federated import DataConfig, load_dataset
from jaxfl.data.partition import dirichlet, iid, shards, split_like
from jaxfl.data.sources import load_image_folder, load_npz
from jaxfl.data.transforms import resize_images, to_channels
from jaxfl.errors import ConfigError, DataError


LABELS = np.repeat(np.arange(10), 50)  # 500 samples, 50 per class


def _covers_once(parts, n):
    allidx = np.concatenate(parts)
    return len(allidx) == n and len(np.unique(allidx)) == n


def test_iid_counts_and_seeding():
    p = iid(LABELS, 7, np.random.default_rng(0))
    assert _covers_once(p, 500) and max(map(len, p)) - min(map(len, p)) <= 1
    q = iid(LABELS, 7, np.random.default_rng(0))
    assert all(np.array_equal(a, b) for a, b in zip(p, q))
    assert not all(np.array_equal(a, b) for a, b in zip(p, iid(LABELS, 7, np.random.default_rng(1))))


def test_dirichlet_counts_skew_and_seeding():
    p = dirichlet(LABELS, 20, 0.1, np.random.default_rng(0))
    assert _covers_once(p, 500) and min(map(len, p)) >= 1
    # small alpha -> few classes per client; large alpha -> nearly all
    few = np.mean([len(np.unique(LABELS[i])) for i in p])
    many = np.mean([len(np.unique(LABELS[i])) for i in dirichlet(LABELS, 20, 100.0, np.random.default_rng(0))])
    assert few < 5 < many
    assert all(np.array_equal(a, b) for a, b in zip(p, dirichlet(LABELS, 20, 0.1, np.random.default_rng(0))))


def test_dirichlet_scales_to_1000_clients():
    labels = np.random.default_rng(0).integers(0, 10, 60000)
    p = dirichlet(labels, 1000, 0.5, np.random.default_rng(0))
    assert _covers_once(p, 60000) and len(p) == 1000


def test_dirichlet_always_meets_min_size_and_rejects_impossible():
    # alpha 0.001 almost never gives 20 clients 20 samples each by chance: the repair step must
    p = dirichlet(LABELS, 20, 0.001, np.random.default_rng(0), min_size=20, max_retries=5)
    assert _covers_once(p, 500) and min(map(len, p)) >= 20
    with pytest.raises(DataError, match="min_size=26 x num_clients=20 exceeds the 500 samples"):
        dirichlet(LABELS, 20, 0.1, np.random.default_rng(0), min_size=26)
    with pytest.raises(ConfigError, match="dirichlet_alpha=0"):
        dirichlet(LABELS, 20, 0.0, np.random.default_rng(0))


def test_shards_exact_classes_per_client():
    p = shards(LABELS, 15, 2, np.random.default_rng(0))
    assert _covers_once(p, 500)
    assert all(len(np.unique(LABELS[i])) == 2 for i in p)
    with pytest.raises(DataError, match="classes_per_client=11 must be in \\[1, 10\\]"):
        shards(LABELS, 5, 11, np.random.default_rng(0))


def test_more_clients_than_samples():
    with pytest.raises(DataError, match=r"num_clients=501 \(--num-clients\) is more than the 500 samples"):
        iid(LABELS, 501, np.random.default_rng(0))


def test_split_like_follows_train_mix():
    rng = np.random.default_rng(0)
    p = shards(LABELS, 10, 2, rng)
    test_labels = np.repeat(np.arange(10), 20)
    t = split_like(p, LABELS, test_labels, rng)
    assert _covers_once(t, 200)
    for tr, te in zip(p, t):
        assert set(np.unique(test_labels[te])) <= set(np.unique(LABELS[tr]))


def test_channel_and_size_conversion():
    grey = np.random.default_rng(0).integers(0, 256, (3, 16, 16, 1), dtype=np.uint8)
    rgb = to_channels(grey, 3)
    assert rgb.shape == (3, 16, 16, 3) and np.array_equal(rgb[..., 2], grey[..., 0])
    np.testing.assert_array_equal(to_channels(rgb, 1), grey)  # luma of a grey pixel is itself
    assert resize_images(grey, 32).shape == (3, 32, 32, 1)
    with pytest.raises(DataError, match="4 channels"):
        to_channels(np.zeros((1, 2, 2, 4), np.uint8), 3)


def test_embedded_default_needs_no_files(monkeypatch):
    monkeypatch.delenv("JAXFL_DATA_DIR", raising=False)
    ds = load_dataset(DataConfig("default", image_size=16))
    assert ds.client_names == ["sk-digits", "sk-digits-photo", "font-digits"]
    assert ds.input_shape == (16, 16, 3) and ds.num_classes == 10
    for (x, y), (_, ty) in zip(ds.train, ds.test):
        assert x.dtype == np.uint8 and len(y) > 100 and set(np.unique(y)) == set(range(10)) and len(ty) > 20
    # domains really differ: the photo domain is colourful, sk-digits is grey
    x0, x1 = ds.train[0][0].astype(int), ds.train[1][0].astype(int)
    assert np.abs(x0[..., 0] - x0[..., 1]).max() == 0 and np.abs(x1[..., 0] - x1[..., 1]).mean() > 5
    ds2 = load_dataset(DataConfig("default", image_size=16, clients_per_domain=2))
    assert len(ds2.client_names) == 6


def test_embedded_sources_are_scikit_learns_datasets_read_without_importing_it():
    from jaxfl.data.embedded import sklearn_digits_images, sklearn_sample_photos
    from sklearn.datasets import load_digits, load_sample_images
    images, labels = sklearn_digits_images()
    d = load_digits()
    np.testing.assert_array_equal(images, d.images)
    np.testing.assert_array_equal(labels, d.target)
    assert images.shape == (1797, 8, 8) and labels.dtype == np.int64
    photos, want = sklearn_sample_photos(), load_sample_images().images
    assert len(photos) == len(want) == 2
    for a, b in zip(photos, want):
        np.testing.assert_array_equal(a, b)


def test_mnist_preset_with_quantity_controlled_lognormal_clients(data_dir):
    cfg = DataConfig("mnist", data_dir=data_dir, num_clients=30, partition="dirichlet_quantity",
                     client_sizes="lognormal", size_sigma=1.0, dirichlet_alpha=1.0)
    ds = load_dataset(cfg)
    sizes = ds.train_counts()
    assert len(sizes) == 30 and sizes.sum() == 60000 and sizes.max() > 3 * sizes.min()
    eq = load_dataset(DataConfig("mnist", data_dir=data_dir, num_clients=30, partition="dirichlet_quantity"))
    assert eq.train_counts().max() - eq.train_counts().min() <= 1


def test_digits_preset_reads_real_npz(data_dir):
    ds = load_dataset(DataConfig("digits", data_dir=data_dir, samples_per_client=200, test_per_client=100))
    assert ds.client_names == ["mnistm", "mnist", "usps"]
    assert list(ds.train_counts()) == [200, 200, 200]
    assert ds.input_shape == (32, 32, 3)
    assert [len(y) for _, y in ds.test] == [100, 100, 100]
    # seeded: the same seed picks the same subset, another seed another one
    again = load_dataset(DataConfig("digits", data_dir=data_dir, samples_per_client=200, test_per_client=100))
    other = load_dataset(DataConfig("digits", data_dir=data_dir, samples_per_client=200, test_per_client=100, seed=1))
    assert np.array_equal(ds.train[1][1], again.train[1][1]) and not np.array_equal(ds.train[1][1], other.train[1][1])


def test_cifar10_and_pacs_presets(data_dir):
    ds = load_dataset(DataConfig("cifar10", data_dir=data_dir, num_clients=10, samples_per_client=50))
    assert list(ds.train_counts()) == [50] * 10
    assert all(len(np.unique(y)) <= 2 for _, y in ds.train)
    pacs = load_dataset(DataConfig("pacs", data_dir=data_dir, image_size=16))
    assert pacs.client_names == ["art_painting", "cartoon", "photo", "sketch"] and pacs.num_classes == 7
    assert list(pacs.train_counts()) == [1840, 2107, 1499, 3531]


def test_npz_and_data_dir_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="missing data file .*digits/mnist_train.npz"):
        load_npz(tmp_path, "digits", "mnist", "train")
    monkeypatch.delenv("JAXFL_DATA_DIR", raising=False)
    with pytest.raises(DataError, match="no data directory: pass --data-dir or set JAXFL_DATA_DIR"):
        load_dataset(DataConfig("digits"))
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(DataConfig("digits", data_dir=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="unknown dataset 'mnist-m'; valid: default, digits"):
        load_dataset(DataConfig("mnist-m"))
    (tmp_path / "digits").mkdir()
    np.savez(tmp_path / "digits" / "bad_train.npz", images=np.zeros((3, 4, 4), np.uint8), labels=np.zeros(2))
    with pytest.raises(DataError, match="do not match"):
        load_npz(tmp_path, "digits", "bad", "train")


def test_image_folder_reader(tmp_path):
    rng = np.random.default_rng(0)
    for dom in ("art", "photo"):
        for cls in ("cat", "dog"):
            (tmp_path / dom / cls).mkdir(parents=True)
            for k in range(5):
                Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(
                    tmp_path / dom / cls / f"{k}.png")
    out = load_image_folder(tmp_path, size=8)
    assert sorted(out) == ["art", "photo"]
    x, y = out["art"]
    assert x.shape == (10, 8, 8, 3) and list(np.bincount(y)) == [5, 5]
    ds = load_dataset(DataConfig(f"folder:{tmp_path}", image_size=8))
    assert ds.client_names == ["art", "photo"] and ds.num_classes == 2
    assert sum(map(len, (y for _, y in ds.train))) + sum(map(len, (y for _, y in ds.test))) == 20
    # a damaged image is named, not a traceback; a domain without images is refused, not dropped
    (tmp_path / "art" / "dog" / "5.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=r"image '.*5\.png' cannot be read \(.*\); remove or replace it"):
        load_image_folder(tmp_path, size=8)
    (tmp_path / "art" / "dog" / "5.png").unlink()
    (tmp_path / "sketch" / "cat").mkdir(parents=True)
    with pytest.raises(DataError, match=r"domain folder '.*sketch' holds no image"):
        load_image_folder(tmp_path, size=8)


def test_tfds_missing_is_a_clear_error(monkeypatch):
    import builtins
    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("tensorflow_datasets"):
            raise ImportError(name)
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(DataError, match=r"pip install 'jaxfl\[tfds\]'"):
        load_dataset(DataConfig("tfds:mnist"))


def test_text_windows_and_the_synthetic_text_preset():
    from jaxfl.data import text
    ids = text.encode("ab~c")  # an unknown character becomes a space
    assert ids.tolist() == [text.LEAF_CHARS.index(c) for c in "ab c"] and len(text.LEAF_CHARS) == 80
    x, y = text.windows(np.arange(10, dtype=np.int32), 4)
    assert x.shape == (6, 4) and x[2].tolist() == [2, 3, 4, 5] and y.tolist() == [4, 5, 6, 7, 8, 9]
    (tx, ty), (vx, vy) = text.text_client("abcdefghij" * 10, seq_len=5, test_fraction=0.2)
    assert len(ty) == 80 - 5 and len(vy) == 20 - 5  # the test windows use only the last 20 characters
    cfg = DataConfig("synthetic_text", num_clients=4, size_sigma=0.8)
    ds, again = load_dataset(cfg), load_dataset(cfg)
    assert ds.num_classes == 80 and ds.client_names == ["speaker0", "speaker1", "speaker2", "speaker3"]
    for (x, y), (x2, _) in zip(ds.train, again.train):
        assert x.dtype == np.int32 and x.shape[1] == 80 and 0 <= x.min() and x.max() < 80
        np.testing.assert_array_equal(x[1:, :-1], x[:-1, 1:])  # consecutive windows
        np.testing.assert_array_equal(y[:-1], x[1:, -1])      # the label is the next character
        np.testing.assert_array_equal(x, x2)                  # seeded
    sizes = [len(y) for _, y in ds.train]
    assert len(set(sizes)) == 4  # log-normal client sizes
    first = np.bincount(np.concatenate([y for _, y in ds.train[:1]]), minlength=80)
    second = np.bincount(np.concatenate([y for _, y in ds.train[1:2]]), minlength=80)
    assert np.abs(first / first.sum() - second / second.sum()).sum() > 0.1  # clients write differently


def test_text_folder_and_leaf_json(tmp_path):
    import json
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "hamlet.txt").write_text("To be, or not to be, that is the question. " * 20)
    (tmp_path / "txt" / "lear.txt").write_text("Nothing will come of nothing. " * 20)
    ds = load_dataset(DataConfig(f"text:{tmp_path / 'txt'}"))
    assert ds.client_names == ["hamlet", "lear"] and all(len(y) > 0 for _, y in ds.test)
    for split, n in (("train", 3), ("test", 1)):
        (tmp_path / "leaf" / split).mkdir(parents=True)
        users = {"A": {"x": ["a" * 80] * n, "y": ["b"] * n}, "B": {"x": ["c" * 80] * n, "y": ["d"] * n}}
        (tmp_path / "leaf" / split / "all.json").write_text(json.dumps({"users": ["A", "B"], "user_data": users}))
    leaf = load_dataset(DataConfig(f"leaf:{tmp_path / 'leaf'}"))
    assert leaf.client_names == ["A", "B"] and [len(y) for _, y in leaf.train] == [3, 3]
    from jaxfl.data.text import LEAF_CHARS
    assert leaf.train[1][1].tolist() == [LEAF_CHARS.index("d")] * 3 and leaf.train[0][0].shape == (3, 80)
    with pytest.raises(DataError, match="holds no .txt files"):
        load_dataset(DataConfig(f"text:{tmp_path / 'leaf'}"))
    with pytest.raises(DataError, match="--dataset 'text:': give the PATH after 'text:'"):
        load_dataset(DataConfig("text:"))  # not the current folder
    # inputs and targets that do not pair up, or are not strings, are refused (were cut, or encoded as spaces)
    for bad, message in (({"x": ["a" * 80] * 3, "y": ["b"] * 2}, "has 3 inputs \\(x\\) and 2 targets \\(y\\)"),
                         ({"x": [[1] * 80] * 3, "y": ["b"] * 3}, "has an input or target that is not a string")):
        (tmp_path / "leaf" / "train" / "all.json").write_text(json.dumps({"users": ["A"], "user_data": {"A": bad}}))
        with pytest.raises(DataError, match=message):
            load_dataset(DataConfig(f"leaf:{tmp_path / 'leaf'}"))


def write_leaf_femnist(root, users_by_file, split_sizes=(("train", 5), ("test", 2)), seed=0):
    """LEAF's FEMNIST json under root/{train,test}/: users_by_file [[user, ...], ...] (a file each), every
    user with n images of 784 floats in [0, 1] and labels in [0, 62) per split."""
    import json
    rng = np.random.default_rng(seed)
    for split, n in split_sizes:
        (root / split).mkdir(parents=True, exist_ok=True)
        for f, users in enumerate(users_by_file):
            data = {u: {"x": rng.random((n, 784)).round(3).tolist(), "y": rng.integers(0, 62, n).tolist()}
                    for u in users}
            (root / split / f"part{f}.json").write_text(json.dumps(
                {"users": users, "num_samples": [n] * len(users), "user_data": data}))


def test_leaf_femnist_reads_writers_as_clients(tmp_path):
    import json
    write_leaf_femnist(tmp_path / "fem", [["f0001_01", "f0002_02"], ["f0003_03"]])
    ds = load_dataset(DataConfig(f"leaf_femnist:{tmp_path / 'fem'}", channels=1))
    assert ds.client_names == ["f0001_01", "f0002_02", "f0003_03"] and ds.num_classes == 62
    assert [len(y) for _, y in ds.train] == [5, 5, 5] and [len(y) for _, y in ds.test] == [2, 2, 2]
    x, y = ds.train[2]
    assert x.shape == (5, 28, 28, 1) and x.dtype == np.uint8 and y.dtype == np.int32
    raw = json.loads((tmp_path / "fem" / "train" / "part1.json").read_text())["user_data"]["f0003_03"]
    np.testing.assert_array_equal(x.reshape(5, -1), np.round(np.asarray(raw["x"]) * 255).astype(np.uint8))
    np.testing.assert_array_equal(y, raw["y"])
    # a writer missing from the test split is dropped; bad values are named with the writer and the file
    write_leaf_femnist(tmp_path / "part", [["a", "b"]], (("train", 3),))
    write_leaf_femnist(tmp_path / "part", [["a"]], (("test", 1),))
    assert load_dataset(DataConfig(f"leaf_femnist:{tmp_path / 'part'}")).client_names == ["a"]
    for change, message in [(lambda d: d["x"][0].append(0.5), "has an image of 785 values; FEMNIST's have 784"),
                            (lambda d: d["x"][0].__setitem__(0, 3.0), "pixel values outside \\[0, 1\\]"),
                            (lambda d: d["y"].__setitem__(0, 62), "has a label 62 outside \\[0, 62\\)"),
                            (lambda d: d["y"].pop(), "has 5 inputs \\(x\\) and 4 targets \\(y\\); they must pair up")]:
        bad = tmp_path / "bad"
        write_leaf_femnist(bad, [["w"]])
        blob = json.loads((bad / "train" / "part0.json").read_text())
        change(blob["user_data"]["w"])
        (bad / "train" / "part0.json").write_text(json.dumps(blob))
        with pytest.raises(DataError, match=message):
            load_dataset(DataConfig(f"leaf_femnist:{bad}"))
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(DataConfig(f"leaf_femnist:{tmp_path / 'nowhere'}"))


def test_leaf_femnist_runs_through_the_cli(tmp_path):
    import json

    from jaxfl.run.cli import main
    write_leaf_femnist(tmp_path / "fem", [["w1", "w2"], ["w3", "w4"]], (("train", 12), ("test", 4)))
    assert main(["run", "--quiet", "--algorithm", "fedavg", "--dataset", f"leaf_femnist:{tmp_path / 'fem'}",
                 "--model", "femnist_cnn", "--channels", "1", "--rounds", "1", "--clients-per-round", "2",
                 "--out", str(tmp_path / "r")]) == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["clients"] == ["w1", "w2", "w3", "w4"] and summary["last"]["round"] == 1


def test_leaf_celeba_reads_each_celebritys_named_images_and_smiling_labels(tmp_path):
    import json as _json

    from PIL import Image

    from jaxfl.data.leaf import load_leaf_celeba
    rng = np.random.default_rng(0)
    raw = tmp_path / "raw" / "img_align_celeba"
    raw.mkdir(parents=True)
    pixels = {}
    for i in range(8):
        a = rng.integers(0, 256, (20, 16, 3), dtype=np.uint8)
        Image.fromarray(a).save(raw / f"{i:06d}.png")
        pixels[f"{i:06d}.png"] = a
    split = {"train": {"7": ([0, 1, 2], [1.0, 0.0, 1.0]), "3": ([3, 4], [0.0, 0.0]), "9": ([5], [1.0])},
             "test": {"7": ([6], [0.0]), "3": ([7], [1.0])}}
    for name, users in split.items():
        (tmp_path / name).mkdir()
        blob = {"users": list(users), "num_samples": [len(x) for x, _ in users.values()],
                "user_data": {u: {"x": [f"{i:06d}.png" for i in x], "y": y} for u, (x, y) in users.items()}}
        (tmp_path / name / "data.json").write_text(_json.dumps(blob))
    users = load_leaf_celeba(tmp_path, size=8)
    assert list(users) == ["3", "7"]  # in both splits, sorted
    (x, y), (vx, vy) = users["7"]
    assert x.shape == (3, 8, 8, 3) and x.dtype == np.uint8 and list(y) == [1, 0, 1] and list(vy) == [0]
    want = np.asarray(Image.fromarray(pixels["000001.png"]).resize((8, 8)).convert("RGB"))
    np.testing.assert_array_equal(x[1], want)
    ds = load_dataset(DataConfig(f"leaf_celeba:{tmp_path}", image_size=8))
    assert ds.num_classes == 2 and ds.client_names == ["3", "7"]
    (raw / "000006.png").unlink()
    with pytest.raises(DataError, match="LEAF user '7'.s image .*000006.png' cannot be read"):
        load_leaf_celeba(tmp_path, size=8)


def test_leaf_sent140_numbers_the_frequent_training_words_and_pads_as_leaf(tmp_path):
    import json as _json

    from jaxfl.data.leaf import load_leaf_sent140, sent140_words
    assert sent140_words("I can't go, sadly!") == ["I", "can't", "go", ",", "sadly", "!"]
    tweet = lambda text: ["1467810369", "Mon Apr 06", "NO_QUERY", "someone", text]  # noqa: E731  (LEAF's record)
    split = {"train": {"u1": (["good good day", "bad day"], [1, 0]), "u2": (["good night", "x"], ["1", "0"])},
             "test": {"u1": (["good unseen day"], [1]), "u2": (["night"], [0])}}
    for name, users in split.items():
        (tmp_path / name).mkdir()
        blob = {"users": list(users), "num_samples": [len(x) for x, _ in users.values()],
                "user_data": {u: {"x": [tweet(t) for t in x], "y": y} for u, (x, y) in users.items()}}
        (tmp_path / name / "d.json").write_text(_json.dumps(blob))
    users = load_leaf_sent140(tmp_path, vocab_size=3, length=4)
    # training words: good 3, day 2, then bad/night/x 1 each (ties by the word): good 0, day 1, bad 2; others 3
    (x, y), (vx, vy) = users["u1"]
    np.testing.assert_array_equal(x, [[0, 0, 1, 3], [2, 1, 3, 3]])
    np.testing.assert_array_equal(vx, [[0, 3, 1, 3]])
    assert list(y) == [1, 0] and list(users["u2"][0][1]) == [1, 0] and x.dtype == np.int32
    ds = load_dataset(DataConfig(f"leaf_sent140:{tmp_path}"))
    assert ds.num_classes == 2 and ds.train[0][0].shape == (2, 25)


def test_normalize_scales_images_per_channel_and_reaches_the_runs_trainer():
    """--normalize: (x / 255 - mean) / std with one mean and std per channel (imagenet) or scalars (unit);
    the run's trainer preprocesses with it; per-channel statistics on grey images are refused in one line."""
    import jax

    from jaxfl.core.trainer import normalizer
    from jaxfl.data.federated import NORMALIZATIONS, with_normalization
    from jaxfl.run.cli import command_config
    from jaxfl.run.config import validate
    from jaxfl.run.runner import Experiment

    x = np.random.default_rng(0).integers(0, 256, (2, 4, 4, 3), dtype=np.uint8)
    for name in ("cifar10", "imagenet"):  # (imagenet last: the run below checks its expected values)
        mean, std = (np.array(v, np.float64) for v in NORMALIZATIONS[name])
        expected = (x / 255.0 - mean) / std
        out = np.asarray(jax.jit(normalizer(*NORMALIZATIONS[name]))(x))
        # float32: x / 255, the subtraction and the division each round once (relative eps32 of their results)
        atol = 8 * np.finfo(np.float32).eps * np.abs(expected).max()
        np.testing.assert_allclose(out, expected, rtol=0, atol=atol)
        assert not np.allclose(out, (x / 255.0 - 0.5) / 0.5, atol=1e-2)  # not the dataset's own scaling

    ds = load_dataset(DataConfig("default", image_size=8))
    assert with_normalization(ds, "dataset") is ds and ds.normalize == (0.5, 0.5)
    assert with_normalization(ds, "unit").normalize == (0.0, 1.0)
    grey = load_dataset(DataConfig("default", image_size=8, channels=1))
    with pytest.raises(DataError, match=r"--normalize imagenet scales 3 channels; the images of this dataset have "
                                        r"shape \(8, 8, 1\)"):
        with_normalization(grey, "imagenet")

    cfg = command_config(["run", "--dataset", "default", "--image-size", "8", "--normalize", "imagenet",
                          "--rounds", "1", "--samples-per-client", "20", "--test-per-client", "10"])
    assert cfg.normalize == "imagenet"
    np.testing.assert_allclose(np.asarray(Experiment(cfg).trainer.preprocess(x)), expected, rtol=0, atol=atol)
    with pytest.raises(ConfigError, match="unknown normalize 'zscore'; valid: dataset, imagenet, cifar10, unit"):
        validate(command_config(["run", "--normalize", "zscore"]))

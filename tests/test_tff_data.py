"""TFF's HDF5 files (``jaxfl.data.tff``): small files written in exactly TFF's layout, read back as clients."""
import json

import numpy as np
import pytest
from conftest import emnist_files, write_tff

from jaxfl.data import DataConfig, load_dataset, text
from jaxfl.data.tff import load_tff_cifar100, load_tff_emnist, load_tff_shakespeare, read_examples
from jaxfl.errors import DataError
from jaxfl.run.cli import main

h5py = pytest.importorskip("h5py")  # (the test extra installs it; CI runs these)


def test_emnist_writers_become_clients_with_mnist_polarity(tmp_path):
    emnist_files(tmp_path, only_test=("f0002_33",))
    users, classes = load_tff_emnist(tmp_path)
    assert classes == 62 and list(users) == ["f0000_14", "f0001_41"]  # writers in both splits, sorted
    raw = read_examples(tmp_path / "fed_emnist_train.h5", ("pixels", "label"))
    (x, y), (vx, vy) = users["f0000_14"]
    assert x.shape == (12, 28, 28, 1) and x.dtype == np.uint8 and vx.shape == (4, 28, 28, 1)
    np.testing.assert_array_equal(x[..., 0], np.round(255 * (1 - raw["f0000_14"]["pixels"])).astype(np.uint8))
    np.testing.assert_array_equal(y, raw["f0000_14"]["label"])
    # the training file itself may be named; a digits-only file has 10 classes
    assert list(load_tff_emnist(tmp_path / "fed_emnist_train.h5")[0]) == list(users)


def test_emnist_digits_only_and_labels_stored_as_a_column(tmp_path):
    rng = np.random.default_rng(1)
    for split in ("train", "test"):
        write_tff(tmp_path / f"fed_emnist_digitsonly_{split}.h5",
                  {"w": {"pixels": rng.uniform(0, 1, (5, 28, 28)).astype(np.float32),
                         "label": rng.integers(0, 10, (5, 1)).astype(np.int64)}})
    users, classes = load_tff_emnist(tmp_path / "fed_emnist_digitsonly_train.h5")
    assert classes == 10 and users["w"][0][1].shape == (5,) and users["w"][0][1].dtype == np.int32


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(label=np.full(len(d["label"]), 62, np.int32)), "has a label 62 outside \\[0, 62\\)"),
    (lambda d: d.update(pixels=d["pixels"] * 2), "pixel values outside \\[0, 1\\]"),
    (lambda d: d.pop("label"), "has no label \\(it has pixels\\); expected pixels, label"),
    (lambda d: d.update(pixels=d["pixels"][:, :20]), "pixels of shape \\(12, 20, 28\\); EMNIST's are"),
])
def test_a_bad_emnist_file_is_named_with_the_client_and_what_is_wrong(tmp_path, change, message):
    rng = np.random.default_rng(0)
    d = {"pixels": rng.uniform(0, 1, (12, 28, 28)).astype(np.float32), "label": np.zeros(12, np.int32)}
    change(d)
    write_tff(tmp_path / "fed_emnist_train.h5", {"w0": d})
    write_tff(tmp_path / "fed_emnist_test.h5", {"w0": {"pixels": np.zeros((2, 28, 28), np.float32),
                                                       "label": np.zeros(2, np.int32)}})
    with pytest.raises(DataError, match=message):  # (pixel values are checked when read: the images are lazy)
        [np.asarray(x) for splits in load_tff_emnist(tmp_path)[0].values() for x, _ in splits]


def test_missing_or_foreign_files_are_named(tmp_path):
    with pytest.raises(DataError, match="fed_emnist_train.h5' does not exist.*fed_emnist_train.h5 and "
                                        "fed_emnist_test.h5"):
        load_tff_emnist(tmp_path)
    (tmp_path / "fed_emnist_train.h5").write_text("not hdf5")
    (tmp_path / "fed_emnist_test.h5").write_text("not hdf5")
    with pytest.raises(DataError, match="is not a TFF HDF5 file"):
        load_tff_emnist(tmp_path)
    with h5py.File(tmp_path / "other_train.h5", "w") as f:
        f.create_dataset("x", data=np.zeros(3))
    with h5py.File(tmp_path / "other_test.h5", "w") as f:
        f.create_dataset("x", data=np.zeros(3))
    with pytest.raises(DataError, match="has no 'examples' group"):
        load_tff_emnist(tmp_path / "other_train.h5")


def test_shakespeare_roles_become_next_character_clients(tmp_path):
    lines = {"THE_TEMPEST_MIRANDA": [b"O, I have suffered " * 4, b"With those that I saw suffer!"],
             "HAMLET_HAMLET": [b"To be, or not to be: that is the question. " * 3]}
    train = {k: {"snippets": np.array(v, dtype=object)} for k, v in lines.items()}
    other = b"A brave vessel, who had, no doubt, some noble creature in her. x" * 2
    test = {k: {"snippets": np.array([other], dtype=object)} for k in train}
    write_tff(tmp_path / "shakespeare_train.h5", train)
    write_tff(tmp_path / "shakespeare_test.h5", test)
    roles = load_tff_shakespeare(tmp_path)
    assert list(roles) == ["HAMLET_HAMLET", "THE_TEMPEST_MIRANDA"]
    (x, y), (vx, vy) = roles["THE_TEMPEST_MIRANDA"]
    joined = "\n".join(s.decode() for s in train["THE_TEMPEST_MIRANDA"]["snippets"])
    assert x.shape == (len(joined) - 80, 80) and y.shape == (len(joined) - 80,)
    np.testing.assert_array_equal(x[3], text.encode(joined[3:83]))
    assert y[3] == text.encode(joined[83])[0] and x.max() < text.VOCAB


def test_cifar100_clients_hold_out_a_fifth_of_their_images(tmp_path):
    rng = np.random.default_rng(0)
    write_tff(tmp_path / "fed_cifar100_train.h5",
              {str(i): {"image": rng.integers(0, 256, (10, 32, 32, 3), dtype=np.uint8),
                        "label": rng.integers(0, 100, 10), "coarse_label": rng.integers(0, 20, 10)}
               for i in range(3)})
    write_tff(tmp_path / "fed_cifar100_test.h5", {"9": {"image": np.zeros((1, 32, 32, 3), np.uint8),
                                                        "label": np.zeros(1, np.int64)}})
    clients = load_tff_cifar100(tmp_path, np.random.default_rng(0))
    assert list(clients) == ["0", "1", "2"]
    (x, y), (vx, vy) = clients["1"]
    assert x.shape == (8, 32, 32, 3) and vx.shape == (2, 32, 32, 3) and y.dtype == np.int32
    raw = read_examples(tmp_path / "fed_cifar100_train.h5", ("image", "label"))["1"]
    together = np.concatenate([x, vx]).reshape(10, -1)  # the two splits partition the client's images
    assert sorted(map(bytes, together)) == sorted(map(bytes, raw["image"].reshape(10, -1)))


def test_the_cli_trains_on_tff_emnist_and_names_a_missing_file(tmp_path, capsys):
    emnist_files(tmp_path)
    ds = load_dataset(DataConfig(f"tff_emnist:{tmp_path}", channels=1))
    assert ds.num_classes == 62 and len(ds.client_names) == 3 and ds.input_shape == (28, 28, 1)
    out = tmp_path / "run"
    assert main(["run", "--dataset", f"tff_emnist:{tmp_path}", "--model", "femnist_cnn", "--algorithm", "fedavg",
                 "--rounds", "1", "--batch-size", "4", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["clients"] == ["f0000_14", "f0001_41", "f0002_33"]
    capsys.readouterr()
    assert main(["run", "--dataset", f"tff_emnist:{tmp_path / 'nowhere'}", "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxfl: error: TFF path") and "does not exist" in err[0]
    assert not (tmp_path / "r2").exists()


def stackoverflow_files(folder):
    posts = {"00001": [b"how do i sort a list in python " * 3, b"sort the list"],  # (over 20 tokens a user)
             "00002": [b"what is a list " * 4, b"python list sort key"],
             "00003": [b"java stream sort"]}
    write_tff(folder / "stackoverflow_train.h5",
              {u: {"tokens": np.array(p, dtype=object), "tags": np.array([b"python"] * len(p), dtype=object)}
               for u, p in posts.items()})
    test = np.array([b"sort a python list fast " * 5], dtype=object)
    write_tff(folder / "stackoverflow_test.h5", {u: {"tokens": test} for u in ("00001", "00002")})
    return posts


def test_stackoverflow_users_become_next_word_clients_with_fedopts_ids(tmp_path):
    from jaxfl.data.tff import load_tff_stackoverflow, stackoverflow_ids, stackoverflow_vocab
    posts = stackoverflow_files(tmp_path)
    vocab = stackoverflow_vocab(["b a a", "c b a"], 2)
    assert vocab == {"a": 1, "b": 2}  # the most frequent first, ties by the word; "c" left out
    np.testing.assert_array_equal(stackoverflow_ids("a c b", vocab), [4, 1, 3, 2, 5])  # bos, a, OOV, b, eos
    users, classes = load_tff_stackoverflow(tmp_path, vocab_size=6, seq_len=4)
    assert classes == 10 and list(users) == ["00001", "00002"]  # users in both splits
    (x, y), (vx, vy) = users["00001"]
    words = [s.decode() for u in ("00001", "00002") for s in posts[u]]  # the selected users' training words
    vocab = stackoverflow_vocab(words, 6)
    stream = np.concatenate([stackoverflow_ids(s.decode(), vocab) for s in posts["00001"]])
    assert x.shape == (len(stream) - 4, 4) and x.max() < classes
    np.testing.assert_array_equal(x[2], stream[2:6])
    assert y[2] == stream[6]
    assert len(load_tff_stackoverflow(tmp_path, vocab_size=6, max_clients=1)[0]) == 1  # --num-clients 1


def test_the_cli_trains_the_word_lstm_on_stack_overflow(tmp_path, capsys):
    stackoverflow_files(tmp_path)
    out = tmp_path / "run"
    assert main(["run", "--dataset", f"tff_stackoverflow:{tmp_path}", "--model", "word_lstm", "--algorithm",
                 "fedavg", "--rounds", "1", "--batch-size", "4", "--num-clients", "2", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["clients"] == ["00001", "00002"]
    capsys.readouterr()
    assert main(["run", "--dataset", f"tff_stackoverflow:{tmp_path}", "--model", "femnist_cnn",
                 "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err
    assert "holds text (token ids) and --model femnist_cnn reads images" in err and "word_lstm" in err
    assert not (tmp_path / "r2").exists()

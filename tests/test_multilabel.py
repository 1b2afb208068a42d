"""Multi-label tasks: multi-hot labels [B, C] give the per-class binary cross-entropy and recall@5
(``core.metrics``), the bag-of-words logistic regression (``bow_logreg``), TFF's Stack Overflow tag prediction
(``tff_stackoverflow_tags:``), the methods that accept it, and the CLI's path."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import EPS32, make_trainer, run_rounds, write_tff

from jaxfl.algorithms import REGISTRY, build_algorithm, options_class
from jaxfl.core.metrics import correct_count, cross_entropy, multilabel, recall_at_k
from jaxfl.core.step import init_state
from jaxfl.core.types import RunContext
from jaxfl.data.clients import ClientData
from jaxfl.models import BagOfWordsEncoder, Classifier, MLPEncoder, MLPHead
from jaxfl.run.cli import main



def sigmoid_bce(z, y):
    """The formula in float64: mean over classes of -y log s(z) - (1 - y) log(1 - s(z))."""
    z, y = np.asarray(z, np.float64), np.asarray(y, np.float64)
    s = 1 / (1 + np.exp(-z))
    return np.mean(-y * np.log(s) - (1 - y) * np.log(1 - s), -1)


def test_multi_hot_labels_give_the_mean_binary_cross_entropy_under_jit_vmap_and_grad():
    rng = np.random.default_rng(0)
    z = rng.normal(0, 3, (4, 6)).astype(np.float32)
    y = (rng.uniform(size=(4, 6)) < 0.4).astype(np.uint8)
    assert multilabel(z, y) and not multilabel(z, y.argmax(1))
    expected = sigmoid_bce(z, y)
    # a softplus and a product per class, then a mean of 6: a few eps32 of the largest term
    tol = 16 * EPS32 * (np.abs(z).max() + 1)
    np.testing.assert_allclose(jax.jit(cross_entropy)(z, y), expected, atol=tol, rtol=0)
    np.testing.assert_allclose(jax.vmap(cross_entropy)(z[:, None], y[:, None])[:, 0], expected, atol=tol, rtol=0)
    # d/dz of the mean BCE: (sigmoid(z) - y) / C
    grad = jax.grad(lambda z: jnp.sum(cross_entropy(z, y)))(z)
    np.testing.assert_allclose(grad, (1 / (1 + np.exp(-z.astype(np.float64))) - y) / 6, atol=8 * EPS32, rtol=0)
    # class ids keep the softmax cross-entropy
    ids = y.argmax(1)
    logp = z - np.log(np.exp(z.astype(np.float64)).sum(1, keepdims=True))
    np.testing.assert_allclose(cross_entropy(z, ids), -logp[np.arange(4), ids], atol=tol, rtol=0)


def test_recall_at_5_counts_the_true_classes_among_the_top_5():
    z = np.array([[9, 8, 7, 6, 5, 4, 3, 2], [0, 0, 0, 0, 0, 0, 0, 1], [1, 2, 3, 4, 5, 6, 7, 8]], np.float32)
    y = np.array([[1, 0, 0, 0, 0, 1, 0, 0],   # classes 0 (top 1) and 5 (6th): 1 of 2
                  [0, 0, 0, 0, 0, 0, 0, 1],   # its one class is the top one: 1
                  [0, 0, 0, 0, 0, 0, 0, 0]], np.uint8)  # no true class: 0
    np.testing.assert_allclose(jax.jit(recall_at_k)(z, y), [0.5, 1.0, 0.0])
    np.testing.assert_allclose(recall_at_k(z, y, k=6), [1.0, 1.0, 0.0])
    # correct_count adds the real samples' recalls (padding weight 0)
    assert float(correct_count(z, y, np.array([1.0, 1.0, 0.0]))) == pytest.approx(1.5)
    assert float(correct_count(z, y, np.array([1.0, 0.0, 0.0]))) == pytest.approx(0.5)
    assert recall_at_k(z[:, :3], y[:, :3]).shape == (3,)  # k is capped at C


def test_the_bag_of_words_is_the_mean_one_hot_with_oov_counted_and_padding_not():
    ids = np.array([[0, 2, 2, 5, -1, -1],     # 3 words and one OOV (id 5 = V): 4 tokens
                    [1, -1, -1, -1, -1, -1],  # one word
                    [-1, -1, -1, -1, -1, -1]])  # an empty post: zeros
    z = np.asarray(jax.jit(lambda x: BagOfWordsEncoder(vocab=5).apply({}, x))(ids))
    expected = np.zeros((3, 5))
    expected[0, [0, 2]] = [0.25, 0.5]
    expected[1, 1] = 1.0
    np.testing.assert_allclose(z, expected, atol=EPS32, rtol=0)


def multilabel_clients(counts=(24, 17, 9), m=24, seed=0):
    """Features whose sign pattern gives the tags: tag c is on when feature c > 0 (a separable multi-label task)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(len(counts), m, 6)).astype(np.float32)
    y = (x > 0).astype(np.int32)
    return ClientData(jnp.asarray(x), jnp.asarray(y), jnp.asarray(counts, jnp.int32))


@pytest.mark.parametrize("name", sorted(n for n in REGISTRY if options_class(n).multilabel))
def test_every_method_that_accepts_multi_hot_labels_learns_a_multi_label_task(name):
    data = multilabel_clients()
    model = Classifier(encoder=MLPEncoder((16,)), head=MLPHead((), 6))
    alg = build_algorithm(name, model, make_trainer(batch_size=8, epochs=3, lr=0.2),
                          RunContext(num_clients=3, num_rounds=8))
    server, clients = init_state(alg, jax.random.key(0), data.x[0], 3)
    _, _, first = run_rounds(alg, data, server, clients, jax.random.key(1), rounds=1, num_rounds=8)
    _, _, last = run_rounds(alg, data, server, clients, jax.random.key(1), rounds=8, num_rounds=8)
    loss0, loss = np.asarray(first["loss"]), np.asarray(last["loss"])
    # balanced tags: a constant prediction scores log 2 per tag at best; a model that reads the features beats
    # it (the slowest here, FedBABU's fixed random head and pFedMe's proximal steps, by ~0.035 after 8 rounds)
    assert np.all(np.isfinite(loss)) and np.mean(loss) < min(np.log(2) - 0.025, np.mean(loss0)), (loss0, loss)
    assert 0 <= np.min(last["accuracy"]) and np.max(last["accuracy"]) <= 1


def stackoverflow_tag_files(folder, users=("00001", "00002", "00003"), posts=30, seed=0):
    """TFF's Stack Overflow pair with ``tokens``, ``title`` and ``tags``: post i of a user has the words of its
    two tags (tag j <-> word wj, 8 tags) among filler words, so the tags follow from the words."""
    rng = np.random.default_rng(seed)

    def user(n):
        tags = [rng.choice(8, 2, replace=False) for _ in range(n)]
        tokens = [" ".join([f"w{a}", "the", "a", f"w{b}", "of"][k] for k in rng.permutation(5)) for a, b in tags]
        return {"tokens": np.array([t.encode() for t in tokens], object),
                "title": np.array([b"question"] * n, object),
                "tags": np.array([f"t{a}|t{b}".encode() for a, b in tags], object)}
    write_tff(folder / "stackoverflow_train.h5", {u: user(posts) for u in users})
    write_tff(folder / "stackoverflow_test.h5", {u: user(posts // 3) for u in users})


def test_stack_overflow_tags_are_word_ids_and_multi_hot_tag_rows(tmp_path):
    from jaxfl.data.tff import load_tff_stackoverflow_tags
    write_tff(tmp_path / "stackoverflow_train.h5", {
        "00001": {"tokens": np.array([b"b a a", b"c"], object), "title": np.array([b"a", b"d"], object),
                  "tags": np.array([b"x|y", b"y"], object)},
        "00002": {"tokens": np.array([b"b"], object), "title": np.array([b""], object),
                  "tags": np.array([b"z|y"], object)}})
    write_tff(tmp_path / "stackoverflow_test.h5", {
        u: {"tokens": np.array([b"a q", b"b"], object), "title": np.array([b"", b""], object),
            "tags": np.array([b"y", b"w"], object)} for u in ("00001", "00002")})
    users, tags = load_tff_stackoverflow_tags(tmp_path, vocab_size=2, tag_vocab_size=2)
    assert tags == 2 and list(users) == ["00001", "00002"]
    (x, y), (vx, vy) = users["00001"]
    # words by training frequency: a (3), b (2) -> ids 0, 1; c, d: OOV (2); -1 pads to the longest post (4)
    np.testing.assert_array_equal(x, [[1, 0, 0, 0], [2, 2, -1, -1]])
    # tags by training frequency: y (3) -> 0, then x and z (1 each) tie: x by its name -> 1; z dropped
    np.testing.assert_array_equal(y, [[1, 1], [1, 0]])
    np.testing.assert_array_equal(users["00002"][0][1], [[1, 0]])
    # test posts: "a q" tagged y is kept; "b" tagged w (not a kept tag) is left out
    np.testing.assert_array_equal(vx, [[0, 2, -1, -1]])
    np.testing.assert_array_equal(vy, [[1, 0]])
    assert x.dtype == np.int32 and y.dtype == np.uint8


def test_the_cli_learns_stack_overflow_tags_and_refuses_methods_that_read_class_ids(tmp_path, capsys):
    stackoverflow_tag_files(tmp_path)
    out = tmp_path / "run"
    assert main(["run", "--dataset", f"tff_stackoverflow_tags:{tmp_path}", "--algorithm", "fedavg", "--rounds", "6",
                 "--lr", "1000", "--batch-size", "10", "--local-epochs", "2", "--out", str(out)]) == 0
    assert "is a multi-label task (500 labels)" in capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["model"] in (None, "bow_logreg")
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recalls = [h["mean_accuracy"] for h in history if "mean_accuracy" in h]
    # 8 tags, 2 a post: the biases alone reach recall 5/8 of a post's two tags on average; the words tell the
    # tags, so a model that reads them gets near 1. (The loss is a mean over the 500 tags and a feature is a
    # word's share of its post, so the step size is large, as FedOpt's client learning rates for this task.)
    assert recalls[-1] > 0.9 and recalls[-1] > recalls[0] + 0.1, recalls
    capsys.readouterr()
    assert main(["run", "--dataset", f"tff_stackoverflow_tags:{tmp_path}", "--algorithm", "fedproto",
                 "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a multi-label task" in err[0] and "fedavg" in err[0], err
    assert main(["run", "--dataset", f"tff_stackoverflow_tags:{tmp_path}", "--attack", "label_flip",
                 "--malicious", "0.3", "--out", str(tmp_path / "r3")]) == 2
    assert "changes class labels" in capsys.readouterr().err
    assert not (tmp_path / "r2").exists() and not (tmp_path / "r3").exists()


def test_fedopts_stack_overflow_tag_setting_runs_on_fabricated_files(tmp_path, capsys):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
    import fedopt
    stackoverflow_tag_files(tmp_path / "data", users=tuple(f"{i:05d}" for i in range(10)), posts=6)  # (cohort 10)
    fedopt.main(["--data", str(tmp_path / "data"), "--tasks", "stackoverflow_lr", "--methods", "fedadagrad",
                 "--rounds", "1", "--out", str(tmp_path / "out")])
    assert "| stackoverflow_lr | fedadagrad | 1 |" in (tmp_path / "out" / "table.md").read_text()
    cfg = json.loads((tmp_path / "out" / "stackoverflow_lr" / "fedadagrad" / "fedavg" / "config.json").read_text())
    assert (cfg["model"], cfg["server_opt"], cfg["batch_size"], cfg["lr"]) == ("bow_logreg", "adagrad", 100, 1e4)


def flair_file(path, users=("u0", "u1"), n=(10, 6), labels=("animal", "food", "plant"), size=8, seed=0):
    """pfl-research's FLAIR file, small: /train/<user>/{images, labels_row, labels_col, ...} and the label
    mapping; image i of a user has labels {i mod 3} and, for even i, also {(i + 1) mod 3}."""
    import h5py
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        for u, k in zip(users, n):
            rows = [i for i in range(k) for _ in range(1 if i % 2 else 2)]
            cols = [c for i in range(k) for c in ([i % 3] if i % 2 else [i % 3, (i + 1) % 3])]
            f[f"/train/{u}/images"] = rng.integers(0, 256, (k, size, size, 3), dtype=np.uint8)
            f[f"/train/{u}/labels_row"] = np.asarray(rows, np.uint16)
            f[f"/train/{u}/labels_col"] = np.asarray(cols, np.uint8)
            f[f"/train/{u}/fine_grained_labels_row"] = np.asarray(rows, np.uint16)
            f[f"/train/{u}/fine_grained_labels_col"] = np.asarray(cols, np.uint16)
            f[f"/train/{u}/image_ids"] = np.asarray([f"{u}_{i}" for i in range(k)], dtype="S")
        f["/val/v0/images"] = rng.integers(0, 256, (2, size, size, 3), dtype=np.uint8)  # other users: not read
        f["/metadata/label_mapping"] = json.dumps({name: i for i, name in enumerate(labels)})
        f["/metadata/fine_grained_label_mapping"] = json.dumps({name: i for i, name in enumerate(labels)})


def test_flair_users_become_clients_with_multi_hot_coarse_labels(tmp_path, capsys):
    pytest.importorskip("h5py")
    from jaxfl.data.flair import load_flair
    flair_file(tmp_path / "flair_federated.hdf5")
    users, labels = load_flair(tmp_path / "flair_federated.hdf5", np.random.default_rng(0))
    assert labels == 3 and list(users) == ["u0", "u1"]
    (x, y), (vx, vy) = users["u0"]
    assert len(y) == 8 and len(vy) == 2 and x.shape[1:] == (8, 8, 3) and x.dtype == np.uint8
    # every image's labels, wherever the split put it: the image index is recovered from its pixels
    with __import__("h5py").File(tmp_path / "flair_federated.hdf5", "r") as f:
        images = np.asarray(f["/train/u0/images"])
    for xs, ys in ((x, y), (vx, vy)):
        for img, row in zip(xs, ys):
            i = int(np.flatnonzero((images == img).all(axis=(1, 2, 3)))[0])
            expected = {i % 3} | ({(i + 1) % 3} if i % 2 == 0 else set())
            assert set(np.flatnonzero(row)) == expected
    assert len(load_flair(tmp_path / "flair_federated.hdf5", np.random.default_rng(0), max_clients=1)[0]) == 1
    # through the CLI: a multi-label run, and a file that is not FLAIR's in one line
    out = tmp_path / "run"
    assert main(["run", "--dataset", f"flair:{tmp_path / 'flair_federated.hdf5'}", "--model", "small_cnn",
                 "--rounds", "1", "--batch-size", "4", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["clients"] == ["u0", "u1"]
    write_tff(tmp_path / "other.hdf5", {"c": {"x": np.zeros(3)}})
    capsys.readouterr()
    assert main(["run", "--dataset", f"flair:{tmp_path / 'other.hdf5'}", "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not pfl-research's FLAIR file" in err[0], err

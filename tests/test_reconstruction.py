"""Reconstruction tasks: float targets [B, D] give the mean squared error of sigmoid outputs, scored by 1 - MSE
(``core.metrics``), FedOpt's EMNIST autoencoder (``emnist_ae``) on TFF's EMNIST (``tff_emnist_ae:``), and the
CLI's path."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import EPS32, emnist_files

from jaxfl.algorithms import REGISTRY, build_algorithm, options_class
from jaxfl.core.metrics import correct_count, cross_entropy, multilabel, reconstruction, squared_error
from jaxfl.run.cli import main

h5py = pytest.importorskip("h5py")  # (the test extra installs it; CI runs these)


def test_float_targets_give_the_squared_error_of_sigmoid_outputs_under_jit_vmap_and_grad():
    rng = np.random.default_rng(0)
    z = rng.normal(0, 2, (4, 6)).astype(np.float32)
    t = rng.uniform(size=(4, 6)).astype(np.float32)
    assert reconstruction(z, t) and not multilabel(z, t)
    assert multilabel(z, (t > 0.5).astype(np.uint8)) and not reconstruction(z, (t > 0.5).astype(np.uint8))
    s = 1 / (1 + np.exp(-z.astype(np.float64)))
    expected = np.mean((s - t) ** 2, -1)
    # a sigmoid, a difference and a square per output, then a mean of 6 terms below 1: a few eps32
    tol = 8 * EPS32
    np.testing.assert_allclose(jax.jit(cross_entropy)(z, t), expected, atol=tol, rtol=0)
    np.testing.assert_allclose(jax.jit(squared_error)(z, t), expected, atol=tol, rtol=0)
    np.testing.assert_allclose(jax.vmap(cross_entropy)(z[:, None], t[:, None])[:, 0], expected, atol=tol, rtol=0)
    # d/dz of the mean squared error: 2 (s - t) s (1 - s) / D
    grad = jax.grad(lambda z: jnp.sum(cross_entropy(z, t)))(z)
    np.testing.assert_allclose(grad, 2 * (s - t) * s * (1 - s) / 6, atol=tol, rtol=0)
    # the score: real samples' 1 - MSE (padding weight 0)
    w = np.array([1.0, 1.0, 0.0, 1.0])
    assert float(correct_count(z, t, w)) == pytest.approx(float(np.sum(w * (1 - expected))), abs=4 * tol)


def test_emnist_writers_become_autoencoder_clients_with_fedopts_targets(tmp_path):
    from jaxfl.data import DataConfig, load_dataset
    from jaxfl.data.tff import load_tff_emnist_ae, read_examples
    from jaxfl.errors import DataError
    emnist_files(tmp_path)
    users = load_tff_emnist_ae(tmp_path)
    raw = read_examples(tmp_path / "fed_emnist_train.h5", ("pixels",))["f0000_14"]["pixels"]
    (x, t), (vx, vt) = users["f0000_14"]
    assert x.shape == (12, 28, 28, 1) and x.dtype == np.uint8 and t.shape == (12, 784) and t.dtype == np.float32
    np.testing.assert_array_equal(t, (1 - raw).reshape(12, 784))  # FedOpt's 1 - pixels, flattened
    np.testing.assert_array_equal(x[..., 0], np.round(255 * (1 - raw)).astype(np.uint8))
    assert vt.shape == (len(vx), 784)
    ds = load_dataset(DataConfig(f"tff_emnist_ae:{tmp_path}", channels=1, samples_per_client=5))
    assert ds.task == "reconstruction" and ds.num_classes == 784 and ds.normalize == (0.0, 1.0)
    assert all(len(x) == len(t) <= 5 for x, t in ds.train)
    with pytest.raises(DataError, match="drop --image-size 32"):
        load_dataset(DataConfig(f"tff_emnist_ae:{tmp_path}", image_size=32))
    with pytest.raises(DataError, match="does not exist; --dataset tff_emnist_ae:PATH takes the folder"):
        load_tff_emnist_ae(tmp_path / "nowhere")


def test_fedopts_autoencoder_is_the_default_model_of_the_task_and_has_its_layers(tmp_path):
    from jaxfl.models import build_model
    from jaxfl.run.config import RunConfig, model_name
    assert model_name(RunConfig(dataset="tff_emnist_ae:/data", algorithm="fedavg")) == "emnist_ae"
    model = build_model("emnist_ae", 784)
    variables = model.init(jax.random.key(0), jnp.zeros((2, 28, 28, 1)))
    kernels = [a.shape for path, a in jax.tree_util.tree_leaves_with_path(variables) if "kernel" in str(path)]
    assert kernels == [(784, 1000), (1000, 500), (500, 250), (250, 30), (30, 250), (250, 500), (500, 1000),
                       (1000, 784)]
    assert sum(a.size for a in jax.tree_util.tree_leaves(variables)) == 2_837_314
    # the formula in float64: a sigmoid after every hidden layer but the 30-unit code (fc4), then the linear head
    x = np.random.default_rng(0).uniform(size=(2, 28, 28, 1)).astype(np.float32)
    p = variables["params"]
    h = x.reshape(2, -1).astype(np.float64)
    for i in range(1, 8):
        h = h @ np.asarray(p["encoder"][f"fc{i}"]["kernel"], np.float64) + np.asarray(p["encoder"][f"fc{i}"]["bias"])
        h = h if i == 4 else 1 / (1 + np.exp(-h))
    head = jax.tree_util.tree_leaves(p["head"])  # (bias, kernel)
    out = h @ np.asarray(head[1], np.float64) + np.asarray(head[0], np.float64)
    # float32 rounding of sums of up to 1,000 terms, each layer's error carried through the next (sigmoids
    # contract it): eps32 x the longest sum x the largest output, a bound the actual error stays far inside
    np.testing.assert_allclose(model.apply(variables, x), out, atol=1000 * EPS32 * (np.abs(out).max() + 1), rtol=0)


def pattern_files(folder, writers=4, n=24, seed=0):
    """TFF's EMNIST pair whose images are noisy copies of 3 fixed strokes: an autoencoder that reads its input
    reconstructs them far better than the mean image does."""
    rng = np.random.default_rng(seed)
    strokes = np.ones((3, 28, 28), np.float32)  # paper 1, ink 0 (TFF's polarity)
    strokes[0, 4:24, 12:16] = 0
    strokes[1, 12:16, 4:24] = 0
    strokes[2][np.eye(28, dtype=bool)] = 0
    from conftest import write_tff
    for split, k in (("train", n), ("test", n // 3)):
        write_tff(folder / f"fed_emnist_{split}.h5", {
            f"w{i}": {"pixels": np.clip(strokes[rng.integers(0, 3, k)] + rng.normal(0, 0.05, (k, 28, 28)), 0, 1
                                        ).astype(np.float32), "label": np.zeros(k, np.int32)}
            for i in range(writers)})


def test_the_cli_learns_the_autoencoder_and_refuses_methods_that_read_class_ids(tmp_path, capsys):
    pattern_files(tmp_path)
    out = tmp_path / "run"
    # the 2NN with 784 outputs learns this in a few rounds (FedOpt's deep sigmoid autoencoder needs thousands);
    # the loss averages 784 squared errors of sigmoids, so its gradients are small and the step large
    assert main(["run", "--dataset", f"tff_emnist_ae:{tmp_path}", "--channels", "1", "--algorithm", "fedavg",
                 "--model", "mlp_2nn", "--rounds", "8", "--lr", "5", "--local-epochs", "2", "--batch-size", "8",
                 "--out", str(out)]) == 0
    assert "is a reconstruction task (784 targets a sample)" in capsys.readouterr().err
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    mse = [np.mean(h["test_loss"]) for h in history if "test_loss" in h]
    score = [h["mean_accuracy"] for h in history if "mean_accuracy" in h]
    # the test images' own variance around their mean image, the MSE of the best input-blind prediction
    with h5py.File(tmp_path / "fed_emnist_test.h5", "r") as f:
        test = np.concatenate([1 - np.asarray(f["examples"][w]["pixels"]).reshape(-1, 784) for w in f["examples"]])
    blind = float(np.mean((test - test.mean(0)) ** 2))
    assert mse[-1] < 0.3 * blind and mse[-1] < mse[0], (mse, blind)
    assert score[-1] == pytest.approx(1 - np.mean(history[-1]["test_loss"]), abs=0.01)  # (client means of 1 - MSE)
    capsys.readouterr()
    assert main(["run", "--dataset", f"tff_emnist_ae:{tmp_path}", "--algorithm", "fedproto",
                 "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a reconstruction task" in err[0] and "fedavg" in err[0], err
    assert not (tmp_path / "r2").exists()


def reconstruction_clients(counts=(24, 17, 9), m=24, seed=0):
    """Targets that are a fixed squashing of the features: t = sigmoid(2 x) per output (a learnable task)."""
    from jaxfl.data.clients import ClientData
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(len(counts), m, 6)).astype(np.float32)
    t = (1 / (1 + np.exp(-2 * x))).astype(np.float32)
    return ClientData(jnp.asarray(x), jnp.asarray(t), jnp.asarray(counts, jnp.int32))


# the defaults that do not suit squared errors of sigmoids (small gradients, so a large lr): pFedMe's inner
# steps diverge at its personal lr 0.3 and above, FedAMP's pull towards its attention-weighted model holds the
# loss near the input-blind one at its lambda 1
OPTIONS = {"pfedme": {"personal_lr": 0.1}, "fedamp": {"lam": 0.1}}


@pytest.mark.parametrize("name", sorted(n for n in REGISTRY if options_class(n).multilabel))
def test_every_method_that_accepts_float_targets_learns_a_reconstruction_task(name):
    from conftest import make_trainer, run_rounds

    from jaxfl.core.step import init_state
    from jaxfl.core.types import RunContext
    from jaxfl.models import Classifier, MLPEncoder, MLPHead
    data = reconstruction_clients()
    model = Classifier(encoder=MLPEncoder((16,)), head=MLPHead((), 6))
    alg = build_algorithm(options_class(name)(**OPTIONS.get(name, {})), model,
                          make_trainer(batch_size=8, epochs=3, lr=1.0),
                          RunContext(num_clients=3, num_rounds=8))
    server, clients = init_state(alg, jax.random.key(0), data.x[0], 3)
    _, _, first = run_rounds(alg, data, server, clients, jax.random.key(1), rounds=1, num_rounds=8)
    _, _, last = run_rounds(alg, data, server, clients, jax.random.key(1), rounds=8, num_rounds=8)
    loss0, loss = np.asarray(first["loss"]), np.asarray(last["loss"])
    # the best input-blind prediction (the targets' mean) leaves their variance; a model reading x does better
    # (the slowest here, FedBABU's fixed random head, at ~0.74 of it after 8 rounds; most below 0.3)
    blind = float(np.var(np.asarray(data.y)))
    assert np.all(np.isfinite(loss)) and np.mean(loss) < min(0.8 * blind, np.mean(loss0)), (loss0, loss, blind)
    assert 0 <= np.min(last["accuracy"]) and np.max(last["accuracy"]) <= 1

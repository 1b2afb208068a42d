"""FedLC (logit calibration) and FedProto (prototype sharing): their pure functions against the formulas, the
reductions (FedLC at tau 0 is FedAvg; FedProto's first round is local training), the server's prototypes by hand,
and both through the CLI."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (assert_cli_runs, assert_trees_close, bit_identity, make_data, make_trainer, rounds_tolerance,
                      run_rounds)

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms._common import logits_and_representation
from jaxfl.algorithms.fedlc import calibrated_ce_loss
from jaxfl.algorithms.fedproto import mean_prototypes, prototype_logits, prototype_regulariser
from jaxfl.core.step import init_state
from jaxfl.core.types import RunContext
from jaxfl.models import small_cnn
from jaxfl.ops.losses import class_counts, logit_calibration
from jaxfl.run.runner import model_size

COUNTS = (12, 20, 7)


def model():
    return small_cnn(num_classes=4, width=4, hidden=(8,))


def rep(m, v, x):
    """z: the input of the head's last Dense (FedProto's default representation)."""
    return m.apply(v, x, False, None, method=logits_and_representation("penultimate"))[1]


def setup(name, counts=COUNTS, **options):
    data = make_data(list(counts))
    alg = build_algorithm(name, model(), make_trainer(), RunContext(num_clients=len(counts)), **options)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], len(counts))
    return alg, data, server, clients


def test_logit_calibration_is_tau_times_count_to_the_minus_quarter():
    y = jnp.array([0, 0, 0, 0, 2, 2, 1, 3, 3])  # the last two are padding (count 7)
    n = jax.jit(class_counts, static_argnums=2)(y, 7, 4)
    np.testing.assert_array_equal(n, [4, 1, 2, 0])
    delta = jax.jit(logit_calibration)(n, 0.5)
    np.testing.assert_allclose(delta, 0.5 * np.array([4 ** -0.25, 1.0, 2 ** -0.25, 1e-8 ** -0.25]), rtol=1e-6)
    assert float(delta[3]) == pytest.approx(50.0, rel=1e-5)  # an absent class: 100 tau, finite


def test_calibrated_loss_is_ce_of_the_lowered_logits_and_its_gradient():
    alg, data, server, _ = setup("fedlc")
    x, y, w = data.x[0, :8] / 255.0, data.y[0, :8], (jnp.arange(8) < 6).astype(jnp.float32)
    offsets = jnp.array([0.1, 2.0, 0.0, 0.7])
    fn = calibrated_ce_loss(model())
    loss, (_, logits) = jax.jit(fn)(server["params"], server["batch_stats"], x, y, w, None, offsets)
    z = np.asarray(logits, np.float64) - np.asarray(offsets)
    ce = -(z[np.arange(8), np.asarray(y)] - np.log(np.exp(z).sum(-1)))
    np.testing.assert_allclose(float(loss), (ce * np.asarray(w)).sum() / 6, rtol=1e-5)
    # gradient: d/dz of mean CE(z - delta) is (softmax(z - delta) - onehot) w / sum w
    dz = jax.grad(lambda lg: jnp.sum(w * (jax.nn.logsumexp(lg - offsets, -1)
                                          - jnp.take_along_axis(lg - offsets, y[:, None], -1)[:, 0])) / 6)(logits)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = (p - np.eye(4)[np.asarray(y)]) * np.asarray(w)[:, None] / 6
    np.testing.assert_allclose(np.asarray(dz), want, atol=1e-6)


@bit_identity("at tau 0 the calibration adds exact zeros to the logits")
def test_fedlc_at_tau_zero_is_fedavg_and_tau_changes_it():
    root = jax.random.key(3)
    out = {}
    for name, opts in (("fedavg", {}), ("fedlc", {"tau": 0.0}), ("fedlc", {"tau": 1.0})):
        alg, data, server, clients = setup(name, **opts)
        out[name, opts.get("tau")] = run_rounds(alg, data, server, clients, root, rounds=2)[0]
    assert_trees_close(out["fedlc", 0.0], out["fedavg", None], atol=0, rtol=0)
    gap = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree_util.tree_leaves(out["fedlc", 1.0]),
                                                           jax.tree_util.tree_leaves(out["fedavg", None])))
    assert gap > 1e-4


def test_prototype_functions_match_their_formulas():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(5, 3)).astype(np.float32)
    protos = rng.normal(size=(4, 3)).astype(np.float32)
    valid = np.array([True, False, True, True])
    y = np.array([0, 1, 2, 3, 0])
    reg = jax.jit(prototype_regulariser)(z, y, protos, valid)
    want = np.where(valid[y], ((z - protos[y]) ** 2).sum(-1) / 3, 0.0)
    np.testing.assert_allclose(reg, want, rtol=1e-5)
    logits = jax.jit(prototype_logits)(z, protos, valid)
    d = ((z[:, None] - protos[None]) ** 2).sum(-1) / 3
    np.testing.assert_allclose(np.asarray(logits)[:, valid], -d[:, valid], rtol=1e-5)
    np.testing.assert_array_equal(np.argmax(logits, -1), np.argmin(np.where(valid, d, np.inf), -1))
    # the regulariser's gradient moves z toward its class prototype: d/dz = 2 (z - P_y) / d
    gz = jax.vmap(jax.grad(lambda zz, yy: prototype_regulariser(zz[None], yy[None], protos, valid)[0]))(z, y)
    np.testing.assert_allclose(gz, np.where(valid[y][:, None], 2 * (z - protos[y]) / 3, 0.0), rtol=1e-5, atol=1e-6)
    # the server's mean over the clients holding a class (a plain mean, not weighted by counts)
    k_protos = rng.normal(size=(3, 4, 3)).astype(np.float32)
    present = np.array([[1, 0, 1, 0], [1, 0, 0, 0], [0, 0, 1, 0]], bool)
    mean, has = jax.jit(mean_prototypes)(k_protos, present)
    np.testing.assert_array_equal(has, [True, False, True, False])
    np.testing.assert_allclose(mean[0], k_protos[:2, 0].mean(0), rtol=1e-6)
    np.testing.assert_allclose(mean[2], k_protos[[0, 2], 2].mean(0), rtol=1e-6)
    np.testing.assert_array_equal(mean[1], 0.0)


@bit_identity("round 0 has no prototypes: the regulariser's weight is 0 and adds exact zeros")
def test_fedproto_round_zero_is_local_training_and_the_server_holds_class_means():
    root = jax.random.key(3)
    alg, data, server, clients = setup("fedproto")
    assert set(server) == {"prototypes", "valid"} and not bool(server["valid"].any())
    s1, c1, _ = run_rounds(alg, data, server, clients, root, rounds=1)
    loc = setup("local")
    _, c_loc, _ = run_rounds(*loc, root, rounds=1)
    # no prototypes yet: CE only, nothing shared (two programs, equal up to float32 rounding of the round)
    assert_trees_close(c1, c_loc, atol=rounds_tolerance(*loc, root, rounds=1)[1], rtol=0)
    # the server's prototypes: per class, the plain mean over clients of each client's eval-mode class mean
    m = model()
    means, holds = [], []
    for i, n in enumerate(COUNTS):
        v = jax.tree_util.tree_map(lambda a: a[i], c1)
        z = np.asarray(rep(m, v, data.x[i, :n] / 255.0 * 2 - 1))
        yi = np.asarray(data.y[i, :n])
        means.append(np.stack([z[yi == c].mean(0) if (yi == c).any() else np.zeros(z.shape[1]) for c in range(4)]))
        holds.append(np.array([(yi == c).any() for c in range(4)]))
    means, holds = np.stack(means), np.stack(holds)
    want = (means * holds[..., None]).sum(0) / np.maximum(holds.sum(0), 1)[:, None]
    np.testing.assert_allclose(s1["prototypes"], want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(s1["valid"], holds.any(0))
    # round 1 adds the regulariser: lam = 0 keeps local training, lam > 0 changes the models
    s2, c2, _, rows = run_rounds(alg, data, s1, c1, root, rounds=1, keep_rows=True)
    alg0 = setup("fedproto", lam=0.0)[0]
    _, c2_0, _ = run_rounds(alg0, data, s1, c1, root, rounds=1)
    gap = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree_util.tree_leaves(c2),
                                                           jax.tree_util.tree_leaves(c2_0)))
    assert gap > 1e-5
    # prediction: the nearest global prototype (logits -||z - P_c||^2 / d)
    v0 = jax.tree_util.tree_map(lambda a: a[0], c2)
    x = data.x[0, :5] / 255.0 * 2 - 1
    z = rep(m, v0, x)
    want = prototype_logits(z, s2["prototypes"], s2["valid"])
    np.testing.assert_allclose(alg.predict(s2, v0, x), want, rtol=1e-5)
    head = setup("fedproto", predict="head")[0]
    np.testing.assert_allclose(head.predict(s2, v0, x), m.apply(v0, x, train=False), rtol=1e-6)
    # the run's model size is the model's when the server holds none
    n = sum(a.size for a in jax.tree_util.tree_leaves(v0["params"]))
    assert model_size(s2, m, x) == n == model_size(setup("fedavg")[2], None, None)
    assert rows["protos"].shape == (3, 4, 8) and rows["counts"].shape == (3, 4)


@pytest.mark.parametrize("name", ["fedlc", "fedproto"])
def test_the_cli_runs(name, tmp_path):
    assert_cli_runs(name, tmp_path)

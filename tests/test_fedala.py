"""FedALA (adaptive local aggregation): the layer split, the weight step and the stopping rule by definition, a
client's first participation (no ALA) and its first ALA (the convergence loop) against a plain Python
transcription of the official loop, prediction, and the CLI."""
import jax
import jax.numpy as jnp
import numpy as np
from conftest import (assert_cli_runs, assert_trees_close, info, make_data, make_trainer, rounding_tolerance,
                      run_rounds)

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms._common import aux_key, ce_loss
from jaxfl.algorithms.fedala import blend, converged, higher_layers, weight_step
from jaxfl.core.metrics import cross_entropy, weighted_mean_loss
from jaxfl.core.step import init_state
from jaxfl.core.trees import fill, prune
from jaxfl.core.types import RunContext
from jaxfl.models import small_cnn

COUNTS = (20, 30, 15)
ROOT = jax.random.key(3)


def model():
    return small_cnn(num_classes=4, width=4, hidden=(8,))


def setup(**options):
    data = make_data(list(COUNTS))
    alg = build_algorithm("fedala", model(), make_trainer(), RunContext(num_clients=3), **options)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], 3)
    return alg, data, server, clients


def test_layer_split_weight_step_and_stopping_rule():
    params = model().init(jax.random.key(0), jnp.zeros((1, 8, 8, 3)))["params"]
    last = prune(params, higher_layers(params, "head_last"))
    assert set(last) == {"head"} and set(last["head"]) == {"fc2"}  # the head's last Dense: kernel and bias
    assert set(prune(params, higher_layers(params, "head"))["head"]) == {"fc1", "bn1", "fc2"}
    assert prune(params, higher_layers(params, "all")).keys() == params.keys()
    a, g, w, grad = (jnp.array([1.0, 2.0, 3.0]), jnp.array([0.0, 4.0, 3.0]), jnp.array([0.5, 0.9, 0.2]),
                     jnp.array([2.0, -1.0, 5.0]))
    np.testing.assert_allclose(blend(a, g, w), [0.5, 3.8, 3.0])
    np.testing.assert_allclose(weight_step(w, grad, a, g, 0.3), np.clip(w - 0.3 * grad * (g - a), 0, 1))
    losses = jnp.array([1.0, 1.02, 0.99, 1.01])
    assert not bool(converged(losses, 4, 4, 0.1)) and bool(converged(losses, 5, 4, 0.1))
    assert not bool(converged(losses * jnp.array([1, 2, 1, 2]), 5, 4, 0.1))


def reference_ala(mdl, glob, top, w, stats, data, start, r, b, eta, first, threshold=10.0, num_pre=10):
    """The official ALA.adaptive_local_aggregation loop (window, passes, stopping rule) in plain Python."""
    x = data.x / 255.0 * 2 - 1
    g_top = prune(glob, higher_layers(glob, "head_last"))
    losses, passes = [], 0
    while True:
        for t in range(-(-r // b)):
            pos = np.arange(start + t * b, min(start + t * b + b, start + r))

            def f(h):
                logits, _ = mdl.apply({"params": fill(glob, h), "batch_stats": stats}, x[pos], train=True,
                                      mask=jnp.ones(len(pos)), mutable=["batch_stats"])
                return weighted_mean_loss(cross_entropy(logits, data.y[pos]), jnp.ones(len(pos)))
            loss, grad = jax.value_and_grad(f)(blend(top, g_top, w))
            w = jax.tree_util.tree_map(lambda w_, g_, a_, c_: jnp.clip(w_ - eta * g_ * (c_ - a_), 0, 1), w, grad,
                                       top, g_top)
        losses.append(float(loss))
        passes += 1
        if not first or (len(losses) > num_pre and np.std(losses[-num_pre:]) < threshold):
            return w, blend(top, g_top, w), passes


def test_first_participation_trains_the_global_model_and_the_second_runs_ala():
    alg, data, server, clients = setup(threshold=10.0)
    trainer, loss = make_trainer(), ce_loss(model())
    i, key = 1, jax.random.key(7)
    row = data.take(i)
    c = jax.tree_util.tree_map(lambda a: a[i], clients)
    trained, metrics = jax.jit(alg.local_update)(server, c, row, key, info(0, i))
    by_hand = jax.jit(lambda params, stats: trainer.run(loss, params, stats, trainer.tx.init(params), row, key)[0])
    # another program: equal up to float32 rounding of the hand-made training run
    assert_trees_close(trained["params"], by_hand(server["params"], c["batch_stats"]),
                       atol=rounding_tolerance(by_hand, server["params"], c["batch_stats"]), rtol=0)
    assert float(metrics["ala_passes"]) == 0.0 and bool(trained["first_ala"])
    # the second participation: the first ALA (the convergence loop: > 10 passes), then training from its blend
    s1, c1, _ = run_rounds(alg, data, server, clients, ROOT, rounds=1)
    c = jax.tree_util.tree_map(lambda a: a[i], c1)
    trained, metrics = jax.jit(alg.local_update)(s1, c, row, key, info(1, i))
    n, r = int(row.count), int(np.floor(0.8 * int(row.count)))
    start = int(jax.random.randint(aux_key(key), (), 0, n - r + 1))
    w, top, passes = reference_ala(model(), s1["params"], c["top"], c["W"], c["batch_stats"], _row(row), start,
                                   r, 8, 1.0, True)
    assert passes == 11 and float(metrics["ala_passes"]) == 11.0 and not bool(trained["first_ala"])
    assert_trees_close(trained["W"], w, atol=1e-5)
    leaves = np.concatenate([np.asarray(v).ravel() for v in jax.tree_util.tree_leaves(trained["W"])])
    assert leaves.min() >= 0 and leaves.max() <= 1 and leaves.min() < 1  # W moved, inside [0, 1]
    begin = fill(s1["params"], top)
    want = trainer.run(loss, begin, c["batch_stats"], trainer.tx.init(begin), row, key)[0]
    assert_trees_close(trained["params"], want, atol=1e-5)
    # later participations: one pass
    c2 = dict(c, first_ala=jnp.array(False))
    assert float(jax.jit(alg.local_update)(s1, c2, row, key, info(2, i))[1]["ala_passes"]) == 1.0
    # prediction: the global model with the client's higher layers blended by its W
    x = row.x[:3] / 255.0 * 2 - 1
    blended = blend(c["top"], prune(s1["params"], higher_layers(s1["params"], "head_last")), c["W"])
    np.testing.assert_allclose(alg.predict(s1, c, x), model().apply(
        {"params": fill(s1["params"], blended), "batch_stats": c["batch_stats"]}, x), rtol=1e-6)


def _row(row):
    """The client's real samples in stored order (what ALA's window indexes)."""
    return type(row)(row.x[:int(row.count)], row.y[:int(row.count)], row.count)


def test_the_cli_runs_fedala(tmp_path):
    assert_cli_runs("fedala", tmp_path, "--fedala.layers", "head")

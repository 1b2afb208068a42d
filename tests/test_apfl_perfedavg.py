"""APFL (a learned mixture of a personal and the global model) and Per-FedAvg (MAML meta-model): their steps
against hand computations, their reductions (APFL's global model is FedAvg's; alpha 1 is local training), and
both through the CLI."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (assert_cli_runs, assert_trees_close, make_data, make_trainer, rounding_tolerance,
                      rounds_tolerance, run_rounds)

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms._common import ce_loss
from jaxfl.algorithms.apfl import clip_to_unit_interval, mix_params
from jaxfl.algorithms.perfedavg import meta_gradient
from jaxfl.core.step import init_state
from jaxfl.core.trainer import epoch_permutation
from jaxfl.core.types import RunContext
from jaxfl.data.clients import ClientData
from jaxfl.models import logreg, small_cnn

COUNTS = (12, 20, 7)
LR = 0.05


def model():
    return small_cnn(num_classes=4, width=4, hidden=(8,))


def setup(name, counts=COUNTS, mdl=None, batch_size=8, momentum=0.5, **options):
    data = make_data(list(counts))
    ctx = RunContext(num_clients=len(counts))
    alg = build_algorithm(name, mdl or model(), make_trainer(batch_size, lr=LR, momentum=momentum), ctx, **options)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], len(counts))
    return alg, data, server, clients


def grad_at(mdl, variables, x, y):
    loss = ce_loss(mdl)
    return jax.grad(lambda p: loss(p, variables["batch_stats"], x, y, jnp.ones(len(y)), None)[0])(variables["params"])


def test_apfl_step_is_the_papers_simultaneous_update():
    # one client, one batch holding all its samples, plain SGD: one step of Algorithm 1 by hand
    alg, data, server, clients = setup("apfl", counts=(8,), batch_size=8, momentum=0.0)
    client = jax.tree_util.tree_map(lambda a: a[0], clients)
    rng = np.random.default_rng(1)
    client["v"]["params"] = jax.tree_util.tree_map(lambda a: a + 0.1 * rng.normal(size=a.shape).astype(a.dtype),
                                                   client["v"]["params"])
    client["alpha"] = jnp.float32(0.3)
    row = data.take(0)
    trained, metrics = jax.jit(alg.local_update)(server, client, row, jax.random.key(5), None)
    x, y = row.x / 255.0 * 2 - 1, row.y
    w, v, a = server["params"], client["v"]["params"], 0.3
    mdl = model()

    @jax.jit
    def by_hand(w, v, x):
        g_w = grad_at(mdl, {"params": w, "batch_stats": server["batch_stats"]}, x, y)
        vbar = {"params": mix_params(a, v, w), "batch_stats": client["v"]["batch_stats"]}
        g_bar = grad_at(mdl, vbar, x, y)
        return (optax.apply_updates(w, optax.tree.scale(-LR, g_w)),
                optax.apply_updates(v, optax.tree.scale(-LR * a, g_bar)), g_bar)
    want_w, want_v, g_bar = by_hand(w, v, x)
    want_a = np.clip(a - LR * float(optax.tree.vdot(optax.tree.sub(v, w), g_bar)), 0, 1)
    # another program: equal up to float32 rounding of the hand-made step
    tol_w, tol_v, _ = rounding_tolerance(by_hand, w, v, x)
    assert_trees_close(trained["params"], want_w, atol=tol_w, rtol=0)
    assert_trees_close(trained["v"]["params"], want_v, atol=tol_v, rtol=0)
    np.testing.assert_allclose(float(trained["alpha"]), want_a, rtol=1e-5)
    assert abs(want_a - a) > 1e-5 and float(metrics["alpha"]) == float(trained["alpha"])


def test_apfl_global_model_is_fedavg_and_alpha_one_is_local_training():
    root = jax.random.key(3)
    fedavg = run_rounds(*setup("fedavg"), root, rounds=2)
    apfl = run_rounds(*setup("apfl", alpha_init=0.7), root, rounds=2)
    # w sees only its own loss (two programs: equal up to float32 rounding of FedAvg's two rounds)
    assert_trees_close(apfl[0], fedavg[0], atol=rounds_tolerance(*setup("fedavg"), root, rounds=2)[0], rtol=0)
    one = run_rounds(*setup("apfl", alpha_init=1.0, adaptive=False), root, rounds=1)
    local = run_rounds(*setup("local"), root, rounds=1)
    assert_trees_close(one[1]["v"], local[1], atol=rounds_tolerance(*setup("local"), root)[1], rtol=0)
    np.testing.assert_array_equal(one[1]["alpha"], 1.0)
    # alpha's projected step: a huge step ends at a bound of [0, 1]
    tx = optax.chain(optax.sgd(1e4), clip_to_unit_interval())
    a = jnp.array([0.3, 0.6, 0.5])
    step, _ = tx.update(jnp.array([1.0, -1.0, 0.0]), tx.init(a), a)
    np.testing.assert_array_equal(optax.apply_updates(a, step), [0.0, 1.0, 0.5])
    adaptive = np.asarray(apfl[1]["alpha"])
    assert np.all((adaptive >= 0) & (adaptive <= 1)) and not np.allclose(adaptive, 0.7)


@pytest.mark.parametrize("mix", ["params", "logits"])
def test_apfl_predicts_with_the_mixture(mix):
    alg, data, server, clients = setup("apfl", mix=mix)
    s, c, _ = run_rounds(alg, data, server, clients, jax.random.key(3), rounds=1)
    c0 = jax.tree_util.tree_map(lambda a: a[0], c)
    x, a, mdl = data.x[0, :5] / 255.0 * 2 - 1, c0["alpha"], model()
    glob = {"params": s["params"], "batch_stats": s["batch_stats"]}
    if mix == "params":
        want = mdl.apply({"params": mix_params(a, c0["v"]["params"], s["params"]),
                          "batch_stats": c0["v"]["batch_stats"]}, x, train=False)
    else:
        want = a * mdl.apply(c0["v"], x, train=False) + (1 - a) * mdl.apply(glob, x, train=False)
    np.testing.assert_allclose(alg.predict(s, c0, x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_meta_gradient_matches_its_formula(variant):
    mdl = logreg(num_classes=4)
    data = make_data([24], shape=(4, 4, 1))
    x, y = data.x[0] / 255.0 * 2 - 1, data.y[0]
    v = mdl.init(jax.random.key(0), x[:1])
    params, stats = v["params"], {}
    loss = ce_loss(mdl)
    f = lambda p, i: loss(p, stats, x[i], y[i], jnp.ones(8), None)[0]  # noqa: E731
    batches = [(x[i], y[i], jnp.ones(8), None) for i in (slice(0, 8), slice(8, 16), slice(16, 24))]
    grad_fn = lambda p, s, bt: jax.value_and_grad(loss, has_aux=True)(p, s, *bt)  # noqa: E731
    alpha, delta = 0.3, (1e-2 if variant == "hf" else None)
    g, _, (l1, _) = jax.jit(lambda p: meta_gradient(grad_fn, p, stats, batches[:3 if delta else 2], alpha,
                                                    delta))(params)
    adapted = optax.apply_updates(params, optax.tree.scale(-alpha, jax.grad(f)(params, slice(0, 8))))
    want = jax.grad(f)(adapted, slice(8, 16))
    np.testing.assert_allclose(float(l1), float(f(adapted, slice(8, 16))), rtol=1e-5)
    if delta:  # the finite difference approximates the exact Hessian-vector product H(w; D'') g
        hvp = jax.jvp(lambda p: jax.grad(f)(p, slice(16, 24)), (params,), (want,))[1]
        want = optax.tree.sub(want, optax.tree.scale(alpha, hvp))
        assert float(optax.tree.norm(hvp)) > 1e-3
    assert_trees_close(g, want, atol=2e-5, rtol=1e-3)


def test_perfedavg_local_update_and_adaptation_by_hand():
    mdl = logreg(num_classes=4)
    data = make_data([16], shape=(4, 4, 1))
    ctx = RunContext(num_clients=1)
    alg = build_algorithm("perfedavg", mdl, make_trainer(8, lr=0.2), ctx, beta=0.1)
    server, clients = init_state(alg, jax.random.key(0), data.x[0], 1)
    row, key = data.take(0), jax.random.key(9)
    trained, metrics = jax.jit(alg.local_update)(server, {}, row, key, None)
    # 16 samples, batches of 8, FO: one meta-step on the epoch's two batches
    perm = epoch_permutation(jax.random.fold_in(jax.random.fold_in(key, 0), 0), 16, 16)
    x, y = row.x[perm] / 255.0 * 2 - 1, row.y[perm]
    loss = ce_loss(mdl)

    @jax.jit
    def by_hand(params, x):  # the meta-step of size 0.1, and of the client lr 0.2 (tied)
        f = lambda p, i: loss(p, {}, x[i], y[i], jnp.ones(8), None)[0]  # noqa: E731
        adapted = optax.apply_updates(params, optax.tree.scale(-0.2, jax.grad(f)(params, slice(0, 8))))
        g = jax.grad(f)(adapted, slice(8, 16))
        return optax.apply_updates(params, optax.tree.scale(-0.1, g)), optax.apply_updates(
            params, optax.tree.scale(-0.2, g))
    want, want_tied = by_hand(server["params"], x)
    # other programs: equal up to float32 rounding of the hand-made meta-steps
    tol, tol_tied = rounding_tolerance(by_hand, server["params"], x)
    assert_trees_close(trained["params"], want, atol=tol, rtol=0)
    assert float(metrics["steps"]) == 1.0 and float(metrics["seen"]) == 8.0
    # prediction: the global model after one SGD step (0.2) on a batch of the client's own training data
    train = ClientData(row.x / 255.0 * 2 - 1, row.y, row.count)
    tuned = alg.prepare_predict(server, {}, train, jax.random.key(4))["tuned"]
    idx = epoch_permutation(jax.random.fold_in(jax.random.key(4), 0), 16, 16)[:8]
    tune = jax.jit(lambda p, x: optax.apply_updates(p, optax.tree.scale(-0.2, jax.grad(
        lambda p: loss(p, {}, x, train.y[idx], jnp.ones(8), None)[0])(p))))
    assert_trees_close(tuned["params"], tune(server["params"], train.x[idx]),
                       atol=rounding_tolerance(tune, server["params"], train.x[idx]), rtol=0)
    np.testing.assert_allclose(alg.predict(server, {"tuned": tuned}, train.x[:3]),
                               mdl.apply(tuned, train.x[:3]), rtol=1e-5)
    # by default the meta step is the client lr (PFLlib's beta = alpha): one meta-step of size 0.2
    tied, _ = jax.jit(build_algorithm("perfedavg", mdl, make_trainer(8, lr=0.2), ctx).local_update)(
        server, {}, row, key, None)
    assert_trees_close(tied["params"], want_tied, atol=tol_tied, rtol=0)
    plain = build_algorithm("perfedavg", mdl, make_trainer(8, lr=0.2), ctx, eval_steps=0)
    assert plain.prepare_predict is None
    np.testing.assert_allclose(plain.predict(server, {}, train.x[:3]), mdl.apply(server, train.x[:3]), rtol=1e-6)


@pytest.mark.parametrize("name,extra", [("apfl", []), ("perfedavg", ["--perfedavg.variant", "hf"])])
def test_the_cli_runs(name, extra, tmp_path):
    assert_cli_runs(name, tmp_path, *extra)

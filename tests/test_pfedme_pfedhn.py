"""pFedMe and pFedHN: exact reductions, one hand-computed step each, what clients keep and what the server keeps."""
import jax
import jax.numpy as jnp
import numpy as np
from conftest import assert_trees_close, info, make_data, make_trainer, rounds_tolerance, run_rounds

from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms._common import ce_loss, init_variables
from jaxfl.algorithms.pfedhn import TargetLayout
from jaxfl.core.step import init_state
from jaxfl.core.types import RunContext
from jaxfl.models import small_cnn
from jaxfl.ops.hypernet import hypernetwork


ROOT = jax.random.key(5)
COUNTS = (16, 11, 6)
tmap = jax.tree_util.tree_map


def model():
    return small_cnn(num_classes=4, width=4, hidden=(8,))  # BatchNorm in the encoder and in the head


def init(alg, data):
    return init_state(alg._replace(init=jax.jit(alg.init)), jax.random.key(0), data.x[0], data.num_clients)


apply = jax.jit(lambda variables, x: model().apply(variables, x, train=False))


def batch(data, i, n):
    """Client i's first n samples, preprocessed as the trainer does."""
    return data.x[i, :n] / 127.5 - 1.0, data.y[i, :n], jnp.ones(n)


def leaves(tree):
    return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(tree)]


# ---------------------------------------------------------------------------------------------------- pFedMe

def test_pfedme_with_one_inner_step_and_eta_lambda_one_is_fedavg():
    """K = 1 and eta * lambda = 1: theta_1 = w - plr grad f(w) and w <- w - eta lambda (w - theta_1) = theta_1, so
    each client takes plain SGD(plr) steps and beta = 1 averages them: FedAvg with lr plr (theta = w throughout)."""
    data = make_data(list(COUNTS))
    ours = build_algorithm("pfedme", model(), make_trainer(lr=0.5, momentum=0.0), lam=2.0, inner_steps=1,
                           personal_lr=0.05)
    avg = build_algorithm("fedavg", model(), make_trainer(lr=0.05, momentum=0.0))
    s_ours, _, _ = run_rounds(ours, data, *init(ours, data), ROOT, rounds=2)
    s_avg, _, _ = run_rounds(avg, data, *init(avg, data), ROOT, rounds=2)
    # two programs for the same math: equal up to float32 rounding of FedAvg's two rounds
    assert_trees_close(s_ours, s_avg, atol=rounds_tolerance(avg, data, *init(avg, data), ROOT, rounds=2)[0], rtol=0)


def test_pfedme_with_lambda_zero_keeps_w_and_trains_theta_locally():
    """lambda = 0: w never moves (the server stays at its start) and theta is plain local SGD(plr) from w, i.e.
    the first round of local training (K = 1)."""
    data = make_data(list(COUNTS))
    ours = build_algorithm("pfedme", model(), make_trainer(lr=0.05, momentum=0.5), lam=0.0, inner_steps=1,
                           personal_lr=0.05)
    loc = build_algorithm("local", model(), make_trainer(lr=0.05, momentum=0.0))
    server, clients = init(ours, data)
    s1, c1, _ = run_rounds(ours, data, server, clients, ROOT, rounds=1)
    _, c_loc, _ = run_rounds(loc, data, *init(loc, data), ROOT, rounds=1)
    # (up to float32 rounding: the server's weighted mean of equal models, and another program than Local's)
    server_tol = rounds_tolerance(ours, data, server, clients, ROOT)[0]["params"]
    assert_trees_close(s1["params"], server["params"], atol=server_tol, rtol=0)
    client_tol = rounds_tolerance(loc, data, *init(loc, data), ROOT)[1]["params"]
    assert_trees_close(c1["personal"]["params"], c_loc["params"], atol=client_tol, rtol=0)


def test_pfedme_one_local_step_against_a_hand_computation():
    """One minibatch (6 samples <= batch 8): K = 2 inner steps
    theta <- theta - plr (g(theta) + lam (theta - w) + mu theta), then w <- w - eta lam (w - theta_2)."""
    lam, plr, mu, eta = 3.0, 0.1, 0.01, 0.05
    data = make_data([6])
    alg = build_algorithm("pfedme", model(), make_trainer(lr=eta, momentum=0.0), lam=lam, inner_steps=2,
                          personal_lr=plr, mu=mu)
    server, clients = init(alg, data)
    row, metrics = jax.jit(alg.local_update)(server, tmap(lambda a: a[0], clients), data.take(0),
                                             jax.random.key(1), info(0, 0))
    assert float(metrics["steps"]) == 1.0
    x, y, w = batch(data, 0, 6)
    grad = jax.jit(jax.grad(lambda p, s: ce_loss(model())(p, s, x, y, w, None), has_aux=True))
    w0 = [np.asarray(a, np.float64) for a in jax.tree_util.tree_leaves(server["params"])]
    treedef = jax.tree_util.tree_structure(server["params"])
    theta, stats = w0, server["batch_stats"]
    for _ in range(2):
        g, (stats, _) = grad(jax.tree_util.tree_unflatten(treedef, [jnp.asarray(t, jnp.float32) for t in theta]), stats)
        theta = [t - plr * (gi + lam * (t - a) + mu * t) for t, gi, a in zip(theta, leaves(g), w0)]
    w1 = [a - eta * lam * (a - t) for a, t in zip(w0, theta)]
    for got, want in zip(leaves(row["personal"]["params"]), theta):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    for got, want in zip(leaves(row["params"]), w1):
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    assert_trees_close(row["batch_stats"], stats, atol=1e-5)  # two training forward passes at theta
    assert not np.allclose(leaves(row["params"])[0], w0[0])


def test_pfedme_server_mixes_with_beta_and_clients_keep_and_predict_with_theta():
    """Server: w <- (1 - beta) w + beta sum_i p_i w_i, statistics a plain weighted mean; each client keeps only its
    theta_i (and its statistics) and predicts with it."""
    beta = 2.0
    data = make_data(list(COUNTS))
    alg = build_algorithm("pfedme", model(), make_trainer(), beta=beta)
    server, _ = init(alg, data)
    keys = jax.random.split(jax.random.key(9), 4)
    noisy = lambda k, tree: tmap(lambda a: a[None] + jax.random.normal(k, (3,) + a.shape), tree)
    rows = {"params": noisy(keys[0], server["params"]), "batch_stats": noisy(keys[1], server["batch_stats"]),
            "personal": {"params": noisy(keys[2], server["params"]),
                         "batch_stats": noisy(keys[3], server["batch_stats"])}}
    weights = jnp.array(COUNTS, jnp.float32)
    new, kept = jax.jit(alg.aggregate)(server, rows, weights, info(0, [0, 1, 2]))
    p = np.array(COUNTS, np.float64) / sum(COUNTS)
    for got, old, tr in zip(leaves(new["params"]), leaves(server["params"]), leaves(rows["params"])):
        np.testing.assert_allclose(got, (1 - beta) * old + beta * np.tensordot(p, tr, 1), atol=1e-5, rtol=1e-5)
    for got, tr in zip(leaves(new["batch_stats"]), leaves(rows["batch_stats"])):
        np.testing.assert_allclose(got, np.tensordot(p, tr, 1), atol=1e-6, rtol=1e-5)
    assert set(kept) == {"personal"}  # a client keeps only its personalized model
    assert_trees_close(kept["personal"], rows["personal"], atol=0, rtol=0)
    x, predict = batch(data, 0, 5)[0], jax.jit(alg.predict)
    stats = server["batch_stats"]
    for i in range(3):  # each client predicts with its own theta_i (and the statistics it kept)
        client = {"personal": {"params": tmap(lambda a: a[i], rows["personal"]["params"]), "batch_stats": stats}}
        expect = apply(client["personal"], x)
        np.testing.assert_allclose(predict(new, client, x, i), expect, atol=1e-6)
        assert not np.allclose(expect, apply(new, x), atol=1e-3)


# ---------------------------------------------------------------------------------------------------- pFedHN

HN = dict(embed_dim=3, hyper_hidden=8, hyper_layers=1)


def hn_setup(**opts):
    data = make_data(list(COUNTS))
    alg = build_algorithm("pfedhn", model(), make_trainer(), RunContext(num_clients=len(COUNTS)), **dict(HN, **opts))
    return alg, data, *init(alg, data)


initial_variables = jax.jit(lambda x: init_variables(model(), make_trainer(), jax.random.key(0), x))


def target_hnet(data):
    params = jax.eval_shape(initial_variables, data.x[0])["params"]
    layout = TargetLayout(params)
    return params, layout, hypernetwork(layout.shapes, 3, 8, 1)


def test_pfedhn_generates_every_parameter_and_identical_embeddings_give_identical_models():
    alg, data, server, clients = hn_setup()
    params, layout, hnet = target_hnet(data)
    stats = initial_variables(data.x[0])["batch_stats"]
    assert_trees_close(clients, {"batch_stats": tmap(lambda a: jnp.stack([a] * len(COUNTS)), stats)}, atol=0, rtol=0)
    hp = server["params"]
    assert set(server) == {"params", "hyper_opt"} and set(hp) == {"hnet", "embeddings"}
    assert hp["embeddings"].shape == (3, 3)
    gen = layout.to_tree(hnet.apply(hp["hnet"], hp["embeddings"][1]))
    assert jax.tree_util.tree_structure(gen) == jax.tree_util.tree_structure(params)
    assert tmap(jnp.shape, gen) == tmap(lambda a: a.shape, params)
    # BN scales start near 1 (head bias + 1), everything else near 0 +- 1/sqrt(hidden)
    assert abs(float(jnp.mean(gen["encoder"]["bn1"]["scale"])) - 1.0) < 0.5
    x, c0, predict = batch(data, 0, 5)[0], tmap(lambda a: a[0], clients), jax.jit(alg.predict)
    expect = apply({"params": gen, "batch_stats": c0["batch_stats"]}, x)
    np.testing.assert_allclose(predict(server, c0, x, 1), expect, atol=1e-6)  # client 1 uses row 1
    assert not np.allclose(predict(server, c0, x, 0), expect, atol=1e-4)
    same = dict(server, params=dict(hp, embeddings=hp["embeddings"].at[2].set(hp["embeddings"][0])))
    np.testing.assert_array_equal(predict(same, c0, x, 0), predict(same, c0, x, 2))


def test_pfedhn_inner_steps_are_clipped_sgd_with_momentum_and_weight_decay():
    """A client of 6 samples (< batch 8): each step sees all of them; 2 steps of clip -> + wd * theta ->
    momentum SGD, by hand."""
    lr, mom, wd, clip = 0.05, 0.9, 0.01, 0.5
    alg, data, server, clients = hn_setup(inner_steps=2, inner_lr=lr, inner_momentum=mom, inner_decay=wd,
                                          grad_clip=clip)
    data = make_data([6, 6, 6])
    row, metrics = jax.jit(alg.local_update)(server, tmap(lambda a: a[1], clients), data.take(1),
                                             jax.random.key(2), info(0, 1))
    assert float(metrics["steps"]) == 2.0 and float(metrics["seen"]) == 12.0
    _, layout, hnet = target_hnet(data)
    theta0 = layout.to_tree(hnet.apply(server["params"]["hnet"], server["params"]["embeddings"][1]))
    treedef = jax.tree_util.tree_structure(theta0)
    x, y, w = batch(data, 1, 6)
    grad = jax.jit(jax.grad(lambda p, s: ce_loss(model())(p, s, x, y, w, None), has_aux=True))
    theta, stats, buf, clipped = leaves(theta0), clients["batch_stats"], None, False
    stats = tmap(lambda a: a[1], stats)
    for _ in range(2):
        g, (stats, _) = grad(jax.tree_util.tree_unflatten(treedef, [jnp.asarray(t, jnp.float32) for t in theta]), stats)
        g = leaves(g)
        norm = np.sqrt(sum(np.sum(gi ** 2) for gi in g))
        clipped |= norm > clip
        g = [gi * min(1.0, clip / norm) + wd * t for gi, t in zip(g, theta)]
        buf = g if buf is None else [mom * b + gi for b, gi in zip(buf, g)]
        theta = [t - lr * b for t, b in zip(theta, buf)]
    assert clipped  # the clipping was exercised
    for got, want in zip(leaves(row["params"]), theta):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    assert_trees_close(row["batch_stats"], stats, atol=1e-5)


def test_pfedhn_server_step_is_the_optimizer_step_on_the_vjp_and_skips_unsampled_rows():
    lr, embed_lr, mom, wd, clip = 0.01, 0.03, 0.9, 1e-3, 1e-3
    alg, data, server, clients = hn_setup(hyper_lr=lr, embed_lr=embed_lr, hyper_momentum=mom, hyper_decay=wd,
                                          grad_clip=clip, inner_steps=3, inner_lr=5.0)
    ids = jnp.array([0, 2])  # client 1 does not take part
    update, aggregate = jax.jit(alg.local_update), jax.jit(alg.aggregate)
    trained = [update(server, tmap(lambda a: a[int(i)], clients), data.take(int(i)), jax.random.key(10 + int(i)),
                      info(0, int(i)))[0] for i in ids]
    stacked = tmap(lambda *a: jnp.stack(a), *trained)
    weights = data.count[ids].astype(jnp.float32)
    new, kept = aggregate(server, stacked, weights, info(0, ids))
    assert_trees_close(kept, {"batch_stats": stacked["batch_stats"]}, atol=0, rtol=0)  # clients keep BN stats only
    # the VJP by hand: generated weights of the cohort, cotangent p_i (theta_i^0 - theta_i^K)
    _, layout, hnet = target_hnet(data)
    fwd = jax.jit(lambda phi, z: [hnet.apply(phi, z[i]) for i in (0, 2)])
    hp = server["params"]
    sent, vjp = jax.vjp(fwd, hp["hnet"], hp["embeddings"])
    p = np.asarray(weights) / float(np.sum(weights))
    cot = [tmap(lambda s, t: p[j] * (s - t), sent[j], layout.to_flat(tmap(lambda a: a[j], stacked["params"])))
           for j in range(2)]
    g_phi, g_z = vjp(cot)
    np.testing.assert_array_equal(g_z[1], 0.0)  # the unsampled row gets no gradient
    assert float(jnp.abs(g_z[0]).sum()) > 0 and float(jnp.abs(g_z[2]).sum()) > 0
    norm = np.sqrt(sum(np.sum(g ** 2) for g in leaves((g_phi, g_z))))
    assert norm > clip
    scale = clip / norm
    # first torch SGD step: momentum buffer = g + wd p, p <- p - lr buffer (embedding table at embed_lr)
    for got, prm, g in zip(leaves(new["params"]["hnet"]), leaves(hp["hnet"]), leaves(g_phi)):
        np.testing.assert_allclose(got, prm - lr * (scale * g + wd * prm), atol=1e-7, rtol=1e-5)
    z0 = np.asarray(hp["embeddings"], np.float64)
    np.testing.assert_allclose(new["params"]["embeddings"], z0 - embed_lr * (scale * np.asarray(g_z) + wd * z0),
                               atol=1e-7, rtol=1e-5)
    # a second step uses the momentum buffer (torch: buf <- mom buf + g)
    new2, _ = aggregate(new, stacked, weights, info(1, ids))
    sent2, vjp2 = jax.vjp(fwd, new["params"]["hnet"], new["params"]["embeddings"])
    cot2 = [tmap(lambda s, t: p[j] * (s - t), sent2[j], layout.to_flat(tmap(lambda a: a[j], stacked["params"])))
            for j in range(2)]
    g2 = leaves(vjp2(cot2))
    scale2 = min(1.0, clip / np.sqrt(sum(np.sum(g ** 2) for g in g2)))
    z1 = np.asarray(new["params"]["embeddings"], np.float64)
    buf = mom * (scale * np.asarray(g_z) + wd * z0) + scale2 * g2[-1] + wd * z1
    np.testing.assert_allclose(new2["params"]["embeddings"], z1 - embed_lr * buf, atol=1e-6, rtol=1e-5)


"""FedPick: reduction to FedBN, what is shared, ablation switches, masks in training vs evaluation."""
import jax
import jax.numpy as jnp
import numpy as np
from conftest import assert_trees_close, bit_identity, run_rounds, setup_algorithm

from jaxfl import ops
from jaxfl.algorithms._common import is_batchnorm
from jaxfl.algorithms.fedpick import PFSM, FedPickNet, FedPickOptions
from jaxfl.core.evaluate import make_evaluate
from jaxfl.models import MLPHead, small_cnn


ROOT = jax.random.key(11)
COUNTS = (24, 17, 9)
W = np.array(COUNTS, float) / sum(COUNTS)


def setup(name="fedpick", **opts):
    opts = dict(dict(tau=1.0), **opts) if name == "fedpick" else opts
    return setup_algorithm(name, small_cnn(num_classes=4, width=4, hidden=(8,)), COUNTS, options=opts)


def run(alg, data, server, clients, rounds=1):
    return run_rounds(alg, data, server, clients, ROOT, rounds)


def leaves_with_paths(tree):
    return [(tuple(str(getattr(k, "key", k)) for k in p), v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


def check_sharing(before, after, trained, kept, shared):
    """Leaves where shared(path) is True are the weighted mean of the clients' trained leaves and are not kept
    by the clients; the others keep the server's initial value (nothing reached the server) and are kept by
    each client as it trained them."""
    kept = dict(leaves_with_paths(kept))
    for (path, b), (_, a), (_, t) in zip(leaves_with_paths(before), leaves_with_paths(after),
                                         leaves_with_paths(trained)):
        if shared(path):
            np.testing.assert_allclose(a, np.tensordot(W, t, 1), rtol=1e-5, atol=1e-6, err_msg=str(path))
            assert path not in kept, path
        else:
            np.testing.assert_array_equal(a, b, err_msg=str(path))
            np.testing.assert_array_equal(kept[path], t, err_msg=str(path))


def check_round(alg, data, server, clients, shared_param, shared_stats):
    s, c, m, t = run_rounds(alg, data, server, clients, ROOT, keep_rows=True)  # (t: this round's trained rows)
    check_sharing(server["params"], s["params"], t["params"], c.get("params", {}), shared_param)
    check_sharing(server["batch_stats"], s["batch_stats"], t["batch_stats"], c.get("batch_stats", {}), shared_stats)
    return s, c, m


def test_without_pfsm_it_is_exactly_fedbn():
    a = run(*setup("fedbn"), rounds=2)
    b = run(*setup("fedpick", use_pfsm=False), rounds=2)
    assert_trees_close(a[0], b[0], atol=0, rtol=0)
    assert_trees_close(a[1]["params"], b[1]["params"], atol=0, rtol=0)
    np.testing.assert_array_equal(a[2]["loss"], b[2]["loss"])


@bit_identity("kept leaves are copied from the trained rows, never computed")
def test_pfsm_and_batchnorm_are_never_averaged():
    s, c, m = check_round(*setup(), lambda p: p[0] != "pfsm" and not is_batchnorm(p), lambda p: False)
    assert np.all(np.isfinite(m["loss"]))
    phi = c["params"]["pfsm"]["phi1"]["linear"]["kernel"]
    assert not np.allclose(phi[0], phi[1])  # each client's mask network trained on its own data


@bit_identity("kept leaves are copied from the trained rows, never computed")
def test_share_bn_and_share_pfsm_flip_exactly_their_leaves():
    check_round(*setup(share_bn=True), lambda p: p[0] != "pfsm", lambda p: p[0] != "pfsm")
    check_round(*setup(share_pfsm=True), lambda p: p[0] == "pfsm" or not is_batchnorm(p), lambda p: p[0] == "pfsm")


def test_lambda_switches_remove_their_terms():
    # lam_ent = 0: the irrelevant head appears in no other term, so it never trains
    alg, data, server, clients = setup(lam_ent=0.0)
    _, c, _ = run(alg, data, server, clients)
    for leaf, init in zip(jax.tree_util.tree_leaves(c["params"]["pfsm"]["head_u"]),
                          jax.tree_util.tree_leaves(clients["params"]["pfsm"]["head_u"])):
        np.testing.assert_array_equal(leaf, init)
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(c["params"]["pfsm"]["head_p"]),
                                                      jax.tree_util.tree_leaves(clients["params"]["pfsm"]["head_p"]))]
    assert any(moved)
    # all lambdas 0: the loss is the global head's CE alone, so the whole PFSM stays at its init
    alg, data, server, clients = setup(lam_lce=0.0, lam_ent=0.0, lam_dis=0.0)
    _, c, _ = run(alg, data, server, clients)
    assert_trees_close(c["params"]["pfsm"], clients["params"]["pfsm"], atol=0, rtol=0)


def _net(hard=True):
    return FedPickNet(small_cnn(4, width=4).encoder, MLPHead((), 4),
                      PFSM(MLPHead((), 4, name="head_p"), MLPHead((), 4, name="head_u"), tau=10.0, hard=hard))


def test_masks_binary_in_training_soft_when_asked_and_noise_free_in_evaluation():
    x = jax.random.normal(jax.random.key(0), (6, 8, 8, 3))
    net = _net()
    v = net.init(jax.random.key(1), x)
    train = lambda net, k: net.apply(v, x, train=True, rngs={"gumbel": jax.random.key(k)}, mutable=["batch_stats"])[0]
    a, b = train(net, 2), train(net, 3)
    assert set(np.unique(a["mask"])) <= {0.0, 1.0} and not np.array_equal(a["mask"], b["mask"])
    assert len(np.unique(np.asarray(a["mask"]).mean(1))) > 1  # masks differ per sample
    soft = train(_net(hard=False), 2)["mask"]
    assert np.any((soft > 0) & (soft < 1) & (np.abs(soft - 0.5) > 1e-3))
    e1 = net.apply(v, x, train=False)
    e2 = net.apply(v, x, train=False, rngs={"gumbel": jax.random.key(9)})
    np.testing.assert_array_equal(e1["mask"], e2["mask"])
    # evaluation mask is 1[z_l >= 0] = 1[sigmoid(z_l / tau) >= 0.5] for any tau
    phi = v["params"]["pfsm"]
    z_l = jax.nn.relu(e1["z"] @ phi["phi1"]["linear"]["kernel"] + phi["phi1"]["linear"]["bias"]) \
        @ phi["phi2"]["linear"]["kernel"] + phi["phi2"]["linear"]["bias"]
    np.testing.assert_array_equal(e1["mask"], (z_l >= 0).astype(np.float32))


def test_prediction_is_the_ensemble_unless_switched_off_and_reports_diagnostics():
    alg, data, server, clients = setup()
    s, c, _ = run(alg, data, server, clients)
    one = jax.tree_util.tree_map(lambda a: a[0], c)
    x = data.x[0, :8] / 255.0 * 2 - 1
    logits, diag = alg.predict(s, one, x)
    assert set(diag) == {"selection_ratio", "sparsity_ratio"} and diag["selection_ratio"].shape == (8,)
    alg_g, *_ = setup(no_ensemble=True)
    logits_g, _ = alg_g.predict(s, one, x)
    assert not np.allclose(logits, logits_g)
    ev = jax.jit(make_evaluate(alg, eval_batch_size=8))(s, c, data)
    assert np.all((ev["selection_ratio"] >= 0) & (ev["selection_ratio"] <= 1))


def test_paper_defaults_per_dataset():
    paper = lambda o: (o.tau, o.lam_lce, o.lam_ent, o.lam_dis)
    assert paper(FedPickOptions.from_dict({}, "digits")) == (10.0, 10.0, 0.001, 10.0)
    assert paper(FedPickOptions.from_dict({}, "pacs")) == (1.0, 1.0, 0.001, 1.0)
    assert paper(FedPickOptions.from_dict({"tau": 2}, "pacs")) == (2.0, 1.0, 0.001, 1.0)  # given values win
    assert paper(FedPickOptions().with_preset(None)) == (10.0, 10.0, 0.001, 10.0)  # the factory's: Digits


def test_kl_reductions_differ_by_exactly_their_factors_and_the_paper_one_is_the_default():
    from jaxfl.algorithms.fedpick import fedpick_objective
    k, b = 4, 6
    a_g, a_p, a_u = jax.random.normal(jax.random.key(0), (3, b, k))
    out, y = {"a_g": a_g, "a_p": a_p, "a_u": a_u}, jnp.array([0, 1, 2, 3, 0, 1])
    w = jnp.array([1.0, 1, 1, 1, 1, 0])  # 5 real samples, one padded
    base = fedpick_objective(out, y, w, 10.0, 0.001, 0.0)
    dis = {r: fedpick_objective(out, y, w, 10.0, 0.001, 10.0, r) - base for r in ("mean", "batchmean", "sum")}
    per_sample = ops.losses.symmetric_kl(a_p, a_g)[:5]  # class sums of the real samples
    np.testing.assert_allclose(dis["mean"], 10.0 * per_sample.mean() / k, rtol=1e-5)
    np.testing.assert_allclose(dis["batchmean"], k * dis["mean"], rtol=1e-5)
    np.testing.assert_allclose(dis["sum"], 5 * dis["batchmean"], rtol=1e-5)
    assert FedPickOptions().kl_reduction == "mean"  # PyTorch's F.kl_div default, which the paper used

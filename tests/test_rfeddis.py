"""RFedDis: model size, what is shared, reduction to FedBN with an evidential head, annealing, prediction and
reliability reporting."""
import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (assert_trees_close, bit_identity, evaluator, make_data, make_trainer, rounding_tolerance,
                      rounds_tolerance, setup_algorithm)

from jaxfl import ops
from jaxfl.algorithms import build_algorithm
from jaxfl.algorithms._averaging import masked_averaging
from jaxfl.algorithms._common import is_batchnorm
from jaxfl.algorithms.rfeddis import RFedDisNet, fused_alpha
from jaxfl.core.evaluate import make_evaluate
from jaxfl.core.step import init_state
from jaxfl.core.trees import count_params
from jaxfl.models import MLPHead, digits_cnn, small_cnn
from jaxfl.run.reliability import predict_proba, reliability_report


ROOT = jax.random.key(5)
T = 4  # the runs' total rounds: the annealing horizon lam(t) = min(1, t / T)


def run_rounds(*args, num_rounds=T, **kw):
    return conftest.run_rounds(*args, num_rounds=num_rounds, **kw)


def trained_rows(*args, **kw):
    return conftest.trained_rows(*args, num_rounds=T, **kw)
COUNTS = (24, 17, 9)
W = np.array(COUNTS, float) / sum(COUNTS)


def model():
    return small_cnn(num_classes=4, width=4, hidden=(8,))


def setup(**opts):
    return setup_algorithm("rfeddis", model(), COUNTS, options=opts)


def paths(tree):
    return [(tuple(str(getattr(k, "key", k)) for k in p), v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_digits_model_has_the_spec_parameter_count():
    m = digits_cnn(10)
    net = RFedDisNet(m.encoder, MLPHead((2048, 512), 10), MLPHead((2048, 512), 10))
    variables = jax.eval_shape(lambda: net.init(jax.random.key(0), jnp.zeros((1, 28, 28, 3))))
    assert count_params(variables["params"]) == 28_125_652  # rfeddis spec 2.1, 28x28x3 input
    out = jax.eval_shape(lambda: net.apply(net.init(jax.random.key(0), jnp.zeros((1, 28, 28, 3))),
                                           jnp.zeros((2, 28, 28, 3))))
    assert out["h_g"].shape == (2, 2048) and out["z_l"].shape == (2, 10)


@pytest.mark.parametrize("share_global_head", [True, False])
@bit_identity("kept leaves are copied from the trained rows, never computed")
def test_encoder_and_global_head_are_averaged_bn_and_local_head_never(share_global_head):
    alg, data, server, clients = setup(share_global_head=share_global_head)
    s, c, m, trained = run_rounds(alg, data, server, clients, ROOT, keep_rows=True)  # (this round's trained rows)
    assert np.all(np.isfinite(m["loss"]))
    shared = lambda p: not is_batchnorm(p) and (p[0] == "encoder" or (p[0] == "head" and share_global_head))
    kept = dict(paths(c["params"]))
    for (path, before), (_, after), (_, rows) in zip(paths(server["params"]), paths(s["params"]),
                                                     paths(trained["params"])):
        if shared(path):
            np.testing.assert_allclose(after, np.tensordot(W, rows, 1), rtol=1e-5, atol=1e-6, err_msg=str(path))
            assert path not in kept, path  # a shared leaf is not stored per client
        else:
            np.testing.assert_array_equal(after, before, err_msg=str(path))
            np.testing.assert_array_equal(kept[path], rows, err_msg=str(path))
    assert_trees_close(s["batch_stats"], server["batch_stats"], atol=0, rtol=0)
    local = c["params"]["local_head"]["fc1"]["linear"]["kernel"]
    assert not np.allclose(local[0], local[1])


def test_without_local_head_and_dis_it_is_fedbn_with_an_evidential_head():
    """Reference written from the formula: L = CE(z) + psi(S) - psi(alpha_y) + lam(t) KL(alpha~), FedBN masks."""
    net = model()
    rounds = 3

    def evidential_loss(params, stats, x, y, w, key, anchor=None, *, info):
        z, updated = net.apply({"params": params, "batch_stats": stats}, x, train=True, mask=w,
                               mutable=["batch_stats"])
        lam = jnp.minimum(1.0, info.round / rounds)
        alpha = jax.nn.softplus(z) + 1.0
        per = ops.losses.cross_entropy(z, y) + ops.evidential.dirichlet_ce(alpha, y) + (
            lam * ops.evidential.kl_to_uniform(ops.evidential.remove_true_evidence(alpha, y)))
        return jnp.sum(w * per) / jnp.maximum(jnp.sum(w), 1.0), (updated["batch_stats"], z)

    trainer = make_trainer()
    ref = masked_averaging("fedbn_edl", net, trainer, share_param=lambda p: not is_batchnorm(p),
                           share_stats=False, loss_uses_info=True, loss=evidential_loss)
    ours = build_algorithm("rfeddis", net, trainer, use_local_head=False, use_dis=False)
    data = make_data(list(COUNTS))
    outs = []
    for alg in (ref, ours):
        server, clients = init_state(alg, jax.random.key(0), data.x[0], len(COUNTS))
        outs.append(run_rounds(alg, data, server, clients, ROOT, rounds, num_rounds=rounds))
    # two programs for the same math: equal up to float32 rounding of the reference's three rounds
    server, clients = init_state(ref, jax.random.key(0), data.x[0], len(COUNTS))
    tol, client_tol, metric_tol = rounds_tolerance(ref, data, server, clients, ROOT, rounds, num_rounds=rounds)
    assert_trees_close(outs[1][0], outs[0][0], atol=tol, rtol=0)
    assert_trees_close(outs[1][1]["params"], outs[0][1]["params"], atol=client_tol["params"], rtol=0)
    np.testing.assert_allclose(outs[1][2]["loss"], outs[0][2]["loss"], atol=metric_tol["loss"], rtol=0)


@bit_identity("in round 0 the annealing weight is 0: the KL and disentanglement terms add exact zeros")
def test_annealing_enters_only_after_the_first_round():
    """In round 0 lam = 0: the KL and L_Dis terms are off, so use_dis makes no difference; later it does. (The two
    settings compile to different programs, which XLA may fuse and round differently: equal up to float32
    rounding of the round, not bit for bit.)"""
    on, off = (run_rounds(*setup(use_dis=flag), ROOT, rounds=2, every_round=True) for flag in (True, False))
    tol = rounds_tolerance(*setup(use_dis=False), ROOT, rounds=1, num_rounds=2)[1]["params"]
    assert_trees_close(on[0][1]["params"], off[0][1]["params"], atol=tol, rtol=0)
    assert not np.allclose(on[1][2]["loss"], off[1][2]["loss"])


def test_fusion_sum_and_head_ce_switches_change_the_loss():
    base = run_rounds(*setup(), ROOT, rounds=1)[2]["loss"]
    for opts in (dict(fusion="sum"), dict(head_ce=False)):
        assert not np.allclose(run_rounds(*setup(**opts), ROOT, rounds=1)[2]["loss"], base), opts
    with pytest.raises(ValueError, match="fusion"):
        setup(fusion="product")


def test_fused_alpha_is_dempster_shafer_or_summed_logits():
    z_g, z_l = jax.random.normal(jax.random.key(1), (2, 5, 4))
    out = {"z_g": z_g, "z_l": z_l}
    np.testing.assert_allclose(fused_alpha(out), ops.evidential.ds_combine(ops.evidential.dirichlet_alpha(z_g),
                                                                           ops.evidential.dirichlet_alpha(z_l)))
    np.testing.assert_allclose(fused_alpha(out, "sum"), ops.evidential.dirichlet_alpha(z_g + z_l))
    np.testing.assert_allclose(fused_alpha({"z_g": z_g}), ops.evidential.dirichlet_alpha(z_g))


def test_prediction_reports_fused_probability_and_uncertainty():
    alg, data, server, clients = setup()
    s, c, _ = run_rounds(alg, data, server, clients, ROOT, rounds=2)
    x = data.x[1, :5]
    probs, u = predict_proba(alg, s, c, 1, x)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    # by hand: alpha_F from client 1's merged variables
    from jaxfl.core.trees import fill
    client = jax.tree_util.tree_map(lambda a: a[1], c)  # its personal leaves; the rest is the server's
    from jaxfl.core.trees import leaf_paths, prune
    personal = jax.tree_util.tree_map(lambda m: not m, alg_masks(s))
    assert leaf_paths(client) == leaf_paths(prune({k: s[k] for k in personal}, personal))
    variables = {k: fill(s[k], client[k]) for k in ("params", "batch_stats")}
    net = RFedDisNet(model().encoder, MLPHead((8,), 4), MLPHead((8,), 4))
    from jaxfl.core.trainer import normalizer
    alpha = fused_alpha(net.apply(variables, normalizer()(x), train=False))
    np.testing.assert_allclose(u, 4.0 / alpha.sum(-1), rtol=1e-5)
    np.testing.assert_allclose(probs, alpha / alpha.sum(-1, keepdims=True), rtol=1e-5)
    ev = jax.jit(make_evaluate(alg, eval_batch_size=8))(s, c, make_data(list(COUNTS), m=24, seed=1))
    assert np.all((ev["uncertainty"] > 0) & (ev["uncertainty"] <= 1))


def alg_masks(server):
    from jaxfl.core.trees import path_mask
    share = lambda p: not is_batchnorm(p) and p[0] in ("encoder", "head")
    return {"params": path_mask(server["params"], share),
            "batch_stats": path_mask(server["batch_stats"], lambda p: False)}


def test_reliability_report_with_no_noise_and_no_shift_is_chance_level_separation():
    alg, data, server, clients = setup()
    s, c, _ = run_rounds(alg, data, server, clients, ROOT, rounds=2)
    test = make_data(list(COUNTS), m=24, seed=1)
    rep = reliability_report(evaluator(alg, test), s, c, jax.random.key(0), noise_sigma=0.0, ood_shift=3)
    # Identical inputs (no noise; a shift by N: each client sees its own inputs): the two samples of
    # uncertainties are one set, so AUROC = 0.5 by symmetry, except that the noisy and shifted passes are other
    # programs than the clean one: float32 rounding may decide a sample's pair with itself (a tie, 0.5, becomes 0
    # or 1), n of the n^2 pairs, so |AUROC - 0.5| <= 0.5 / n for n real test samples.
    n = np.asarray(COUNTS, np.float64)
    for key in ("auroc_noisy", "auroc_other"):
        assert np.all(np.abs(np.asarray(rep[key]) - 0.5) <= 0.5 / n + 1e-12), (key, rep[key])
    evaluate = jax.jit(make_evaluate(alg, eval_batch_size=8))
    clean = jax.jit(lambda s, c: {k: evaluate(s, c, test)[k] for k in ("accuracy", "uncertainty")})
    ev, tol = evaluate(s, c, test), rounding_tolerance(clean, s, c)
    # the noisy pass (a zero noise added) and the report's are other programs than the jitted evaluation: equal up
    # to float32 rounding of it
    np.testing.assert_allclose(rep["uncertainty_noisy"], rep["uncertainty"], atol=tol["uncertainty"], rtol=0)
    np.testing.assert_allclose(rep["accuracy"], ev["accuracy"], atol=tol["accuracy"], rtol=0)
    np.testing.assert_allclose(rep["uncertainty"], ev["uncertainty"], rtol=1e-5)
    assert [len(u) for u in rep["u_clean"]] == list(COUNTS)
    assert all(0 <= e <= 1 for e in rep["ece"])
    noisy = reliability_report(evaluator(alg, test), s, c, jax.random.key(0), noise_sigma=5.0)
    assert not np.allclose(noisy["uncertainty_noisy"], noisy["uncertainty"])

"""Evidential (Dirichlet) functions and Dempster-Shafer fusion against the rfeddis spec's known values."""
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import digamma  # scipy ships with scikit-learn

from jaxfl import ops


def _alpha(key, shape=(6, 5), scale=3.0):
    return ops.evidential.dirichlet_alpha(jax.random.normal(key, shape) * scale)


class EvidentialTest(chex.TestCase):
    def test_alpha_and_opinion_sum_to_one(self):
        a = _alpha(jax.random.key(0))
        assert np.all(a > 1)
        b, u, s = ops.evidential.opinion(a)
        np.testing.assert_allclose(b.sum(-1) + u, 1.0, atol=1e-6)
        np.testing.assert_allclose(u, 5 / a.sum(-1), rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_closed_form_fusion_equals_explicit_dempster_shafer(self):
        a1, a2 = _alpha(jax.random.key(1)), _alpha(jax.random.key(2))
        fused = self.variant(ops.evidential.ds_combine)(a1, a2)
        b, u, _ = ops.evidential.ds_combine_opinions(*ops.evidential.opinion(a1)[:2], *ops.evidential.opinion(a2)[:2])
        s = 5 / u
        np.testing.assert_allclose(fused, b * s[:, None] + 1, rtol=1e-5)
        np.testing.assert_allclose(b.sum(-1) + u, 1.0, atol=1e-6)

    def test_fusion_identity_symmetry_and_uncertainty(self):
        a1, a2 = _alpha(jax.random.key(3)), _alpha(jax.random.key(4))
        vacuous = jnp.ones_like(a1)
        np.testing.assert_array_equal(ops.evidential.ds_combine(a1, vacuous), a1)
        np.testing.assert_allclose(ops.evidential.ds_combine(a1, a2), ops.evidential.ds_combine(a2, a1), rtol=1e-6)
        uf = ops.evidential.uncertainty(ops.evidential.ds_combine(a1, a2))
        assert np.all(uf <= np.minimum(ops.evidential.uncertainty(a1), ops.evidential.uncertainty(a2)) + 1e-7)

    def test_worked_examples_k2(self):
        conflict = ops.evidential.ds_combine(jnp.array([3.0, 1.0]), jnp.array([1.0, 3.0]))
        np.testing.assert_allclose(conflict, [3.0, 3.0])
        b, u, c = ops.evidential.ds_combine_opinions(*ops.evidential.opinion(jnp.array([3.0, 1.0]))[:2],
                                                     *ops.evidential.opinion(jnp.array([1.0, 3.0]))[:2])
        np.testing.assert_allclose(c, 0.25)
        np.testing.assert_allclose(b, [1 / 3, 1 / 3], rtol=1e-6)
        np.testing.assert_allclose(u, 1 / 3, rtol=1e-6)
        agree = ops.evidential.ds_combine(jnp.array([3.0, 1.0]), jnp.array([3.0, 1.0]))
        np.testing.assert_allclose(agree, [7.0, 1.0])
        np.testing.assert_allclose(ops.evidential.uncertainty(agree), 0.25)

    @chex.variants(with_jit=True, without_jit=True)
    def test_dirichlet_ce_known_value_and_monotonicity(self):
        np.testing.assert_allclose(self.variant(ops.evidential.dirichlet_ce)(jnp.array([2.0, 1.0]), jnp.array(0)), 0.5,
                                   rtol=1e-6)
        a = jnp.array([[1.5, 2.0, 3.0]])
        got = ops.evidential.dirichlet_ce(a, jnp.array([2]))
        np.testing.assert_allclose(got, digamma(6.5) - digamma(3.0), rtol=1e-5)
        vals = [float(ops.evidential.dirichlet_ce(jnp.array([ay, 2.0, 2.0]), jnp.array(0))) for ay in (1.5, 3, 10, 1e4)]
        assert all(v > 0 for v in vals) and vals == sorted(vals, reverse=True) and vals[-1] < 1e-3

    @chex.variants(with_jit=True, without_jit=True)
    def test_kl_to_uniform_known_values(self):
        kl = self.variant(ops.evidential.kl_to_uniform)
        np.testing.assert_allclose(kl(jnp.array([2.0, 1.0])), math.log(2) - 0.5, rtol=1e-5)
        np.testing.assert_allclose(kl(jnp.array([1.0, 3.0, 1.0])), 0.625093, rtol=1e-5)
        np.testing.assert_allclose(kl(jnp.ones(4)), 0.0, atol=1e-5)
        assert np.all(kl(_alpha(jax.random.key(5))) > 0)

    def test_true_class_evidence_does_not_reach_the_kl_term(self):
        z = jax.random.normal(jax.random.key(6), (4, 3))
        y = jnp.array([0, 2, 1, 1])
        g = jax.grad(lambda z: jnp.sum(ops.evidential.kl_to_uniform(
            ops.evidential.remove_true_evidence(ops.evidential.dirichlet_alpha(z), y))))(z)
        np.testing.assert_array_equal(np.asarray(g)[np.arange(4), np.asarray(y)], 0.0)
        assert np.all(np.abs(np.asarray(g)[np.arange(4)[:, None], [[1, 2], [0, 1], [0, 2], [0, 2]]]) > 0)

    def test_edl_loss_combines_terms_and_prefers_true_class_evidence(self):
        a = _alpha(jax.random.key(7))
        y = jnp.arange(6) % 5
        lam = 0.3
        np.testing.assert_allclose(
            ops.evidential.edl_loss(a, y, lam),
            ops.evidential.dirichlet_ce(a, y) + lam * ops.evidential.kl_to_uniform(
                ops.evidential.remove_true_evidence(a, y)), rtol=1e-6)
        base = jnp.ones(5)
        assert float(ops.evidential.edl_loss(base.at[1].set(50.0), jnp.array(1), 0.0)) < float(
            ops.evidential.edl_loss(base, jnp.array(1), 0.0))
        assert float(ops.evidential.edl_loss(base.at[2].set(50.0), jnp.array(1), 0.0)) > float(
            ops.evidential.edl_loss(base, jnp.array(1), 0.0))

    def test_annealing_coefficient(self):
        np.testing.assert_allclose([ops.evidential.annealing_coefficient(t, 10) for t in (0, 5, 9, 20)],
                                   [0, 0.5, 0.9, 1.0])

    def test_disentangle_loss_properties_and_vmap(self):
        h1 = jax.random.normal(jax.random.key(8), (4, 16))
        h2 = jax.random.normal(jax.random.key(9), (4, 16))
        np.testing.assert_allclose(ops.evidential.disentangle_loss(h1, h1), 1.0, rtol=1e-6)
        l12 = ops.evidential.disentangle_loss(h1, h2)
        np.testing.assert_allclose(l12, ops.evidential.disentangle_loss(h2, h1), rtol=1e-6)
        assert 0 < float(l12) < 1
        assert float(ops.evidential.disentangle_loss(h1, 3 * h2)) < float(l12)
        # mean over all B*D elements (torch reduction='mean'), not a batch sum
        lp, lq = jax.nn.log_softmax(h1), jax.nn.log_softmax(h2)
        kl = float(jnp.sum(jnp.exp(lp) * (lp - lq)) / h1.size)
        np.testing.assert_allclose(ops.evidential.softmax_kl_mean(h1, h2), kl, rtol=1e-5)
        # padded rows (weight 0) change nothing
        w = jnp.array([1.0, 1.0, 1.0, 1.0, 0.0])
        pad1, pad2 = jnp.concatenate([h1, 9 * h2[:1]]), jnp.concatenate([h2, -9 * h1[:1]])
        np.testing.assert_allclose(ops.evidential.disentangle_loss(pad1, pad2, w), l12, rtol=1e-6)
        # "batchmean" sums the KL over the D features: exp(-D * symmetric mean-all KL)
        sym = float(ops.evidential.softmax_kl_mean(h1, h2) + ops.evidential.softmax_kl_mean(h2, h1))
        np.testing.assert_allclose(ops.evidential.disentangle_loss(h1, h2, reduction="batchmean"), np.exp(-16 * sym),
                                   rtol=1e-5)
        with pytest.raises(ValueError, match="reduction"):
            ops.evidential.disentangle_loss(h1, h2, reduction="sum")
        batched = jax.vmap(ops.evidential.disentangle_loss)(jnp.stack([h1, h2]), jnp.stack([h2, h1]))
        np.testing.assert_allclose(batched, [l12, l12], rtol=1e-6)


def test_blocks_refuse_arguments_that_would_silently_give_nan_or_nonsense():
    alpha, logits = jnp.full((2, 3), 2.0), jnp.zeros((2, 3))
    for fn in (lambda y: ops.evidential.edl_loss(alpha, y, 0.5), lambda y: ops.evidential.dirichlet_ce(alpha, y),
               lambda y: ops.losses.cross_entropy(logits, y)):
        with pytest.raises(ValueError, match=r"labels must be in \[0, 3\) for 3 classes, got 3"):
            fn(jnp.array([0, 3]))
        with pytest.raises(ValueError, match="got -1"):
            fn(jnp.array([-1, 0]))
        assert jax.jit(fn)(jnp.array([0, 3])).shape == (2,)  # traced labels are not checked (no host sync)
    with pytest.raises(ValueError, match="tau=0 must be > 0"):
        ops.masks.gumbel_sigmoid(logits, None, tau=0)
    with pytest.raises(ValueError, match="tau=-1.0 must be > 0"):
        ops.masks.relaxed_mask(logits, jax.random.key(0), tau=-1.0)
    with pytest.raises(ValueError, match="num_rounds=0 must be > 0"):
        ops.evidential.annealing_coefficient(1, 0)

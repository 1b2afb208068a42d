"""Relaxed masks, top-k / growth masks, channel masks: formulas, known values, jit/vmap/grad."""
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxfl import ops


class RelaxedMaskTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_forward_is_binary_and_equals_threshold_of_soft(self):
        z = jax.random.normal(jax.random.key(0), (64, 16)) * 3
        key = jax.random.key(1)
        m = self.variant(lambda z, k: ops.masks.relaxed_mask(z, k, tau=10.0))(z, key)
        soft = ops.masks.gumbel_sigmoid(z, key, tau=10.0)
        assert set(np.unique(np.asarray(m))) <= {0.0, 1.0}
        np.testing.assert_array_equal(np.asarray(m), np.asarray(soft >= 0.5, np.float32))

    @chex.variants(with_jit=True, without_jit=True)
    def test_gradient_is_the_sigmoid_gradient(self):
        # d/dz sum(m * c) = c * m_s (1 - m_s) / tau for fixed noise; a missing stop_gradient or a plain
        # hard threshold would give 0 or twice this.
        z = jax.random.normal(jax.random.key(2), (5, 7))
        c = jax.random.normal(jax.random.key(3), (5, 7))
        key, tau = jax.random.key(4), 2.5
        g = self.variant(jax.grad(lambda z: jnp.sum(ops.masks.relaxed_mask(z, key, tau) * c)))(z)
        ms = ops.masks.gumbel_sigmoid(z, key, tau)
        np.testing.assert_allclose(g, c * ms * (1 - ms) / tau, rtol=1e-5, atol=1e-7)

    def test_probability_of_one_is_sigmoid_of_logit_for_any_tau(self):
        z = jnp.array([-2.0, -0.5, 0.0, 1.0, 3.0])
        n = 40000
        for tau in (0.3, 10.0):
            keys = jax.random.split(jax.random.key(5), n)
            m = jax.vmap(lambda k: ops.masks.relaxed_mask(z, k, tau))(keys)
            p = np.asarray(m.mean(0))
            np.testing.assert_allclose(p, jax.nn.sigmoid(z), atol=4 / math.sqrt(n))  # ~ 8 sigma

    def test_logistic_noise_moments_and_finiteness(self):
        l = ops.masks.logistic_noise(jax.random.key(6), (200000,))
        assert np.all(np.isfinite(l))
        assert abs(float(l.mean())) < 0.02
        np.testing.assert_allclose(float(l.var()), math.pi ** 2 / 3, rtol=0.03)

    def test_eval_mask_is_deterministic_step_at_zero(self):
        z = jnp.array([-1e-3, 0.0, 1e-3, 5.0, -5.0])
        for tau in (0.1, 1.0, 10.0):
            np.testing.assert_array_equal(ops.masks.relaxed_mask(z, None, tau), [0, 1, 1, 1, 0])

    def test_soft_variant_and_feature_split(self):
        z = jax.random.normal(jax.random.key(7), (4, 6))
        key = jax.random.key(8)
        soft = ops.masks.relaxed_mask(z, key, 1.0, hard=False)
        np.testing.assert_array_equal(soft, ops.masks.gumbel_sigmoid(z, key, 1.0))
        feats = jax.random.normal(jax.random.key(9), (4, 6))
        zp, zu = ops.masks.split_features(feats, soft)
        np.testing.assert_allclose(zp + zu, feats, rtol=1e-6)
        zp, zu = ops.masks.split_features(feats, jnp.ones_like(feats))
        np.testing.assert_array_equal(zp, feats)
        np.testing.assert_array_equal(zu, 0 * feats)

    def test_vmap_over_clients_gives_independent_noise(self):
        z = jnp.zeros((3, 100))
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(3))
        m = jax.vmap(lambda z, k: ops.masks.relaxed_mask(z, k))(z, keys)
        assert not np.array_equal(m[0], m[1])
        np.testing.assert_array_equal(m[1], ops.masks.relaxed_mask(z[1], keys[1]))


class TopkAndGrowthTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_topk_known_values_and_ties(self):
        s = jnp.array([[3.0, 1.0], [3.0, 7.0]])
        np.testing.assert_array_equal(self.variant(ops.masks.topk_mask)(s, 2), [[True, False], [False, True]])
        np.testing.assert_array_equal(self.variant(ops.masks.topk_mask)(s, 0), np.zeros((2, 2), bool))

    @chex.variants(with_jit=True, without_jit=True)
    def test_grow_adds_exactly_the_largest_global_deltas(self):
        rng = np.random.default_rng(0)
        n = 40
        mask = jnp.asarray(rng.random(n) < 0.3)
        delta = jnp.asarray(rng.random(n).astype(np.float32) + np.arange(n) * 1e-3)
        new = self.variant(ops.masks.grow_mask)(mask, delta, 0.25, 0.8)
        n_g = int((~mask).sum())
        added = np.asarray(new & ~mask)
        assert added.sum() == n_g - round(0.75 * n_g)
        glob = np.asarray(~mask)
        assert np.abs(delta)[added].min() >= np.abs(delta)[glob & ~added].max()
        assert np.all(np.asarray(new)[np.asarray(mask)])  # monotone: personal never reverts

    @chex.variants(with_jit=True, without_jit=True)
    def test_kth_smallest_equals_sorting(self):
        rng = np.random.default_rng(1)
        v = np.abs(rng.standard_normal(300)).astype(np.float32)
        v[:20] = v[20:40]  # ties
        v[40:45] = 0.0
        v[45] = np.inf
        valid = rng.random(300) < 0.6
        ref = np.sort(v[valid])
        fn = self.variant(ops.masks.kth_smallest_nonneg)
        for k in (0, 1, 7, 100, valid.sum() - 1):
            assert fn(jnp.asarray(v), jnp.asarray(valid), k) == ref[k], k

    def test_kth_smallest_vmaps_with_per_client_k(self):
        v = jax.random.uniform(jax.random.key(0), (4, 50))
        valid = jax.random.uniform(jax.random.key(1), (4, 50)) < 0.5
        k = jnp.array([0, 3, 5, 10])
        got = jax.vmap(ops.masks.kth_smallest_nonneg)(v, valid, k)
        want = [np.sort(np.asarray(v[i])[np.asarray(valid[i])])[int(k[i])] for i in range(4)]
        np.testing.assert_array_equal(got, want)

    def test_grow_equals_the_sort_rule(self):
        # the cut of the formula: sort(where(personal, -inf, |delta|))[n_p + round((1 - p) n_g)]
        rng = np.random.default_rng(2)
        for trial in range(6):  # personal fraction 0 .. ~1, past the limit 0.8
            mask = rng.random(200) < 0.2 * trial
            delta = np.round(rng.standard_normal(200), 1).astype(np.float32)  # many ties
            n_p, n_g = mask.sum(), (~mask).sum()
            idx = int(np.round(0.75 * n_g))
            cut = np.sort(np.where(mask, -np.inf, np.abs(delta)))[min(n_p + idx, 199)]
            want = mask | ((n_p <= 0.8 * 200) & (idx < n_g) & ~mask & (np.abs(delta) >= cut))
            np.testing.assert_array_equal(ops.masks.grow_mask(jnp.asarray(mask), jnp.asarray(delta), 0.25, 0.8), want)

    def test_grow_limit_and_edge_cases(self):
        mask = jnp.array([True] * 9 + [False])
        d = jnp.arange(10.0)
        np.testing.assert_array_equal(ops.masks.grow_mask(mask, d, 0.25, 0.8), mask)  # 0.9 > limit: frozen
        np.testing.assert_array_equal(ops.masks.grow_mask(jnp.zeros(8, bool), d[:8], 0.25, 0.0), np.zeros(8, bool))
        # rate * n_g rounds to 0 -> nothing selected
        np.testing.assert_array_equal(ops.masks.grow_mask(jnp.zeros(3, bool), d[:3], 0.1, 0.8), np.zeros(3, bool))
        np.testing.assert_array_equal(ops.masks.grow_mask(jnp.ones(3, bool), d[:3], 0.5, 1.0), np.ones(3, bool))

    def test_growth_schedule_follows_one_minus_one_minus_p_to_the_k(self):
        key = jax.random.key(0)
        mask = jnp.zeros((100, 100), bool)
        fracs = []
        for k in range(8):
            mask = ops.masks.grow_mask(mask, jax.random.normal(jax.random.fold_in(key, k), mask.shape), 0.25, 0.8)
            fracs.append(float(mask.mean()))
        expected = [1 - 0.75 ** (k + 1) for k in range(6)]
        np.testing.assert_allclose(fracs[:6], expected, atol=2e-4)
        assert fracs[6] == fracs[5] == fracs[7]  # 0.822 > 0.8: frozen

    def test_tree_grow_respects_eligibility_and_vmaps_over_clients(self):
        masks = {"kernel": jnp.zeros((3, 4, 5), bool), "bias": jnp.zeros((3, 5), bool)}
        params = {"kernel": jax.random.normal(jax.random.key(1), (3, 4, 5)), "bias": jnp.ones((3, 5))}
        ref = jax.tree_util.tree_map(jnp.zeros_like, params)
        fn = jax.vmap(lambda m, p, r: ops.masks.tree_grow_mask(m, p, r, 0.5, 0.8, {"kernel": True, "bias": False}))
        new = fn(masks, params, ref)
        assert not new["bias"].any()
        np.testing.assert_array_equal(new["kernel"].sum((1, 2)), [10, 10, 10])
        np.testing.assert_array_equal(new["kernel"][1],
                                      ops.masks.grow_mask(masks["kernel"][1], params["kernel"][1], 0.5, 0.8))


class ChannelMaskTest(chex.TestCase):
    def setUp(self):
        super().setUp()
        self.kernel = jax.random.normal(jax.random.key(0), (3, 3, 64, 128))

    @chex.variants(with_jit=True, without_jit=True)
    def test_kept_counts_match_round_half_even(self):
        for rho, kept_in, kept_out in [(0.0, 64, 128), (0.2, 51, 102), (0.4, 38, 77), (0.6, 26, 51),
                                       (0.8, 13, 26)]:
            m = self.variant(ops.masks.in_out_channel_mask)(self.kernel, rho)
            assert int(m[0, 0].any(1).sum()) == kept_in and int(m[0, 0].any(0).sum()) == kept_out
            np.testing.assert_allclose(float(m.mean()), kept_in * kept_out / (64 * 128), rtol=1e-6)

    def test_kept_channels_have_the_largest_scores(self):
        for ord_ in (1, 2):
            m = ops.masks.channel_mask(self.kernel, 0.3, axis=-1, ord=ord_)
            s = np.asarray(ops.masks.channel_scores(self.kernel, -1, ord_))
            keep = np.asarray(m[0, 0, 0]).astype(bool)
            assert s[keep].min() >= s[~keep].max()
        l1 = np.abs(np.asarray(self.kernel)).sum((0, 1, 2))
        np.testing.assert_allclose(ops.masks.channel_scores(self.kernel, -1, 1), l1, rtol=1e-5)

    def test_output_channels_are_scored_on_the_input_masked_kernel(self):
        # the released DapperFL code prunes dim 1 (in) and then dim 0 (out) with torch's ln_structured, whose
        # second call scores the already-masked weight (checked against torch 2.x: 200 of 200 random kernels)
        k = np.asarray(self.kernel)
        rho = 0.6
        m = np.asarray(ops.masks.in_out_channel_mask(self.kernel, rho))
        keep_in = np.argsort(-np.abs(k).sum((0, 1, 3)), kind="stable")[:64 - round(rho * 64)]
        in_mask = np.zeros(64, bool)
        in_mask[keep_in] = True
        seq_scores = np.abs(k * in_mask[:, None]).sum((0, 1, 2))
        keep_out = np.zeros(128, bool)
        keep_out[np.argsort(-seq_scores, kind="stable")[:128 - round(rho * 128)]] = True
        np.testing.assert_array_equal(m[0, 0], np.outer(in_mask, keep_out))
        # scoring the outputs on the unmasked kernel would keep other channels here
        independent = np.asarray(ops.masks.channel_mask(self.kernel, rho, axis=-1))[0, 0, 0].astype(bool)
        assert not np.array_equal(independent, keep_out)

    def test_vmapped_per_client_ratio_equals_unvmapped(self):
        kernels = jnp.stack([self.kernel, 2 * self.kernel + 1])
        rhos = jnp.array([0.2, 0.6])
        m = jax.vmap(ops.masks.in_out_channel_mask)(kernels, rhos)
        for c in range(2):
            np.testing.assert_array_equal(m[c], ops.masks.in_out_channel_mask(kernels[c], float(rhos[c])))

    def test_magnitude_mask_and_counting(self):
        g = jnp.array([0.5, -0.1, 0.3, -2.0, 0.0])
        m = ops.masks.magnitude_mask(g, 0.4)  # prune round(2.0) = 2 smallest |g|: 0.0 and -0.1
        np.testing.assert_array_equal(m, [1, 0, 1, 1, 0])
        # exact ties (BN scales at 1.0 after a step): the lower index is kept, the higher ones pruned first
        tied = jnp.array([1.0, 0.5, 1.0, 1.0, 2.0])
        np.testing.assert_array_equal(ops.masks.magnitude_mask(tied, 0.4), [1, 0, 1, 0, 1])
        np.testing.assert_array_equal(ops.masks.magnitude_mask(tied, 0.6), [1, 0, 0, 0, 1])
        tree = {"a": m, "b": jnp.ones((2, 5))}
        assert int(ops.masks.tree_count(tree)) == 13 and ops.masks.tree_size(tree) == 15
        np.testing.assert_allclose(float(ops.masks.tree_density(tree)), 13 / 15)
        np.testing.assert_allclose(float(ops.masks.leaf_density(tree)["a"]), 0.6)


def test_integer_logits_give_the_float_mask():
    key = jax.random.key(3)
    z = jnp.array([[-2, 0, 3]])
    soft = ops.masks.gumbel_sigmoid(z, key, 2.0)
    np.testing.assert_array_equal(soft, ops.masks.gumbel_sigmoid(z.astype(jnp.float32), key, 2.0))
    assert soft.dtype == jnp.float32 and ops.masks.relaxed_mask(z, key).dtype == jnp.float32

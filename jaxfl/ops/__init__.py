"""jaxfl's pure building blocks: ``from jaxfl import ops``.

Plain functions of arrays (no Flax state, no globals, randomness only from explicit keys); each has a
docstring with its formula and shapes and works under ``jit``, ``vmap`` and ``grad``. One module per concept:

masks        relaxed feature masks (FedPick): logistic_noise, gumbel_sigmoid, hard_threshold, straight_through,
             relaxed_mask, split_features; masks over parameters: topk_mask, descending_rank,
             kth_smallest_nonneg, grow_mask, tree_grow_mask (FedSelect); channel_scores, channel_mask,
             in_out_channel_mask, magnitude_mask, keep_largest, num_pruned (DapperFL); tree_count, tree_size,
             tree_density, leaf_density
losses       cross_entropy, weighted_mean_loss, correct_count, kl_divergence, symmetric_kl, reduce_kl,
             negative_entropy, feature_norm; cosine_similarity, model_contrastive_loss (MOON); class_counts,
             class_log_prior, balanced_softmax_ce (FedRoD); logit_calibration (FedLC); gaussian_cmi_bound
             (FedSR); prototype_contrastive_loss (FPL); soft_target_ce, gaussian_mmd, adaptive_bandwidths,
             multi_kernel_mmd, joint_sq_distances (FedPHP, FedCP); cosine_ce (GPFL)
evidential   (RFedDis) evidence, dirichlet_alpha, opinion, uncertainty, expected_probability, ds_combine,
             ds_combine_opinions, dirichlet_ce, remove_true_evidence, kl_to_uniform, edl_loss,
             annealing_coefficient, softmax_kl_mean, disentangle_loss
hypernet     (FedTP, pFedHN) hypernetwork (-> Hypernet(init, apply)), init_embeddings, generate, hypernet_grads
             (the VJP update), hypernet_surrogate_loss
gp           (pFedGP) polya_gamma_sample, polya_gamma_mean, expected_log_sigmoid, rbf_kernel, masked_prior,
             gibbs_omega, predictive, class_zero_probability
qp           (FedPAC) simplex_projection, simplex_qp, head_weights
dense        small networks beside the model (FedCP's policy, GPFL's valve): dense_init, dense, layer_norm_init,
             layer_norm
clustering   (FPL) finch_partition, cluster_prototypes
robust       Byzantine-robust aggregation over the client axis, masked: kth_smallest, kth_largest_near_top,
             coordinate_median, trimmed_mean, pairwise_sq_distances, krum_scores, multi_krum, bulyan,
             geometric_median, norm_bounded_mean, centered_clip, tree_robust
robust_aggregation  one of them in place of an averaging algorithm's mean (``--aggregator``): parse_aggregator,
             robust_rule, robust_params, with_robust_aggregate
attacks      malicious clients (``--attack``, ``--malicious``): parse_attack, malicious_clients, flip_labels,
             alie_z, attacked_updates (sign flip, scaling, Gaussian, ALIE, IPM), with_update_attack
compression  update codecs (``--compression``): topk, randk, stochastic_quantize, qsgd, sign_compress,
             walsh_hadamard, rotated, decode, message_bits, with_compression
augment      training-time image augmentation (``--augment``): random_crop, random_flip, rotate, random_rotation,
             parse_augment, make_augment
diagnostics  expected_calibration_error, auroc, sparsity_ratio, sparsity_per_sample, fisher_score,
             fisher_selection_probe, knn_predict, overlap_ratio, selection_ratio, layer_positions, masked_flops

The aggregation reductions over the client axis (weighted_mean, masked_mean, recovered_mean, tree_* forms)
are the engine's: ``jaxfl.core.aggregation``.
"""
from . import clustering, dense, diagnostics, evidential, gp, hypernet, losses, masks, qp, robust  # noqa: F401
from . import attacks, augment, compression, robust_aggregation  # noqa: F401

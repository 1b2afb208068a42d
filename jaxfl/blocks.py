"""Every pure building block of jaxfl in one namespace: ``from jaxfl import blocks as B``.

Plain functions of arrays (no Flax state, no globals, randomness only from explicit keys); each has a
docstring with its formula and shapes and works under ``jit``, ``vmap`` and ``grad``.

Relaxed masks (FedPick)            logistic_noise, gumbel_sigmoid, hard_threshold, straight_through,
                                   relaxed_mask, split_features
Masks over parameters              topk_mask, descending_rank, kth_smallest_nonneg, grow_mask, tree_grow_mask (FedSelect);
                                   channel_scores, channel_mask, in_out_channel_mask, magnitude_mask,
                                   keep_largest, num_pruned (DapperFL); tree_count, tree_size,
                                   tree_density, leaf_density
Aggregation over the client axis   weighted_mean, masked_mean, recovered_mean, tree_weighted_mean,
                                   tree_masked_mean, tree_where, broadcast_clients; simplex_projection,
                                   simplex_qp, head_weights (FedPAC's classifier combination);
                                   finch_partition, cluster_prototypes (FPL's clustered prototypes)
Hypernetwork (FedTP)               hypernetwork (-> Hypernet(init, apply)), init_embeddings, generate,
                                   hypernet_grads (VJP update), hypernet_surrogate_loss
Evidential learning (RFedDis)      evidence, dirichlet_alpha, opinion, uncertainty, expected_probability,
                                   ds_combine, ds_combine_opinions, dirichlet_ce, remove_true_evidence,
                                   kl_to_uniform, edl_loss, annealing_coefficient, softmax_kl_mean,
                                   disentangle_loss
Gaussian processes (pFedGP)        polya_gamma_sample, polya_gamma_mean, expected_log_sigmoid, rbf_kernel,
                                   masked_prior, gibbs_omega, gp_predictive, class_zero_probability
Losses                             cross_entropy, weighted_mean_loss, correct_count, kl_divergence,
                                   symmetric_kl, reduce_kl, negative_entropy, feature_norm;
                                   cosine_similarity, model_contrastive_loss (MOON); class_log_prior,
                                   balanced_softmax_ce (FedRoD); gaussian_cmi_bound (FedSR);
                                   prototype_contrastive_loss (FPL)
Metrics                            expected_calibration_error, auroc, sparsity_ratio, fisher_score,
                                   fisher_selection_probe, knn_predict,
                                   overlap_ratio, selection_ratio, sparsity_per_sample, count_params, layer_positions,
                                   masked_flops
"""
from .aggregation import (broadcast_clients, cluster_prototypes, finch_partition, head_weights, masked_mean,
                          recovered_mean, simplex_projection, simplex_qp, tree_masked_mean, tree_weighted_mean,
                          tree_where, weighted_mean)
from .evidential import (annealing_coefficient, dirichlet_alpha, dirichlet_ce, disentangle_loss, ds_combine,
                         ds_combine_opinions, edl_loss, evidence, expected_probability, kl_to_uniform, opinion,
                         remove_true_evidence, softmax_kl_mean, uncertainty)
from .gp import (class_zero_probability, expected_log_sigmoid, gibbs_omega, masked_prior, polya_gamma_mean,
                 polya_gamma_sample, rbf_kernel)
from .gp import predictive as gp_predictive
from .hypernet import (Hypernet, generate, hypernet_grads, hypernet_surrogate_loss, hypernetwork,
                       init_embeddings)
from .losses import (balanced_softmax_ce, class_log_prior, correct_count, cosine_similarity, cross_entropy,
                     feature_norm, gaussian_cmi_bound, kl_divergence, model_contrastive_loss, negative_entropy,
                     prototype_contrastive_loss, reduce_kl, symmetric_kl, weighted_mean_loss)
from .masks import (channel_mask, channel_scores, descending_rank, grow_mask, gumbel_sigmoid, hard_threshold,
                    in_out_channel_mask, keep_largest, kth_smallest_nonneg, leaf_density, logistic_noise, magnitude_mask, num_pruned,
                    relaxed_mask, split_features, straight_through, topk_mask, tree_count, tree_density,
                    tree_grow_mask, tree_size)
from .metrics import (auroc, count_params, expected_calibration_error, fisher_score, fisher_selection_probe,
                      knn_predict, layer_positions,
                      masked_flops, overlap_ratio, selection_ratio, sparsity_per_sample, sparsity_ratio)

__all__ = [name for name in dir() if not name.startswith("_") and name not in {
    "aggregation", "evidential", "gp", "hypernet", "losses", "masks", "metrics"}]

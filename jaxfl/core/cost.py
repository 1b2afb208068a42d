"""What a round costs on each data backend, for choosing between them on an accelerator (host-side, no run).

The two backends trade padding for host work. ``Stacked`` keeps the population on the device and runs the
cohort as one call in which every lane lasts as long as the population's longest client; ``Ragged`` keeps
the data on the host, gathers each bucket's clients there, sends them to the device and runs buckets of
similar lengths. Per round and real sample, stacked computes ``p_s - p_r`` more samples' worth of training
(p = computed / real samples, ``buckets.padded_work``) and ragged moves one sample's input bytes ``b`` across
the host link. With f the training FLOPs per sample, stacked is the cheaper one when

    (p_s - p_r) * f / b  <=  balance,

balance being the device's achieved FLOP/s over the host path's bytes/s (FLOP per byte moved). On one H200
(``benchmarks/RESULTS.md``, sessions 18-19; uint8 images, 788 bytes a sample with its label) the measured
winners put the left side at 34-72 (logreg) and 2,000 (2NN), both won by stacked, against 135,000 (FEMNIST
CNN) and 5 million (character LSTM), both won by ragged. The default balance, 12,500, is that device's
measured ends: 25 TFLOP/s achieved (the character LSTM's stacked round) over 2 GB/s for the ragged backend's
host gathers and transfers (logreg at cohort 1,000: 178 MB in 0.089 s of host time). It is calibrated on that
one GPU and leaves per-bucket dispatch out (which would favour stacked a little more). On a CPU the data never
leaves the host, so the rule does not apply there.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .buckets import padded_work, plan_buckets


ACCELERATOR_BALANCE = 12_500.0  # FLOP per byte: an accelerator's achieved FLOP/s over its host path's bytes/s


def train_flops_per_sample(model, sample_x, batch_size: int, preprocess=lambda x: x) -> float:
    """XLA's FLOP count of one gradient of sum(model(preprocess(x))^2) (train mode) over a batch of
    ``batch_size`` inputs shaped like the rows of ``sample_x``, per sample. Lowered from abstract shapes only:
    nothing is compiled or run."""
    raw = jax.ShapeDtypeStruct((batch_size,) + tuple(sample_x.shape[1:]), sample_x.dtype)
    x = jax.eval_shape(preprocess, raw)
    variables = jax.eval_shape(lambda k, x: model.init(k, x, False), jax.random.key(0), x)
    rest = {k: v for k, v in variables.items() if k != "params"}

    def total(params, rest, x):
        y, _ = model.apply({**rest, "params": params}, x, True, mutable=list(rest),  # (output, updated state)
                           rngs={"dropout": jax.random.key(0)})  # train mode: dropout layers draw
        return jnp.sum(jnp.square(y))  # nonlinear in y, so the backward pass needs the forward one

    cost = jax.jit(jax.grad(total)).lower(variables["params"], rest, x).cost_analysis() or {}
    return float(cost.get("flops", 0.0)) / batch_size


def cohort_padding(counts, batch_size: int, cohort: int, *, strategy: str, chunk_size: int, seed: int = 0):
    """(p_s, p_r): computed / real samples of one epoch of a cohort of ``cohort`` of the population's clients
    (``counts`` [N] samples each; a fixed draw of ``seed``) for the stacked backend (every lane runs the
    population's longest client's steps) and for the ragged one (``plan_buckets`` at this strategy's lanes;
    under ``map`` every client runs its own steps)."""
    counts = np.asarray(counts, np.int64)
    ids = np.sort(np.random.default_rng(seed).choice(len(counts), size=min(cohort, len(counts)), replace=False))
    real = max(int(counts[ids].sum()), 1)
    steps = -(-counts // batch_size)
    if strategy == "map":
        done, _ = padded_work([], counts[ids], batch_size, per_client_trips=True)
        return done / real, done / real
    stacked = len(ids) * int(steps.max(initial=0)) * batch_size / real
    lanes = chunk_size if strategy == "chunked" else len(ids)
    done, _ = padded_work(plan_buckets(steps[ids], max_lanes=lanes), counts[ids], batch_size, per_client_trips=False)
    return stacked, done / real


def stacked_extra_flops_per_byte(stacked_padding: float, ragged_padding: float, flops_per_sample: float,
                                 bytes_per_sample: float) -> float:
    """(p_s - p_r) * f / b: the stacked backend's extra (padded) training FLOPs per input byte that the ragged
    backend sends to the device instead."""
    return (stacked_padding - ragged_padding) * flops_per_sample / max(bytes_per_sample, 1.0)


def stacked_is_cheaper(stacked_padding: float, ragged_padding: float, flops_per_sample: float,
                       bytes_per_sample: float, balance: float = ACCELERATOR_BALANCE) -> bool:
    """Whether, on an accelerator, the stacked backend's padding costs less than the ragged backend's host
    transfers: ``stacked_extra_flops_per_byte(...) <= balance``."""
    return stacked_extra_flops_per_byte(stacked_padding, ragged_padding, flops_per_sample,
                                        bytes_per_sample) <= balance

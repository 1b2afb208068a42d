"""The roofline of timed training: how far a measured rate of useful work is from what the machine can do.

    flops_fraction = s x F / (P 1e9),    bytes_fraction = s x Q / (W 1e9),

s: real (unpadded) training samples per second of the timed work; F, Q: XLA's FLOPs and bytes accessed per
sample of one compiled SGD training step (forward, backward, update) at the run's batch size
(``train_step_cost``); P: the machine's f32 matmul GFLOP/s and W its copy bandwidth in GB/s, both measured on
the machine that runs the benchmark (``matmul_peak_gflops``, ``copy_bandwidth_gbs``). Padded samples are not
useful work, so a runner's fractions fall with its padding. Every benchmark that times training reports both
beside its times.

How to read them: F counts the floating-point operations of XLA's optimized step, so a flops_fraction near 1
means the runner trains at the machine's matmul pace. Q counts every operand read and result written by the
step's operations, whether from a cache or from memory, so bytes_fraction overstates the memory traffic and
can exceed 1 where a step's working set stays in cache (small models and batches on a CPU): it bounds how
memory-bound a runner can be, it does not measure it.
"""
from __future__ import annotations

import functools
import time


def matmul_peak_gflops(sizes=(256, 512, 1024, 2048), reps: int = 5) -> float:
    """The machine's f32 matmul rate measured here: the best GFLOP/s of jitted, warmed-up jnp.dot over sizes."""
    import jax
    import jax.numpy as jnp
    best = 0.0
    for n in sizes:
        a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
        f = jax.jit(jnp.dot)
        jax.block_until_ready(f(a, a))
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(f(a, a))
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t) / 1e9)
    return best


def copy_bandwidth_gbs(mib: int = 256, reps: int = 5) -> float:
    """The machine's memory bandwidth measured here: the best GB/s (bytes read + written) of a jitted, warmed-up
    ``x + 1`` over a float32 array of ``mib`` MiB, too large for any cache."""
    import jax
    import jax.numpy as jnp
    x = jnp.zeros((mib * 2 ** 20 // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(f(x))
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        best = max(best, 2 * x.nbytes / (time.perf_counter() - t) / 1e9)
    return best


@functools.lru_cache(maxsize=None)
def machine_peaks() -> dict:
    """{"matmul_peak_gflops", "copy_bandwidth_gbs"} of this machine, measured once per process."""
    return {"matmul_peak_gflops": matmul_peak_gflops(), "copy_bandwidth_gbs": copy_bandwidth_gbs()}


def train_step_cost(model, sample_x, batch: int, lr: float = 0.1) -> dict:
    """XLA's cost analysis of one compiled SGD train step of ``model`` (cross-entropy; forward, backward,
    update; jaxfl's input scaling) on ``batch`` inputs shaped and typed like the rows of ``sample_x``:
    {"flops", "bytes", "batch", "flops_per_sample", "bytes_per_sample"}. XLA counts a loop's body once, so a
    model with a time loop is counted with it unrolled (``throughput.counting_model``)."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxfl.algorithms._common import ce_loss, init_variables
    from jaxfl.core.trainer import LocalTrainer
    trainer = LocalTrainer(optax.sgd(lr), batch, 1)
    x = jnp.zeros((batch,) + tuple(sample_x.shape[1:]), sample_x.dtype)
    y = jnp.zeros((batch,), jnp.int32)
    v = init_variables(model, trainer, jax.random.key(0), x)
    loss, key = ce_loss(model), jax.random.key(1)  # (the key: dropout's, where the model has it)

    def step(params, stats, x, y):
        g = jax.grad(lambda p: loss(p, stats, trainer.preprocess(x), y, jnp.ones(batch), key)[0])(params)
        return optax.apply_updates(params, trainer.tx.update(g, trainer.tx.init(params), params)[0])

    cost = jax.jit(step).lower(v["params"], v.get("batch_stats", {}), x, y).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops, nbytes = float(cost["flops"]), float(cost["bytes accessed"])
    return {"flops": flops, "bytes": nbytes, "batch": batch,
            "flops_per_sample": flops / batch, "bytes_per_sample": nbytes / batch}


def roofline(samples_per_s: float, cost: dict, peaks: dict) -> dict:
    """The achieved rates of ``samples_per_s`` real training samples a second under ``cost``
    (``train_step_cost``) and their fractions of ``peaks`` (``machine_peaks``): {"gflops_per_s",
    "gbytes_per_s", "flops_fraction", "bytes_fraction"}."""
    gflops = samples_per_s * cost["flops_per_sample"] / 1e9
    gbytes = samples_per_s * cost["bytes_per_sample"] / 1e9
    return {"gflops_per_s": gflops, "gbytes_per_s": gbytes,
            "flops_fraction": gflops / peaks["matmul_peak_gflops"],
            "bytes_fraction": gbytes / peaks["copy_bandwidth_gbs"]}

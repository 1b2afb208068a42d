"""pFedGP's GP step on CPU with OpenBLAS single- vs multi-threaded (why jaxfl sets OPENBLAS_NUM_THREADS=1).

jaxlib's CPU LAPACK kernels split a batch of Cholesky factorizations / triangular solves over XLA's threads;
OpenBLAS threads inside each call then oversubscribe the cores. Each setting runs in a fresh process (OpenBLAS
reads the variable when jax loads it): value and gradient of one pFedGP node objective (``gp.gibbs_omega`` +
``gp.predictive``, 5 Gibbs sweeps, 20 chains) vmapped over ``--clients`` clients of ``--points`` points.

    python benchmarks/gp_blas_threads.py --points 1000 --clients 5 --threads 1,2
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

STEP = """
import time, jaxfl, jax, jax.numpy as jnp
from jaxfl.ops import gp
M, C = {points}, {clients}
z = jax.random.normal(jax.random.key(0), (C, M, 64))
y, valid = jnp.arange(M) % 2 == 0, jnp.ones(M, bool)
def loss(z):
    K = gp.masked_prior(gp.rbf_kernel(z, z), valid)
    omega = gp.gibbs_omega(jax.random.key(1), K, y, valid, 5, 20)
    return jnp.mean(gp.class_zero_probability(*gp.predictive(K, K, jnp.full(M, 8.001), y, valid, omega)))
f = jax.jit(jax.vmap(jax.value_and_grad(loss)))
jax.block_until_ready(f(z))
t = time.perf_counter(); jax.block_until_ready(f(z)); print(time.perf_counter() - t)
"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", type=int, default=1000)
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--threads", default="1,2", help="OPENBLAS_NUM_THREADS values to compare")
    args = p.parse_args(argv)
    print(f"| OPENBLAS_NUM_THREADS | GP step, {args.clients} clients x {args.points} points (s) |\n|---|---|")
    for n in args.threads.split(","):
        env = dict(os.environ, OPENBLAS_NUM_THREADS=n.strip())
        out = subprocess.run([sys.executable, "-c", STEP.format(points=args.points, clients=args.clients)],
                             env=env, capture_output=True, text=True, check=True)
        print(f"| {n.strip()} | {float(out.stdout.split()[-1]):.2f} |", flush=True)


if __name__ == "__main__":
    main()

"""``ClientData``: the padded per-client arrays that the engine trains on (one client, or stacked)."""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class ClientData:
    """Padded client datasets. Stacked: x [N, M, ...], y [N, M], count [N]; one client: x [M, ...], y [M], count [].

    work: None (the default: every client runs all its local epochs), or float [N] / [] in [0, 1]: the share of
    its local epochs a client runs this round (systems heterogeneity, ``cohort.straggler_work``): a local
    training phase of E epochs runs 1 + floor(work (E - 1)) of them (``LocalTrainer.run``).
    """
    x: jax.Array
    y: jax.Array
    count: jax.Array
    work: jax.Array | None = None

    @property
    def num_clients(self) -> int:
        return self.count.shape[0]

    def sample_mask(self):
        """1.0 for real samples, 0.0 for padding: [..., M] (y is [..., M], or [..., M, C] multi-hot)."""
        m = self.y.shape[jnp.ndim(self.count)]
        return (jnp.arange(m) < self.count[..., None]).astype(jnp.float32)

    def take(self, ids) -> "ClientData":
        """The rows ``ids`` of the client axis."""
        return jax.tree_util.tree_map(lambda a: a[ids], self)

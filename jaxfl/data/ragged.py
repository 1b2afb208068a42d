"""Ragged client datasets: every client's samples stored once, flat, with per-client offsets and counts.

Memory grows with the real samples (sum_i n_i), not with clients x the largest client. A round gathers only
its cohort, padded to a length of its choosing (``gather``), as the padded ``ClientData`` the trainer reads.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import DataError
from .clients import ClientData
from .lazy import LazyArray, LazyRows


@dataclasses.dataclass(frozen=True)
class RaggedClients:
    """Host arrays: x [S, ...] and y [S] with client i's samples at rows offsets[i] : offsets[i] + counts[i] (x may
    be a ``lazy.LazyRows``, indexed the same way)."""
    x: np.ndarray | LazyRows
    y: np.ndarray
    offsets: np.ndarray
    counts: np.ndarray

    @classmethod
    def from_clients(cls, clients) -> "RaggedClients":
        """[(x_i [n_i, ...], y_i [n_i] or multi-hot [n_i, C])] -> one flat store (copies each client's arrays once;
        inputs given as ``lazy.LazyArray`` become ``lazy.LazyRows``, read when indexed)."""
        if not clients:
            raise DataError("no clients to store")
        shape = clients[0][0].shape[1:]
        for i, (xi, yi) in enumerate(clients):
            if xi.shape[1:] != shape:
                raise DataError(f"client {i} images have shape {xi.shape[1:]}, client 0 has {shape}")
            if len(xi) != len(yi):
                raise DataError(f"client {i} has {len(xi)} images and {len(yi)} labels")
        counts = np.array([len(y) for _, y in clients], np.int64)
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        if any(isinstance(xi, LazyArray) for xi, _ in clients):  # read when a round or an evaluation uses them
            x = LazyRows([xi for xi, _ in clients], offsets)
        elif counts.sum():
            x = np.concatenate([xi for xi, _ in clients])
        else:
            x = np.zeros((0,) + shape, clients[0][0].dtype)
        # class ids as int32; multi-hot rows [n, C] keep their (small) dtype
        y = np.concatenate([np.asarray(yi, np.int32) if np.ndim(yi) == 1 else np.asarray(yi) for _, yi in clients])
        return cls(x, y, offsets, counts)

    @property
    def num_clients(self) -> int:
        return len(self.counts)

    @property
    def nbytes(self) -> int:
        return self.x.nbytes + self.y.nbytes + self.offsets.nbytes + self.counts.nbytes

    def gather(self, ids, length: int) -> ClientData:
        """The clients ``ids`` (a negative id is an empty row) padded to ``length`` samples: x [k, length, ...],
        y [k, length], count [k] (numpy). Padding repeats the client's first sample (any value: padded rows
        get weight 0 everywhere); a client longer than ``length`` is an error."""
        ids = np.asarray(ids)
        real = ids >= 0
        counts = np.where(real, self.counts[np.maximum(ids, 0)], 0)
        if counts.size and counts.max() > length:
            raise ValueError(f"gather length {length} is shorter than a client's {counts.max()} samples")
        pos = np.arange(length)
        rows = self.offsets[np.maximum(ids, 0)][:, None] + np.where(pos < counts[:, None], pos, 0)
        if not len(self.y):  # nothing to read from
            return ClientData(np.zeros((len(ids), length) + self.x.shape[1:], self.x.dtype),
                              np.zeros((len(ids), length) + self.y.shape[1:], self.y.dtype), counts.astype(np.int32))
        rows = np.minimum(rows, len(self.y) - 1)  # an empty last client points past the end
        return ClientData(self.x[rows], self.y[rows], counts.astype(np.int32))

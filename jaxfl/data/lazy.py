"""Client inputs read from their file when a round or an evaluation needs them, not at load time.

A population whose inputs do not fit in memory (TFF's EMNIST-62 is ~0.5 GB as uint8, FLAIR's 256x256 images
hundreds of GB) still runs: the loader keeps every client's labels (small) and, for its inputs, a ``LazyArray``:
the shape and dtype known from the file's metadata, the values read (and converted: scaled, resized, capped)
each time they are used. ``RaggedClients.from_clients`` stores lazy clients as ``LazyRows``, which a backend
indexes like the flat array it replaces (``x[rows]`` reads only the clients those rows belong to), so a round of
the ``ragged`` or ``streamed`` backend reads its cohort's clients and an evaluation block its block's, nothing
else. The stacked backend, which keeps the whole population on the device, reads every client once
(``np.asarray``).

Checks of the values (NaN, range) run when a client is read, so a bad value deep in a large file ends the run
at its first use with the file's one-line error; shapes, dtypes and label ranges are checked at load time.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np


class _Shaped:
    """What a lazy array knows before it is read: its ``shape`` and ``dtype`` (set by the subclass)."""
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """The bytes the values take once read (nothing is held before)."""
        return math.prod(self.shape) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]


class LazyArray(_Shaped):
    """An array [n, ...] whose values come from ``read()`` (called on each use, nothing cached), with its
    ``shape`` and ``dtype`` known without reading. ``take`` and ``map`` compose lazily; indexing, ``len`` and
    ``np.asarray`` behave as on the array ``read()`` returns."""

    def __init__(self, read: Callable[[], np.ndarray], shape: tuple[int, ...], dtype):
        self._read, self.shape, self.dtype = read, tuple(int(s) for s in shape), np.dtype(dtype)

    def read(self) -> np.ndarray:
        """The values, checked to have the promised shape and dtype."""
        a = np.asarray(self._read())
        if a.shape != self.shape or a.dtype != self.dtype:
            raise ValueError(f"a lazy array read as {a.shape} {a.dtype}, promised {self.shape} {self.dtype}")
        return a

    def __getitem__(self, index):
        return self.read()[index]

    def __array__(self, dtype=None, copy=None):
        a = self.read()
        return a if dtype is None else a.astype(dtype)

    def take(self, rows) -> "LazyArray":
        """Rows ``rows`` (int [m]) of this array, read when used."""
        rows = np.asarray(rows, np.int64)
        return LazyArray(lambda: self.read()[rows], (len(rows),) + self.shape[1:], self.dtype)

    def map(self, fn: Callable[[np.ndarray], np.ndarray]) -> "LazyArray":
        """``fn`` of the values, applied when read; ``fn`` must map [n, ...] to [n, ...'] for every n (its output
        shape and dtype come from applying it to zero rows)."""
        out = fn(np.zeros((0,) + self.shape[1:], self.dtype))
        return LazyArray(lambda: fn(self.read()), (self.shape[0],) + out.shape[1:], out.dtype)


def is_lazy(x) -> bool:
    return isinstance(x, (LazyArray, LazyRows))


def take(x, rows):
    """``x[rows]`` of an array, lazily for a ``LazyArray`` (rows: int [m])."""
    return x.take(rows) if isinstance(x, LazyArray) else x[rows]


def apply(fn: Callable[[np.ndarray], np.ndarray], x):
    """``fn(x)``, lazily for a ``LazyArray`` (``LazyArray.map``)."""
    return x.map(fn) if isinstance(x, LazyArray) else fn(x)


class LazyRows(_Shaped):
    """The flat inputs [S, ...] of ragged clients (client i at rows offsets[i] : offsets[i] + len(parts[i])),
    each part an array or a ``LazyArray``. ``rows[index]`` reads only the parts the index falls in, each once."""

    def __init__(self, parts: list, offsets: np.ndarray):
        self.parts, self.offsets = list(parts), np.asarray(offsets, np.int64)
        self.counts = np.array([len(p) for p in self.parts], np.int64)
        trailing = {tuple(p.shape[1:]) for p in self.parts}
        dtypes = {np.dtype(p.dtype) for p in self.parts}
        if len(trailing) != 1 or len(dtypes) != 1:
            raise ValueError(f"lazy rows of different sample shapes {sorted(trailing)} or dtypes "
                             f"{sorted(map(str, dtypes))}")
        self.shape = (int(self.counts.sum()),) + trailing.pop()
        self.dtype = dtypes.pop()
        self.reads = np.zeros(len(self.parts), np.int64)  # times each part was read (what a run touched)

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, slice):
            index = np.arange(self.shape[0])[index]
        scalar = np.ndim(index) == 0
        rows = np.atleast_1d(np.asarray(index, np.int64))
        if rows.size and (rows.min() < -self.shape[0] or rows.max() >= self.shape[0]):
            raise IndexError(f"row index out of range for {self.shape[0]} rows")
        rows = np.where(rows < 0, rows + self.shape[0], rows)
        flat = rows.reshape(-1)
        out = np.empty((len(flat),) + self.shape[1:], self.dtype)
        owner = np.searchsorted(self.offsets, flat, side="right") - 1
        for part in np.unique(owner):
            sel = owner == part
            values = np.asarray(self.parts[part])
            self.reads[part] += 1
            out[sel] = values[flat[sel] - self.offsets[part]]
        out = out.reshape(rows.shape + self.shape[1:])
        return out[0] if scalar else out

    def __array__(self, dtype=None, copy=None):
        a = self[np.arange(self.shape[0])]
        return a if dtype is None else a.astype(dtype)

"""Image shape conversions done once at load time (numpy in, uint8 numpy out)."""
from __future__ import annotations

import numpy as np

from ..errors import DataError


_LUMA = np.array([0.299, 0.587, 0.114], np.float32)  # ITU-R 601, as PIL's convert("L")


def to_channels(images, channels: int):
    """[N,H,W,C] uint8 -> [N,H,W,channels]: grey is repeated to RGB, RGB goes to grey by 601 luma."""
    c = images.shape[-1]
    if c == channels:
        return images
    if c == 1 and channels == 3:
        return np.repeat(images, 3, axis=-1)
    if c == 3 and channels == 1:
        return np.clip(np.rint(images.astype(np.float32) @ _LUMA), 0, 255).astype(np.uint8)[..., None]
    raise DataError(f"cannot convert images with {c} channels to {channels}; allowed: 1 or 3")


def resize_images(images, size: int, chunk: int = 2048):
    """Bilinear (antialiased) resize of [N,H,W,C] uint8 to [N,size,size,C] uint8, in chunks."""
    if images.shape[1:3] == (size, size):
        return images
    import jax
    import jax.numpy as jnp
    out = []
    for i in range(0, len(images), chunk):
        x = jnp.asarray(images[i:i + chunk], jnp.float32)
        y = jax.image.resize(x, (x.shape[0], size, size, x.shape[-1]), "bilinear", antialias=True)
        out.append(np.asarray(jnp.clip(jnp.rint(y), 0, 255).astype(jnp.uint8)))
    return np.concatenate(out) if out else np.zeros((0, size, size, images.shape[-1]), np.uint8)


def prepare(images, size: int, channels: int):
    """Resize and convert channels: the model's input format."""
    return resize_images(to_channels(images, channels), size)

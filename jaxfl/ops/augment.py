"""Training-time image augmentation: pure functions of (key, a batch of raw images [B, H, W, C]) -> the same
shape and dtype, one random draw per image from ``key``; they run inside the jitted local training
(``LocalTrainer.augment``) on each minibatch before ``preprocess``, so padding and out-of-image pixels are 0 in
the raw image, as torchvision's transforms before ``ToTensor``/``Normalize`` pad them.

random_crop     zero-pad ``pad`` pixels on each side, then a uniformly placed H x W window (RandomCrop(size,
                padding=pad))
random_flip     mirror left-right with probability p (RandomHorizontalFlip(p))
rotate          rotate each image by its angle (radians, counter-clockwise) about the image centre, nearest
                pixel, 0 outside (torchvision's rotate with its defaults: NEAREST, fill 0)
random_rotation an angle uniform in [-degrees, degrees] per image (RandomRotation(degrees))

``AUGMENTATIONS`` names the pipelines of the seed papers' official code (``--augment``): ``crop_flip`` (CIFAR-10
in FedSelect, the digits and Office-Caltech in DapperFL: RandomCrop(32, padding=4) + RandomHorizontalFlip),
``flip_rotate`` (FedPick's and RFedDis's Office/DomainNet: RandomHorizontalFlip + RandomRotation(30)),
``flip``; ``make_augment("crop_flip:pad=2")`` builds one.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from .spec import parse_spec

AUGMENTATIONS = {"none": {}, "flip": {}, "crop_flip": {"pad": 4}, "flip_rotate": {"degrees": 30.0}}
_CHECKS = {"pad": (int, lambda v: 0 <= v <= 64, "an integer in [0, 64]"),
           "degrees": (float, lambda v: 0 <= v <= 180, "a number of degrees in [0, 180]")}


def parse_augment(spec: str) -> tuple[str, dict]:
    """``"NAME"`` or ``"NAME:key=value"`` -> (name, parameters with defaults); ConfigError naming what is wrong
    and what is allowed (``spec.parse_spec``)."""
    return parse_spec(spec, "augment", AUGMENTATIONS, _CHECKS)


def random_crop(key, x, pad: int):
    """Each image zero-padded by ``pad`` on every side, then cropped back to H x W at a uniform offset
    (dy, dx) in [0, 2 pad]^2. x [B, H, W, C] -> [B, H, W, C]."""
    if pad == 0:
        return x
    b, h, w, c = x.shape
    padded = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    offsets = jax.random.randint(key, (b, 2), 0, 2 * pad + 1)
    return jax.vmap(lambda img, o: jax.lax.dynamic_slice(img, (o[0], o[1], 0), (h, w, c)))(padded, offsets)


def random_flip(key, x, p: float = 0.5):
    """Each image mirrored left-right with probability ``p``. x [B, H, W, C] -> [B, H, W, C]."""
    flip = jax.random.bernoulli(key, p, (x.shape[0],))
    return jnp.where(flip[:, None, None, None], x[:, :, ::-1, :], x)


def rotate(x, angles):
    """Image i rotated by ``angles[i]`` radians counter-clockwise about its centre ((H - 1) / 2, (W - 1) / 2):
    output pixel (r, c) takes the input pixel nearest to its preimage, 0 where that falls outside the image.
    x [B, H, W, C], angles [B] -> [B, H, W, C]."""
    b, h, w, c = x.shape
    rows, cols = jnp.meshgrid(jnp.arange(h, dtype=jnp.float32), jnp.arange(w, dtype=jnp.float32), indexing="ij")
    cy, cx = (h - 1) / 2.0, (w - 1) / 2.0

    def one(img, a):
        # (rows grow downwards: a counter-clockwise turn on screen is a clockwise one in (row, col) space)
        cos, sin = jnp.cos(a), jnp.sin(a)
        src_c = cos * (cols - cx) - sin * (rows - cy) + cx
        src_r = sin * (cols - cx) + cos * (rows - cy) + cy
        r, cc = jnp.round(src_r).astype(jnp.int32), jnp.round(src_c).astype(jnp.int32)
        inside = (r >= 0) & (r < h) & (cc >= 0) & (cc < w)
        pixels = img[jnp.clip(r, 0, h - 1), jnp.clip(cc, 0, w - 1)]
        return jnp.where(inside[..., None], pixels, jnp.zeros((), img.dtype))

    return jax.vmap(one)(x, jnp.asarray(angles, jnp.float32))


def random_rotation(key, x, degrees: float):
    """Each image rotated by an angle uniform in [-degrees, degrees] (``rotate``). x [B, H, W, C] -> same."""
    angles = jax.random.uniform(key, (x.shape[0],), minval=-degrees, maxval=degrees) * (math.pi / 180.0)
    return rotate(x, angles)


def make_augment(spec: str) -> Callable | None:
    """The augmentation ``spec`` (``NAME[:key=value]`` of ``AUGMENTATIONS``, ``parse_augment``) as
    ``augment(key, x) -> x``; None for ``none``."""
    name, params = parse_augment(spec)
    if name == "none":
        return None
    if name == "flip":
        return random_flip
    if name == "crop_flip":
        pad = params["pad"]
        return lambda key, x: random_flip(jax.random.fold_in(key, 1), random_crop(jax.random.fold_in(key, 0), x, pad))
    if name == "flip_rotate":
        degrees = params["degrees"]
        return lambda key, x: random_rotation(jax.random.fold_in(key, 1), random_flip(jax.random.fold_in(key, 0), x),
                                              degrees)
    raise AssertionError(name)  # (parse_augment refused any other name)

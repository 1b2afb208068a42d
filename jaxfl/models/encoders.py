"""Encoders (image, text, ViT) and ``Classifier`` (an encoder and a head, parameters grouped as
``{"encoder": ..., "head": ...}`` so that algorithms can share or keep parts by path)."""
from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp

from ..errors import ConfigError

from .layers import (
    Attention,
    BasicBlock,
    BatchNorm,
    Conv,
    Dense,
    LSTMLayer,
    PreActGNBlock,
    adaptive_avg_pool,
    max_pool,
    max_pool2,
)


class DigitsEncoder(nn.Module):
    """FedBN DigitModel feature extractor: 3 x (conv5x5 pad2 - BN - ReLU), max-pool after the first two.

    32x32xC input -> 8x8x128 -> flattened d = 8192 (fedpick spec section 2).
    """
    widths: Sequence[int] = (64, 64, 128)

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        for i, w in enumerate(self.widths):
            x = Conv(w, 5, padding=2, name=f"conv{i + 1}")(x)
            x = nn.relu(BatchNorm(name=f"bn{i + 1}")(x, train, mask))
            if i < 2:
                x = max_pool2(x)
        return x.reshape(x.shape[0], -1)


class SmallEncoder(nn.Module):
    """Tiny conv encoder for tests: conv3x3(width) - BN - ReLU - maxpool2 - flatten."""
    width: int = 8

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        x = Conv(self.width, 3, padding=1, name="conv1")(x)
        x = nn.relu(BatchNorm(name="bn1")(x, train, mask))
        return max_pool2(x).reshape(x.shape[0], -1)


class PlainConvEncoder(nn.Module):
    """BatchNorm-free conv encoder: per entry of ``widths`` a conv(kernel, 'same')-ReLU, 2x2 max-pool after the
    entries listed in ``pool_after`` (indices), then flatten and Dense(hidden)-ReLU.

    fedavg_cnn: McMahan et al.'s CNN; pfl_cnn: a small 2-conv CNN for the cross-device benchmark.
    """
    widths: Sequence[int] = (32, 64)
    kernel: int = 5
    pool_after: Sequence[int] = (0, 1)
    hidden: int = 512
    conv_impl: str = "matmul"

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        for i, w in enumerate(self.widths):
            x = nn.relu(Conv(w, self.kernel, padding=self.kernel // 2, impl=self.conv_impl, name=f"conv{i + 1}")(x))
            if i in self.pool_after:
                x = max_pool2(x)
        return nn.relu(Dense(self.hidden, name="fc")(x.reshape(x.shape[0], -1)))


class DropoutCNNEncoder(nn.Module):
    """The EMNIST CNN of Reddi et al. 2021 ("Adaptive Federated Optimization"), as FedML, FLUTE's FEMNIST
    experiment and pfl-research's CIFAR-10 benchmark define it: conv3x3(32, no padding)-ReLU-conv3x3(64, no
    padding)-ReLU-maxpool2-dropout(0.25)-flatten-Dense(128)-ReLU-dropout(0.5). Dropout draws from the
    ``dropout`` rng in training and is the identity in evaluation."""

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        x = nn.relu(Conv(32, 3, name="conv1")(x))
        x = max_pool2(nn.relu(Conv(64, 3, name="conv2")(x)))
        x = nn.Dropout(0.25, deterministic=not train)(x).reshape(x.shape[0], -1)
        return nn.Dropout(0.5, deterministic=not train)(nn.relu(Dense(128, name="fc")(x)))


class FlattenEncoder(nn.Module):
    """The identity feature map z = flatten(x): logistic regression's encoder (it has no parameters)."""

    def __call__(self, x, train: bool = False, mask=None):
        return x.reshape(x.shape[0], -1)


class BagOfWordsEncoder(nn.Module):
    """Word ids [B, L] -> the normalised bag of words z [B, V]: z_v = (number of tokens with id v) / (number of
    tokens), ids in [0, V) are words, id V is an out-of-vocabulary word (counted in the length, no entry), a
    negative id is padding (not counted). FedOpt's Stack Overflow tag-prediction features (the mean one-hot of
    the post's words over V + 1 ids, its OOV column dropped); no parameters. The words' ids stay compact in
    memory ([n, L] int32 instead of [n, V] floats); the [B, V] vector exists one batch at a time."""
    vocab: int = 10000

    def __call__(self, x, train: bool = False, mask=None):
        ids = x.astype(jnp.int32)
        word = (ids >= 0) & (ids < self.vocab)
        length = jnp.maximum(jnp.sum(ids >= 0, axis=-1, keepdims=True), 1).astype(jnp.float32)
        rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)
        counts = jnp.zeros((ids.shape[0], self.vocab), jnp.float32).at[rows, jnp.clip(ids, 0, self.vocab - 1)].add(
            word.astype(jnp.float32))
        return counts / length


class MLPEncoder(nn.Module):
    """flatten - (Dense(h) - ReLU) for each h in ``hidden``: McMahan et al.'s "2NN" body is (200, 200)."""
    hidden: Sequence[int] = (200, 200)

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        x = x.reshape(x.shape[0], -1)
        for i, h in enumerate(self.hidden):
            x = nn.relu(Dense(h, name=f"fc{i + 1}")(x))
        return x


class BottleneckEncoder(nn.Module):
    """flatten - Dense(h) for each h in ``hidden`` with a sigmoid after each, except the ``linear`` one (the
    bottleneck code): the body of FedOpt's EMNIST autoencoder, (1000, 500, 250, 30, 250, 500, 1000) with the
    30-unit code linear (its head decodes to the 784 pixels). Kernels Glorot-normal, biases 0, as Keras' Dense
    with the model's GlorotNormal initializer."""
    hidden: Sequence[int] = (1000, 500, 250, 30, 250, 500, 1000)
    linear: int = 3

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        x = x.reshape(x.shape[0], -1)
        for i, h in enumerate(self.hidden):
            x = nn.Dense(h, kernel_init=nn.initializers.glorot_normal(), name=f"fc{i + 1}")(x)
            x = x if i == self.linear else nn.sigmoid(x)
        return x


class CharLSTMEncoder(nn.Module):
    """LEAF's Shakespeare model body: token ids x [B, T] -> Embedding(vocab, embed) -> ``layers`` stacked
    LSTMs of ``hidden`` units -> the last time step's hidden state z [B, hidden] (next-character prediction).

    impl="fused" (default): ``LSTMLayer`` (input projections hoisted out of the time loop, a hand-written
    backward); "flax": ``nn.RNN(nn.OptimizedLSTMCell)``. Same parameters, same numbers up to float rounding.
    unroll: time steps per iteration of the loops over time."""
    vocab: int = 80
    embed: int = 8
    hidden: int = 256
    layers: int = 2
    unroll: int = 8
    impl: str = "fused"

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        h = nn.Embed(self.vocab, self.embed, name="embed")(x.astype(jnp.int32))
        for i in range(self.layers):
            if self.impl == "fused":
                h = LSTMLayer(self.hidden, self.unroll, name=f"OptimizedLSTMCell_{i}")(h)
            else:
                h = nn.RNN(nn.OptimizedLSTMCell(self.hidden), unroll=self.unroll, name=f"lstm{i + 1}")(h)
        return h[:, -1]


class WordLSTMEncoder(nn.Module):
    """A word-level LSTM body: token ids x [B, T] -> Embedding(vocab, embed) -> ``layers`` stacked LSTMs of
    ``hidden`` units -> the last time step's hidden state -> Dense(project) (no activation), z [B, project].
    The defaults are the FedOpt Stack Overflow next-word model's (google-research/federated, ``utils/models/
    stackoverflow_models.py``: Embedding 96, LSTM 670, Dense 96)."""
    vocab: int = 10004
    embed: int = 96
    hidden: int = 670
    layers: int = 1
    project: int = 96
    unroll: int = 4

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        h = nn.Embed(self.vocab, self.embed, name="embed")(x.astype(jnp.int32))
        for i in range(self.layers):
            h = LSTMLayer(self.hidden, self.unroll, name="lstm" if i == 0 else f"lstm{i + 1}")(h)
        return nn.Dense(self.project, name="project")(h[:, -1])


class AlexNetEncoder(nn.Module):
    """FedBN's AlexNet with BatchNorm after every conv and dense layer, up to the 4096-d feature (d = 4096).

    conv11x11/s4/p2(64)-BN-ReLU-maxpool3/s2 | conv5x5/p2(192)-BN-ReLU-maxpool3/s2 | conv3x3/p1(384)-BN-ReLU |
    conv3x3/p1(256)-BN-ReLU | conv3x3/p1(256)-BN-ReLU-maxpool3/s2 | adaptive-avgpool 6x6 | flatten (9216) |
    Dense(4096)-BN-ReLU | Dense(4096)-BN-ReLU. On 256x256 input: 63 -> 31 -> 15 -> 7 -> 6. Inputs need at least
    ``MIN_SIDE`` pixels a side: on 63x63 the last pool's input is 3x3 (15 -> 7 -> 3), smaller ones leave it empty.
    """
    hidden: Sequence[int] = (4096, 4096)
    MIN_SIDE = 63

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        if min(x.shape[1:3]) < self.MIN_SIDE:
            raise ConfigError(f"model alexnet_bn needs images of at least {self.MIN_SIDE}x{self.MIN_SIDE} pixels "
                              f"(e.g. --dataset pacs), got {x.shape[1]}x{x.shape[2]}")
        for i, (w, k, s, p, pool) in enumerate([(64, 11, 4, 2, True), (192, 5, 1, 2, True), (384, 3, 1, 1, False),
                                                (256, 3, 1, 1, False), (256, 3, 1, 1, True)]):
            x = Conv(w, k, stride=s, padding=p, name=f"conv{i + 1}")(x)
            x = nn.relu(BatchNorm(name=f"bn{i + 1}")(x, train, mask))
            if pool:
                x = max_pool(x, 3, 2)
        x = adaptive_avg_pool(x, 6).reshape(x.shape[0], -1)
        for j, h in enumerate(self.hidden):
            x = Dense(h, name=f"fc{j + 1}")(x)
            x = nn.relu(BatchNorm(name=f"bn{6 + j}")(x, train, mask))
        return x


class ResNetEncoder(nn.Module):
    """ResNet body up to global average pooling (z in R^512).

    stem="cifar": conv3x3(64, s1) - BN - ReLU (no max-pool; DapperFL's backbone).
    stem="imagenet": conv7x7(64, s2, p3) - BN - ReLU - maxpool3/s2/p1 (torchvision).
    Stages of BasicBlocks, widths 64/128/256/512, strides 1/2/2/2; convs have no bias. ``conv_init``: the
    convolutions' init, PyTorch's default ("torch") or torchvision's ResNet init ("kaiming_fan_out").
    """
    blocks: Sequence[int] = (2, 2, 2, 2)
    stem: str = "cifar"
    widths: Sequence[int] = (64, 128, 256, 512)
    conv_init: str = "torch"

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        if self.stem == "cifar":
            x = Conv(self.widths[0], 3, 1, 1, use_bias=False, init=self.conv_init, name="conv_stem")(x)
            x = nn.relu(BatchNorm(name="bn_stem")(x, train, mask))
        else:
            x = Conv(self.widths[0], 7, 2, 3, use_bias=False, init=self.conv_init, name="conv_stem")(x)
            x = nn.relu(BatchNorm(name="bn_stem")(x, train, mask))
            x = max_pool(x, 3, 2, 1)
        for s, (n, w) in enumerate(zip(self.blocks, self.widths)):
            for b in range(n):
                x = BasicBlock(w, (1 if s == 0 else 2) if b == 0 else 1, self.conv_init,
                               name=f"layer{s + 1}_{b}")(x, train, mask)
        return jnp.mean(x, axis=(1, 2))


class ResNetGNEncoder(nn.Module):
    """The ResNet-18 of Reddi et al.'s FedOpt CIFAR-100 task (google-research/federated,
    ``utils/models/resnet_models.py``: ResNet v2 with GroupNorm, 32 groups): conv7x7(64, s2)-GN-ReLU -
    maxpool3/s2 - stages of 2 pre-activation blocks of widths 64/128/256/512, all at stride 1 (the code never
    passes a stage stride) - GN-ReLU - global average pooling (z in R^512). Deviations: PyTorch's symmetric
    padding (3 and 1) where Keras pads 'same' (2 before, 3 after at stride 2), PyTorch's default
    initialisation, no L2 kernel regulariser."""
    blocks: Sequence[int] = (2, 2, 2, 2)
    widths: Sequence[int] = (64, 128, 256, 512)
    groups: int = 32

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None):
        x = Conv(self.widths[0], 7, 2, 3, use_bias=False, name="conv_stem")(x)
        x = nn.relu(nn.GroupNorm(self.groups, epsilon=1e-3, name="gn_stem")(x))
        x = max_pool(x, 3, 2, 1)
        for s, (n, w) in enumerate(zip(self.blocks, self.widths)):
            for b in range(n):
                x = PreActGNBlock(w, first=s == 0 and b == 0, groups=self.groups, name=f"layer{s + 1}_{b}")(x)
        x = nn.relu(nn.GroupNorm(self.groups, epsilon=1e-3, name="gn_final")(x))
        return jnp.mean(x, axis=(1, 2))


class ViTEncoder(nn.Module):
    """Small pre-norm ViT (FedTP): patches -> Dense(dim) + CLS + learned positions -> depth x
    [x + Attn(LN(x)); x + FF(LN(x))] -> LN(CLS token). Returns [B, dim].

    ``qkv``: optional [depth, dim, 3 * heads * dim_head] attention projections supplied from outside; when
    given, the blocks have no ``qkv`` parameter of their own (``qkv_shape`` gives the shape to generate).
    """
    patch: int = 4
    dim: int = 128
    depth: int = 8
    heads: int = 8
    dim_head: int = 64
    mlp_dim: int = 256
    dropout: float = 0.1

    def qkv_shape(self):
        return (self.depth, self.dim, 3 * self.heads * self.dim_head)

    @nn.compact
    def __call__(self, x, train: bool = False, mask=None, qkv=None):
        b, h, w, c = x.shape
        p = self.patch
        x = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * c)
        x = Dense(self.dim, name="patch_embed")(x)
        cls = self.param("cls", nn.initializers.normal(1.0), (1, 1, self.dim))
        pos = self.param("pos", nn.initializers.normal(1.0), (1, x.shape[1] + 1, self.dim))
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, self.dim)), x], 1) + pos
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        drop = lambda t: nn.Dropout(self.dropout, deterministic=not train)(t)
        for layer in range(self.depth):
            y = nn.LayerNorm(epsilon=1e-5, name=f"ln_attn{layer}")(x)
            x = x + Attention(self.heads, self.dim_head, self.dropout, name=f"attn{layer}")(
                y, train, None if qkv is None else qkv[layer])
            y = nn.LayerNorm(epsilon=1e-5, name=f"ln_ff{layer}")(x)
            y = drop(nn.gelu(Dense(self.mlp_dim, name=f"ff{layer}_1")(y), approximate=False))
            x = x + drop(Dense(self.dim, name=f"ff{layer}_2")(y))
        return nn.LayerNorm(epsilon=1e-5, name="ln_out")(x[:, 0])


class Classifier(nn.Module):
    """An encoder followed by a head: params {"encoder": ..., "head": ...}.

    ``features`` returns the encoder output z; ``__call__`` returns the head's logits on z. Extra keyword
    arguments (e.g. a ViT's ``qkv``) go to the encoder.
    """
    encoder: nn.Module
    head: nn.Module

    def features(self, x, train: bool = False, mask=None, **kw):
        return self.encoder(x, train, mask, **kw)

    def __call__(self, x, train: bool = False, mask=None, **kw):
        return self.head(self.encoder(x, train, mask, **kw), train, mask)

"""The model constructors by name (``MODELS``, ``build_model``): each a ``Classifier`` of an encoder and a head."""
from __future__ import annotations

from typing import Sequence

from ..errors import check_choice
from .encoders import (
    AlexNetEncoder,
    BagOfWordsEncoder,
    BottleneckEncoder,
    CharLSTMEncoder,
    Classifier,
    DigitsEncoder,
    DropoutCNNEncoder,
    FlattenEncoder,
    MLPEncoder,
    PlainConvEncoder,
    ResNetEncoder,
    ResNetGNEncoder,
    SmallEncoder,
    ViTEncoder,
    WordLSTMEncoder,
)
from .layers import MLPHead


def digits_cnn(num_classes: int = 10) -> Classifier:
    """The FedBN digits CNN: DigitsEncoder (d=8192 at 32x32) + Dense(2048)-BN-ReLU-Dense(512)-BN-ReLU-Dense(C)."""
    return Classifier(encoder=DigitsEncoder(), head=MLPHead((2048, 512), num_classes))


def small_cnn(num_classes: int = 10, width: int = 8, hidden: Sequence[int] = ()) -> Classifier:
    """Tiny conv net for tests and quick runs."""
    return Classifier(encoder=SmallEncoder(width), head=MLPHead(tuple(hidden), num_classes))


def fedavg_cnn(num_classes: int = 10) -> Classifier:
    """The FedAvg CNN (McMahan et al. 2017): conv5x5(32)-pool-conv5x5(64)-pool-Dense(512)-Dense(C), no BN;
    1,663,370 parameters on 28x28x1 inputs at C = 10."""
    return Classifier(encoder=PlainConvEncoder((32, 64), 5, (0, 1), 512), head=MLPHead((), num_classes))


def pfl_cnn(num_classes: int = 10) -> Classifier:
    """A small 2-conv CNN for the cross-device workload: conv3x3(32)-conv3x3(64)-pool-Dense(128)-Dense(C)."""
    return Classifier(encoder=PlainConvEncoder((32, 64), 3, (1,), 128), head=MLPHead((), num_classes))


def cnn_dropout(num_classes: int = 10) -> Classifier:
    """Reddi et al.'s EMNIST CNN with dropout (``DropoutCNNEncoder`` + Dense(C)): 1,206,590 parameters on
    28x28x1 inputs at C = 62 (FLUTE's FEMNIST setting), 1,626,442 on 32x32x3 at C = 10 (pfl-research's
    CIFAR-10 benchmark)."""
    return Classifier(encoder=DropoutCNNEncoder(), head=MLPHead((), num_classes))


def logreg(num_classes: int = 10) -> Classifier:
    """Multinomial logistic regression: logits = W flatten(x) + b (7,850 parameters on 28x28 inputs, C = 10)."""
    return Classifier(encoder=FlattenEncoder(), head=MLPHead((), num_classes))


def bow_logreg(num_classes: int = 500, vocab: int = 10000) -> Classifier:
    """FedOpt's Stack Overflow tag-prediction model: logistic regression, logits = W z + b, on the normalised
    bag of words z of ``vocab`` words (``BagOfWordsEncoder``; inputs are word ids [B, L]), one logit per tag,
    trained with the per-tag binary cross-entropy of multi-hot labels (5,000,500 parameters at 500 tags).
    Deviation: the kernel is initialised as torch's Linear (FedOpt's Keras Dense: Glorot uniform)."""
    return Classifier(encoder=BagOfWordsEncoder(vocab), head=MLPHead((), num_classes))


def emnist_ae(num_classes: int = 784) -> Classifier:
    """FedOpt's EMNIST autoencoder (google-research/federated ``utils/models/emnist_ae_models.py``): 784-1000-500-
    250-30-250-500-1000-784, sigmoid after every layer but the 30-unit code, Glorot-normal kernels; the last
    layer's sigmoid is in the loss (``core.metrics.squared_error`` of a reconstruction task), so the model returns
    its pre-sigmoid outputs [B, ``num_classes``] (784: the 28 x 28 pixels). Deviation: the output layer is
    initialised as torch's Linear (``MLPHead``; FedOpt's: Glorot normal like the others)."""
    return Classifier(encoder=BottleneckEncoder(), head=MLPHead((), num_classes))


def mlp_2nn(num_classes: int = 10) -> Classifier:
    """McMahan et al.'s "2NN": 784-200-200-C with ReLU (199,210 parameters at C = 10 on 28x28 inputs)."""
    return Classifier(encoder=MLPEncoder((200, 200)), head=MLPHead((), num_classes))


def femnist_cnn(num_classes: int = 62) -> Classifier:
    """LEAF's FEMNIST CNN: conv5x5(32, 'same')-ReLU-pool-conv5x5(64, 'same')-ReLU-pool-Dense(2048)-ReLU-Dense(C)
    (6,603,710 parameters on 28x28x1 inputs at C = 62)."""
    return Classifier(encoder=PlainConvEncoder((32, 64), 5, (0, 1), 2048), head=MLPHead((), num_classes))


def char_lstm(num_classes: int = 80) -> Classifier:
    """LEAF's Shakespeare next-character model: Embedding(80, 8) - 2 x LSTM(256) - Dense(C); C = the
    vocabulary (80: ``jaxfl.data.text.LEAF_CHARS``). Inputs are token ids [B, T]."""
    return Classifier(encoder=CharLSTMEncoder(vocab=max(num_classes, 80)), head=MLPHead((), num_classes))


def word_lstm(num_classes: int = 10004) -> Classifier:
    """The FedOpt Stack Overflow next-word model: Embedding(V, 96) - LSTM(670) - Dense(96) - Dense(C), V = C
    (the vocabulary, ``jaxfl.data.tff``'s 10,000 words and 4 special tokens). Inputs are token ids [B, T]."""
    return Classifier(encoder=WordLSTMEncoder(vocab=num_classes), head=MLPHead((), num_classes))


def sent_lstm(num_classes: int = 2) -> Classifier:
    """LEAF's Sent140 model: Embedding(10,001, 100) - 2 x LSTM(100) - Dense(128) - Dense(C) over 25 word ids
    (``SENT140_VOCAB`` words and one id for unknown words and padding). Deviation: LEAF feeds 300-d GloVe
    vectors (n_hidden 100 sizes its trained embedding); here the embedding is trained from scratch."""
    from ..data.leaf import SENT140_VOCAB
    return Classifier(encoder=WordLSTMEncoder(vocab=SENT140_VOCAB + 1, embed=100, hidden=100, layers=2,
                                              project=128), head=MLPHead((), num_classes))


def alexnet_bn(num_classes: int = 10) -> Classifier:
    """FedBN's AlexNet-BN: AlexNetEncoder (d = 4096) + Dense(C). 57,063,498 parameters at C = 10."""
    return Classifier(encoder=AlexNetEncoder(), head=MLPHead((), num_classes))


def resnet10(num_classes: int = 10, stem: str = "cifar") -> Classifier:
    """ResNet-10 ([1, 1, 1, 1] basic blocks) + Dense(C): 4,903,242 parameters at C = 10 (cifar stem)."""
    return Classifier(encoder=ResNetEncoder((1, 1, 1, 1), stem), head=MLPHead((), num_classes))


def resnet10_slim(num_classes: int = 10, stem: str = "cifar") -> Classifier:
    """ResNet-10 at a quarter width (16/32/64/128, z in R^128) + Dense(C): a CPU-sized stand-in with the same
    block structure, so DapperFL's pruning rules apply unchanged. 308,826 parameters at C = 10."""
    return Classifier(encoder=ResNetEncoder((1, 1, 1, 1), stem, widths=(16, 32, 64, 128)),
                      head=MLPHead((), num_classes))


def resnet18(num_classes: int = 10, stem: str = "cifar", conv_init: str = "torch") -> Classifier:
    """ResNet-18 ([2, 2, 2, 2]) + Dense(C): 11,173,962 parameters (cifar stem), 11,181,642 (imagenet stem);
    PyTorch's default init (``conv_init="kaiming_fan_out"``: torchvision's)."""
    return Classifier(encoder=ResNetEncoder((2, 2, 2, 2), stem, conv_init=conv_init), head=MLPHead((), num_classes))


def resnet18_gn(num_classes: int = 100) -> Classifier:
    """The FedOpt CIFAR-100 ResNet-18 with GroupNorm (``ResNetGNEncoder``) + Dense(C)."""
    return Classifier(encoder=ResNetGNEncoder(), head=MLPHead((), num_classes))


def resnet18_imagenet(num_classes: int = 10) -> Classifier:
    """torchvision's ResNet-18 as FedSelect's code runs it on 32x32 inputs (``resnet18(stem="imagenet",
    conv_init="kaiming_fan_out")``): its architecture and init (convolutions N(0, 2 / fan_out), BatchNorm
    weight 1 and bias 0), the classifier a fresh Linear layer (PyTorch's default init), as the code replaces it."""
    return resnet18(num_classes, stem="imagenet", conv_init="kaiming_fan_out")


def vit_small(num_classes: int = 10, depth: int = 8, **kw) -> Classifier:
    """FedTP's ViT for 32x32 images: patch 4, dim 128, 8 heads x 64, MLP 256, ``depth`` pre-norm blocks."""
    return Classifier(encoder=ViTEncoder(depth=depth, **kw), head=MLPHead((), num_classes))


def vit_tiny(num_classes: int = 10) -> Classifier:
    """A CPU-sized FedTP ViT: depth 4, dim 64, 4 heads x 32, MLP 128 (same architecture as ``vit_small``)."""
    return vit_small(num_classes, depth=4, dim=64, heads=4, dim_head=32, mlp_dim=128)


MODELS = {"digits_cnn": digits_cnn, "small_cnn": small_cnn, "fedavg_cnn": fedavg_cnn, "pfl_cnn": pfl_cnn,
          "cnn_dropout": cnn_dropout, "alexnet_bn": alexnet_bn, "resnet10": resnet10, "resnet10_slim": resnet10_slim,
          "resnet18": resnet18, "resnet18_gn": resnet18_gn, "resnet18_imagenet": resnet18_imagenet,
          "vit_small": vit_small, "vit_tiny": vit_tiny,
          "logreg": logreg, "mlp_2nn": mlp_2nn, "emnist_ae": emnist_ae, "femnist_cnn": femnist_cnn,
          "char_lstm": char_lstm,
          "word_lstm": word_lstm, "sent_lstm": sent_lstm, "bow_logreg": bow_logreg}


# the models whose inputs are token ids [B, T]; every other one reads images
TEXT_MODELS = ("char_lstm", "word_lstm", "sent_lstm", "bow_logreg")


def build_model(name: str, num_classes: int) -> Classifier:
    """Look up a model by name; unknown names list the valid ones."""
    check_choice("model", name, MODELS)
    return MODELS[name](num_classes=num_classes)

"""Flax models. Every model takes ``(x, train, mask)``: ``mask`` [B] marks real samples, so padded samples
never enter a BatchNorm statistic. Parameters are grouped as ``{"encoder": ..., "head": ...}`` so that
algorithms can share or keep parts by path.

``layers`` (PyTorch-like layers), ``encoders`` (image, text and ViT encoders, ``Classifier``) and ``registry``
(the constructors by name: ``MODELS``, ``build_model``); every public name is importable from here.
"""
from .encoders import (
                       AlexNetEncoder,
                       BagOfWordsEncoder,
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
from .layers import (
                       Attention,
                       BasicBlock,
                       BatchNorm,
                       Conv,
                       Dense,
                       LSTMLayer,
                       MLPHead,
                       PreActGNBlock,
                       adaptive_avg_pool,
                       adaptive_pool_matrix,
                       conv2d_matmul,
                       kaiming_fan_out_init,
                       lstm_recurrence,
                       max_last,
                       max_pool,
                       max_pool2,
                       patch_matmul,
                       torch_bias_init,
                       torch_kernel_init,
)
from .registry import (
                       MODELS,
                       TEXT_MODELS,
                       alexnet_bn,
                       bow_logreg,
                       build_model,
                       char_lstm,
                       cnn_dropout,
                       digits_cnn,
                       fedavg_cnn,
                       femnist_cnn,
                       logreg,
                       mlp_2nn,
                       pfl_cnn,
                       resnet10,
                       resnet10_slim,
                       resnet18,
                       resnet18_gn,
                       resnet18_imagenet,
                       sent_lstm,
                       small_cnn,
                       vit_small,
                       vit_tiny,
                       word_lstm,
)

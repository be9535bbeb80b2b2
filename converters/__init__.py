"""Checkpoint transforms (``state_dict -> state_dict`` on full tensors).

Imported as ``sharded_nn.converters``. Converters arrive with the ViT issue.
"""

from .transolver import thuml_transolver_kwargs, transolver_from_thuml  # noqa: E402,F401

"""Checkpoint transforms (``state_dict -> state_dict`` on full tensors).

Imported as ``sharded_nn.converters``. Converters arrive with the ViT issue.
"""

"""Ready sharded models (ViT, UNet, Transolver): single-device model code plus ``convert``.

Imported as ``sharded_nn.zoo``. Models arrive with the zoo issues.
"""

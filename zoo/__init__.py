"""Ready sharded models (ViT, UNet, Transolver): single-device model code plus ``convert``.

Imported as ``sharded_nn.zoo``. ``create_model(name, mesh=..., **kwargs)`` builds any of them;
each family lives in its own module and registers its names with ``register_model``.
"""

from .factory import create_model, list_models, register_model

__all__ = ["create_model", "list_models", "register_model"]

# Model families register themselves on import; each import line below is owned by its family.
# (vit)
# (unet)
# (transolver)
from . import transolver as _transolver  # noqa: E402,F401

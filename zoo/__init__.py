"""Ready sharded models (ViT, UNet, Transolver, FNO, MeshGraphNet): single-device model code plus ``convert``.

Imported as ``sharded_nn.zoo``. ``create_model(name, mesh=..., **kwargs)`` builds any of them;
each family lives in its own module and registers its names with ``register_model``.
"""

from .factory import create_model, list_models, register_model

__all__ = ["create_model", "list_models", "register_model"]

# Model families register themselves on import; each import line below is owned by its family.
# (vit)
from . import vit as vit  # noqa: E402 - registers the timm family (fallback of create_model)
# (unet)
from .unet import UNet  # noqa: E402

__all__ += ["UNet"]
# (transolver)
from .transolver import Transolver  # noqa: E402

__all__ += ["Transolver"]
# (fno)
from .fno import FNO  # noqa: E402

__all__ += ["FNO"]
# (meshgraphnet)
from .meshgraphnet import MeshGraphNet  # noqa: E402

__all__ += ["MeshGraphNet"]

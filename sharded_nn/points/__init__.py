"""Point clouds: partitioning over the domain ranks and exact neighbour search across parts.

``PointCloudPartition`` splits a cloud into spatially coherent, balanced parts (one per domain
rank) and restores per-point results; ``knn`` / ``radius`` find neighbours among the points of
all ranks (candidate blocks circulate on the domain ring); ``gather_neighbours`` fetches their
features with gradients. Points are on dim -2 everywhere: ``(N, C)`` or ``(B, N, C)``.
"""

from .knn import gather_neighbours, knn, radius, within_radius
from .partition import Ghosts, PointCloudPartition, balanced_sizes

__all__ = ["Ghosts", "PointCloudPartition", "balanced_sizes", "gather_neighbours", "knn", "radius", "within_radius"]

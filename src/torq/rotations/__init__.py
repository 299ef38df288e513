"""TORQ's two rotations (the paper's Section 5.1 inter-block, 5.2 intra-block) and their
structured transform."""

from torq.rotations.angle_search import codebook_occupancy_loss, exact_angle_search

# every saved kind of online transform registered once the package is imported
from torq.rotations.block_transform import BlockMatrices
from torq.rotations.hadamard import hadamard_matrix, has_hadamard
from torq.rotations.inter_block import (
    InterBlockConfig,
    equalize_closed_form,
    equalize_givens,
    inter_block_rotations,
)
from torq.rotations.intra_block import (
    IntraBlockConfig,
    IntraBlockResult,
    fit_intra_block_rotation,
    select_column_pairs,
)
from torq.rotations.transform import BlockRotation

__all__ = [
    "BlockMatrices",
    "BlockRotation",
    "InterBlockConfig",
    "IntraBlockConfig",
    "IntraBlockResult",
    "codebook_occupancy_loss",
    "equalize_closed_form",
    "equalize_givens",
    "exact_angle_search",
    "fit_intra_block_rotation",
    "hadamard_matrix",
    "has_hadamard",
    "inter_block_rotations",
    "select_column_pairs",
]

"""flatgrad: every gradient of a model in one contiguous buffer per (dtype, device)."""

# First (it also sorts first): a torch older than the floor gets one ImportError naming the
# floor before any module reads a torch name (flatgrad/_torch_version.py).
from flatgrad import _torch_version  # noqa: F401
from flatgrad._amp import GradScaler
from flatgrad._comm import FlatGradCommState, allreduce_hook
from flatgrad._config import FlatGradConfig
from flatgrad._flatgrad import FlatGrad
from flatgrad._functional import gather, gather_with_index_add
from flatgrad._parallel import ReplicateModule, ReplicateState, replicate, replicate_state
from flatgrad._sharded import ShardedOptimizer

__all__ = [
    "FlatGrad",
    "FlatGradCommState",
    "FlatGradConfig",
    "GradScaler",
    "ReplicateModule",
    "ReplicateState",
    "ShardedOptimizer",
    "allreduce_hook",
    "gather",
    "gather_with_index_add",
    "replicate",
    "replicate_state",
]
__version__ = "0.1.0"

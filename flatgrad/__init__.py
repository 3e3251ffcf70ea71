"""flatgrad: every gradient of a model in one contiguous buffer per (dtype, device)."""

from flatgrad.config import FlatGradConfig
from flatgrad.functional import gather_with_index_add
from flatgrad.wrapper import FlatGrad

__all__ = ["FlatGrad", "FlatGradConfig", "gather_with_index_add"]
__version__ = "0.1.0"

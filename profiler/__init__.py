"""Per-block FLOPs, memory and time of a model: the ModelProfile the planner consumes."""

from .errors import ProfileError
from .profile import TORCH_DTYPES, default_dtype, profile_for_planning, profile_model
from .records import Collective, LayerProfile, ModelProfile, OpMix, TPView

__all__ = ["Collective", "LayerProfile", "ModelProfile", "OpMix", "ProfileError", "TORCH_DTYPES", "TPView",
           "default_dtype", "profile_for_planning", "profile_model"]

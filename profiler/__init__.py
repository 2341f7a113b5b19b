"""Per-block FLOPs, memory and time of a model: the ModelProfile the planner consumes.

``TORCH_DTYPES`` needs torch and is imported on first use (PEP 562); the rest is torch-free until a
profile has to be measured.
"""

from .api import default_dtype, profile_for_planning, profile_model
from .errors import ProfileError
from .records import Collective, LayerProfile, ModelProfile, OpMix, TPView


def __getattr__(name: str):
    if name == "TORCH_DTYPES":
        from .profile import TORCH_DTYPES

        return TORCH_DTYPES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Collective", "LayerProfile", "ModelProfile", "OpMix", "ProfileError", "TORCH_DTYPES", "TPView",
           "default_dtype", "profile_for_planning", "profile_model"]

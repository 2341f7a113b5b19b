"""The error a user sees when a model cannot be profiled as asked."""


class ProfileError(ValueError):
    """Bad profiling input (absurd micro-batch, unavailable device, a model that fails to run)."""

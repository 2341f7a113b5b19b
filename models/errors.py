"""The error a user sees when a model description is wrong."""


class ModelSpecError(ValueError):
    """A model spec, preset name, HF config or callable that cannot be used, with the reason.

    The message names the source (file or preset) and the field, so the CLI can print it as
    one line.
    """

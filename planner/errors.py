"""Errors of the planner and simulator (calculon's pattern: infeasibility is an error the search counts)."""


class PlanError(ValueError):
    """A layout, plan or request that cannot be used as given (one line, shown to the user)."""


class InvalidLayout(PlanError):
    """A layout that is not valid for this model and cluster (tp not dividing heads, product != GPUs, ...).

    ``reason`` is a short tag the search counts ("tp does not divide heads"), ``str()`` the full line.
    """

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason or message

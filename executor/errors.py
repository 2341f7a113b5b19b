"""The error a user sees when a plan cannot be executed here (shown by the CLI as one line, exit 2)."""


class ExecutionError(ValueError):
    """A plan, launch option or machine that cannot run as asked, with the reason in one line.

    Raised before anything starts (world size larger than the slots, a port in use, an invalid
    plan) and, by the launcher, when a rank dies or hangs (the message names the rank).
    """


class JobFailed(ExecutionError):
    """The job started but a rank died, failed or hung; the message names the rank (exit code 1)."""

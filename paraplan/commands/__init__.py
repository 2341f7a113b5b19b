"""One module per sub-command; each exposes ``run(args) -> exit code``."""

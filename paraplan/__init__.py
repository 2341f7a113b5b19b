"""paraplan: plan, predict and run distributed training (data, tensor and pipeline parallelism)."""

__version__ = "0.1.0"

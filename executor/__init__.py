"""The executor: run a Plan with torch.distributed, on one machine or many (issue 6).

``paraplan execute`` (paraplan/commands/execute.py) checks the plan (job.py, machine.py) and starts
torchrun (launch.py); every rank runs worker.py, which builds its share of the plan in one fixed
order (parallelize.py: parallel_dims, chunks, tensor_parallel, checkpointing, data_parallel,
pipeline, optim, tied) and trains it (trainer.py on batches.py's data), rank 0 reporting
(console.py) and recording the run (record.py). Two layouts build differently: parameter servers
(ps_protocol.py, the protocol; param_server.py, the server ranks; ps_worker.py and ps_client.py, the
workers) and hybrid parallelism's class-sharded classifier (class_sharded.py, hybrid.py); rank_model.py
is what every builder returns. A run as a whole (training.py) reads the user's tokens (token_data.py),
saves and resumes checkpoints (checkpoint_io.py; checkpointing.py is activation checkpointing), starts
from Hugging Face weights (hf_weights.py) and logs per-step metrics (metrics.py). Importing this package
imports no torch.
"""

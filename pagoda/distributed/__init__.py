"""Scale: tensor- and pipeline-parallel worker processes (workers.py, worker.py), the KV
connector between prefill and decode instances (kv_transfer.py); later the Ray Serve app."""

"""Scale: tensor-parallel worker processes (workers.py, worker.py); later KV transfer and the Ray
Serve app."""

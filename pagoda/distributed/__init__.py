"""The ranks below the engine: tensor-, pipeline- and context-parallel worker processes
(workers.py, the engine's side; worker.py, a rank's loop) and the KV connector between prefill and
decode instances (kv_transfer.py). Scale-out past one machine is pagoda/scaleout/."""

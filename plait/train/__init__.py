"""The ``plait train`` program: the per-rank loop (``loop.py``), its TOML configuration (``config.py``), the run
records (``metrics.py``) and fault tolerance (``fault.py``)."""

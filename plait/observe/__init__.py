"""Observability: traces of every rank (``trace.py``, ``trace_summary.py``), pictures of pipeline schedules and
measured pipeline steps (``pipeline_picture.py``), and memory instruments (``memory.py``)."""

"""plait against its torch-native peers, side by side, in one run: ``python -m benchmarks.run``.

- ``workload.py``   the shared model, data, optimizer and seeds (what both contenders of a pair train)
- ``trainer.py``    ``Trainer``/``Contender``/``Probe`` and the helpers peers share (global clipping, gathers)
- ``contenders.py`` the ``Contender`` registry and the ``Suite`` pairs (plait vs the torch-native peer)
- ``model_parallel.py`` the pipeline, tensor and context parallel contenders (and their theoretical bytes)
- ``worker.py``     the timed loop that every rank runs (fresh processes per contender, or alternating blocks)
- ``launch.py``     starts the ranks with torchrun's machinery (``elastic_launch``, standalone rendezvous)
- ``measure.py``    medians, spreads, ratios, theory: one row (a dict) per contender
- ``report.py``     the rich table on the console and the markdown tables of BENCHMARKS.md
- ``run.py``        the command line and ``run_suite(name, world, steps, warmup, rounds)``

Stand-alone comparisons, each with its own command (BENCHMARKS.md): ``muon.py`` (and DeepSpeed's Muon),
``moe.py`` + ``moe_deepspeed.py`` (plait's MoE against DeepSpeed-MoE in its own virtualenv; ep against none),
``recompute.py``, ``checkpoint.py``, ``param_server.py``, ``context_memory.py``, ``gpu.py``, ``data_prepare.py``,
``planner_validation.py``, ``planner_published.py``, ``stragglers.py``, ``semisync.py`` and
``fault_tolerance.py`` (``plait train --ft`` against restart-and-resume, and HSDP as two nodes).
"""

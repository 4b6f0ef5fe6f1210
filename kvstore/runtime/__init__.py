"""The process runtime every kvcluster process shares, and its small utilities.

How a worker's or a router's event loop stays responsive: a frozen start-up heap and short GIL
turns (``pauses.py``), thread time slices and niceness (``threadsched.py``, ``loop_sched.py``),
loop-lag probes and stall traces (``looplag.py``, ``stalltrace.py``); and the utilities every
layer uses: the registry of named implementations (``registry.py``), the strict base of config
models (``strict.py``), records derived by field name (``derive.py``), the quantile rule
(``stats.py``) and the per-machine cache folder (``cache_dir.py``). The lowest layer: it imports
nothing of the project.
"""

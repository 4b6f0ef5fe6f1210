import worker  # noqa: F401 - first, so that OpenMP sleeps rather than spins (worker/cpu_threads.py)

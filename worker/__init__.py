"""The worker: KV block pool, engine, model runner and the Ray actor around them."""

from worker.cpu_threads import apply_wait_policy

# Before anything here imports torch: OpenMP reads its wait policy when it loads.
apply_wait_policy()

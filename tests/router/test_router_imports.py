"""A router imports no engine: torch and the model code cost a joining node's router
seconds before it serves, and a router never runs them."""

import subprocess
import sys


def test_router_and_worker_actor_class_import_without_torch():
    # what a router process loads: its own modules and the worker actor's class, which Ray
    # unpickles on the first ``ray.get_actor`` of a worker
    code = (
        "import sys\n"
        "import router.server, router.http_api, worker.actor, cluster.router_keeper\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"a router process imports {out.stdout.strip()}"

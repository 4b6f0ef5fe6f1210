"""A router imports no engine: torch and the model code cost a joining node's router
seconds of CPU before it serves, and a router never runs them."""

import subprocess
import sys

from worker.model.default_model import resolve_default_model

HEAVY = ("torch", "transformers", "triton")


def heavy_imports(code: str) -> list[str]:
    """The heavy modules a fresh process running ``code`` has imported."""
    probe = f"{code}\nimport sys\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def test_router_and_worker_actor_class_import_without_torch():
    # what a router process loads: its own modules and the worker actor's class, which Ray
    # unpickles on the first ``ray.get_actor`` of a worker
    code = "import router.server, router.http_api, worker.actor, cluster.router_keeper"
    assert heavy_imports(code) == []


def test_a_built_tiny_default_model_resolves_without_torch():
    # a tiny-model cluster's routers resolve the model too: a build already there is found
    # without the builder's torch (the build itself happens here, in this process)
    resolve_default_model("llama")
    code = "from worker.model.default_model import resolve_default_model\n"
    code += "resolve_default_model('llama')"
    assert heavy_imports(code) == []

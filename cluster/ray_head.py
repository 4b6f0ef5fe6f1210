"""A Ray head without its dashboard process, for ``dashboard: false``.

Ray 2.60 starts ``dashboard/dashboard.py`` on every head, whatever ``include_dashboard``
says: without the dashboard it still runs, loading only its usage-stats module, and listens
on a port of its own (``ray.init`` and ``ray start`` have no switch for it). Nothing of
this cluster needs that process (usage stats are off, and workers, routers and the raylet's
agents do not talk to it), so with ``dashboard: false`` the head is started with the step
that launches it (``Node.start_api_server``) skipped: the embedded Ray inside
:func:`no_dashboard_process`, the ``ray start`` head through ``python -m cluster.ray_head``,
which is Ray's own CLI with that step skipped.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


def _skip(self, **_: object) -> None:  # noqa: ANN001 - stands in for Node.start_api_server
    """No dashboard process: the node's dashboard URL stays None."""


@contextmanager
def no_dashboard_process(enabled: bool = True) -> Iterator[None]:
    """Ray heads started in this block (``ray.init`` of a local Ray) get no dashboard
    process; ``enabled=False``: Ray as it is."""
    if not enabled:
        yield
        return
    from ray._private.node import Node

    original = Node.start_api_server
    Node.start_api_server = _skip  # type: ignore[method-assign]
    try:
        yield
    finally:
        Node.start_api_server = original  # type: ignore[method-assign]


def main() -> None:
    """``ray`` (the CLI) with no dashboard process on the heads it starts."""
    from ray.scripts.scripts import main as ray_main

    with no_dashboard_process():
        sys.exit(ray_main())


if __name__ == "__main__":
    main()

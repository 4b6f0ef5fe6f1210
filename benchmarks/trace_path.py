"""Where the replayed traces live, found from any checkout of the repository.

The traces are not in the repository: they sit in ``shared/traces/`` beside it (``/work/main``
and ``/work/shared``). The first of these that applies names the trace:

1. ``$KVCLUSTER_TRACE``: the conversation trace file itself (used as given, found or not);
2. ``$KVCLUSTER_TRACES``: a folder holding the traces (used as given);
3. ``../shared/traces/`` beside this checkout, if the trace is there;
4. ``../shared/traces/`` beside the repository's main worktree (``git rev-parse
   --git-common-dir``), so a ``git worktree`` elsewhere (``/work/wt/<name>``) finds it too.

With none found, :func:`find_trace` names the path of rule 3, for a clear "no trace at" message.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

TRACE_NAME = "conversation_trace.jsonl"  # the Mooncake conversation trace
REPO = Path(__file__).resolve().parents[1]


def _traces_beside(checkout: Path) -> Path:
    return checkout.parent / "shared" / "traces"


def main_worktree(repo: Path) -> Path | None:
    """The main worktree of the git repository ``repo`` is a checkout of (None: not one)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--git-common-dir"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    common = Path(out) if Path(out).is_absolute() else repo / out
    return common.resolve().parent  # the folder holding ``.git``


def find_trace(name: str = TRACE_NAME, repo: Path = REPO) -> Path:
    """The path of trace ``name`` by the rules above (it may not exist)."""
    if name == TRACE_NAME and os.environ.get("KVCLUSTER_TRACE"):
        return Path(os.environ["KVCLUSTER_TRACE"])
    if os.environ.get("KVCLUSTER_TRACES"):
        return Path(os.environ["KVCLUSTER_TRACES"]) / name
    beside = _traces_beside(repo) / name
    if beside.exists():
        return beside
    main = main_worktree(repo)
    if main is not None and (_traces_beside(main) / name).exists():
        return _traces_beside(main) / name
    return beside

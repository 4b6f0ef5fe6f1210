"""Peer pulls: a worker fetches a prompt's cached prefix from another worker instead of
recomputing it (``transport.py``: how the bytes move; ``peer.py``: the actor's calls)."""

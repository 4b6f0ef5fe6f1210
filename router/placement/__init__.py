"""Where a request goes: routing policies, the prefix sources they read, the router's own
recent placements, the parity self-check and the router's in-process metrics."""

"""The HTTP edge's defaults, each written once: the cluster config's fields
(``router.http_*``), the router's settings and the edge's own constructor take them from
here. No imports: a router that serves no HTTP reads them without loading the HTTP stack."""

MAX_CONNECTIONS = 2048  # open HTTP connections; past it: 503 server_busy
CHEAP_RATE_PER_S = 200.0  # /health, /version, /metrics, /v1/models (and wrong paths) per s
CHEAP_MAX_WAITING = 128  # cheap requests waiting their turn; past it: 503 server_busy
# A client has this long for a request's head (from connecting, or from its last answer)
# and then for its body: uvicorn waits forever on either, so idle or trickling sockets
# could pile up until the router's process runs out of file descriptors, gRPC included.
HEAD_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0

"""The serving core every edge calls: validate, tokenize, place, stream from a worker,
retry elsewhere; and how a router reaches workers (an ABC and its Ray implementation)."""

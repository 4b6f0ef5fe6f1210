"""The router's network edges over the serving core: gRPC servicer, auth and the
protobuf <-> internal conversions (the only module that builds protobuf messages)."""

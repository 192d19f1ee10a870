"""The router's direct endpoint: a small gRPC server of its own (`GrpcServer`), so a router
replica can serve `pdserve.v1.Generation` without Serve's proxy (docs/architecture.md, "The
channels around Serve"). It imports nothing else of `router` or `cluster`: the router hands it a
method table (`service_methods(descriptor, servicer)`), and each method gets its `GrpcCall` as
grpc's servicer context (`set_code`, `set_details`).

Scope: gRPC over plaintext HTTP/2 (prior knowledge) or TLS (`start`'s `ssl`, ALPN "h2"), unary
and server-streaming methods (one request message per call), no compression (a compressed
request is refused UNIMPLEMENTED; responses go uncompressed), request metadata read for
`grpc-timeout` only (the methods see all headers: the router reads `authorization`), a call's
status in `grpc-status` and `grpc-message` and nothing else in its trailers.

Bounded today (each with a test in tests/router/direct/):
- streams open at once per connection: `MAX_STREAMS` (SETTINGS_MAX_CONCURRENT_STREAMS); one
  more is a protocol error that closes the connection;
- a request's header list: `MAX_HEADER_LIST_BYTES` (SETTINGS_MAX_HEADER_LIST_SIZE, enforced by
  `h2`'s HPACK decoder from the connection's start); more closes the connection;
- a request message: `MAX_REQUEST_BYTES`, more is RESOURCE_EXHAUSTED (its bytes are counted,
  not kept);
- response bytes: what the client's HTTP/2 windows take, plus one message per call held back,
  plus the socket's buffer (`pause_writing` stops every call); at most `TURN_BYTES` are framed
  per loop turn before a call waits for the write;
- a call's time, when the client sends `grpc-timeout` (DEADLINE_EXCEEDED);
- a stop: GOAWAY at once, calls under way get a grace, then UNAVAILABLE.

Not bounded yet: the number of connections, or of calls across them; a connection's idle time
and age (no keepalive, no idle close); the time to the client's preface (a socket that never
speaks is held open); the rate of PINGs, SETTINGS and stream resets (h2 answers them all);
request bytes in flight across the calls of a connection (each is acknowledged at once, so a
connection may hold up to `MAX_STREAMS` requests of `MAX_REQUEST_BYTES` each).
"""

from router.direct.grpc_call import GrpcCall, Method
from router.direct.grpc_server import GrpcServer, service_methods

__all__ = ["GrpcCall", "GrpcServer", "Method", "service_methods"]

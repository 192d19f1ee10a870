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

Bounded, by `DirectLimits` (limits.py; defaults in brackets), each with a test in
tests/router/direct/, grpc core's server the model:
- connections open at once [128]: one more is sent GOAWAY (ENHANCE_YOUR_CALM) and closed;
- streams open at once per connection [256] (SETTINGS_MAX_CONCURRENT_STREAMS): one more is a
  protocol error that closes the connection;
- a frame [16 KiB: SETTINGS_MAX_FRAME_SIZE, HTTP/2's default, limits.py's `MAX_FRAME_BYTES`]:
  one that claims more is GOAWAY FRAME_SIZE_ERROR from its 9-byte header, before any of it is
  buffered (h2 alone would buffer up to 16 MiB first; frame_check.py); and the client's first
  frame after its preface must be SETTINGS (RFC 9113, 3.4), else GOAWAY PROTOCOL_ERROR, no
  stream served;
- a request's header list [8 KiB] (SETTINGS_MAX_HEADER_LIST_SIZE, held by `h2`'s HPACK decoder
  from the connection's first byte, before the client acknowledges the SETTINGS): more closes
  the connection; and its header block's frames [8 KiB + 261 bytes of padding and priority],
  counted from their headers before h2 buffers them: more is GOAWAY ENHANCE_YOUR_CALM
  (frame_check.py);
- a request message [4 MiB, grpc's receive limit]: more is RESOURCE_EXHAUSTED (its bytes are
  counted and dropped);
- request bytes held: per stream its window [4 MiB + 64 KiB, a whole request], per connection its
  window [4 MiB + 64 KiB]. A request's bytes are acknowledged only when its call reads them,
  after admission, so a body that never ends stops being fed at its window, and calls waiting
  for admission hold no more than their windows;
- a request's arrival [30 s from its headers to its end]: later, DEADLINE_EXCEEDED and the
  stream reset, its window given back;
- the handshake [20 s to the client's preface and SETTINGS], idleness [300 s with no stream:
  GOAWAY, closed];
- PINGs [a strike for each sooner than 300 s after the last, cleared by any HEADERS or DATA
  sent; a third strike is GOAWAY ENHANCE_YOUR_CALM and the connection's end];
- bytes queued for a client that does not read [1 MiB beyond the socket's buffer: dropped];
  responses stop far below that: what the client's windows take, one message per call held
  back, `TURN_BYTES` framed per loop turn (`pause_writing` stops every call);
- calls running and waiting, with the router's `Admission` (admission.py): the same limit and
  queue as the router deployment's Serve limits, shared with proxied calls; a call beyond the
  queue is RESOURCE_EXHAUSTED;
- a call's time, when the client sends `grpc-timeout` (DEADLINE_EXCEEDED);
- a stop: GOAWAY at once, calls under way get a grace, then UNAVAILABLE.

Memory: what clients can make the endpoint hold before any call runs is at most
`DirectLimits.memory_bound_bytes()`: per connection its window, its write bound, its streams'
state and header lists (counted at 4x their HPACK size, above the worst case measured), a
header block under way, a frame not yet whole (16 KiB and its header, at most) and its own
state; at the defaults about 14 MiB a connection, 1.8 GiB for 128 (the tests measure an attack
of 1,000 streams and a PING flood against the bound at their limits).

Not bounded: the rate of SETTINGS frames and stream resets (h2 answers them; the write bound
drops a client that does not read the answers); a connection's age (no max_connection_age).
"""

from router.direct.admission import Admission, Overloaded
from router.direct.grpc_call import GrpcCall, Method
from router.direct.grpc_server import GrpcServer, service_methods
from router.direct.limits import DirectLimits

__all__ = [
    "Admission",
    "DirectLimits",
    "GrpcCall",
    "GrpcServer",
    "Method",
    "Overloaded",
    "service_methods",
]

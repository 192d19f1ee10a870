"""The ingress: gRPC and OpenAI HTTP APIs, validation, and the two-hop orchestration.
`router.direct` is the router replica's own gRPC server (HTTP/2 through `h2`), a package that
imports nothing else of `router`."""

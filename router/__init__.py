"""The ingress: gRPC and OpenAI HTTP APIs, validation, and the two-hop orchestration."""

"""The client plane: the public gRPC client (`generation_client.GenerationClient`), workloads
from traces or random prompts (`workload`), an open-loop load generator (`load_generator`), its
summary (`bench_summary`) and the phase model (`phase_model`). It never imports torch, so a client
machine needs only grpcio and protobuf.

May import: the `cluster` root modules and `cluster.pb`.
"""

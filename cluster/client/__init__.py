"""The client plane: the public gRPC client (`generation_client.GenerationClient`), workloads
from traces (the Mooncake trace ships in `traces/`) or random prompts (`workload`), an open-loop
load generator over gRPC (`load_generator`) or OpenAI HTTP (`openai_load`) with a progress line
(`progress`), its summary (`bench_summary`), the run's vLLM-shaped JSON (`bench_result`), its
plots (`bench_plots`, matplotlib from the `plot` extra) and the phase model (`phase_model`). It
never imports torch, so a client machine needs only grpcio, protobuf, numpy and aiohttp.

May import: the `cluster` root modules and `cluster.pb`.
"""

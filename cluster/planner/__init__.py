"""The planner plane: what a P:D split will deliver before it is deployed. A `Profile` holds
step-time models fitted by least squares (`step_fit`) from probe requests sent to a running
deployment over the public gRPC API (`probe`): prefill and decode step time, KV transfer per
transport, router and proxy overheads. The `Simulator` replays a trace or a synthetic mix on
a cluster shape (prefill, decode or colocated replicas, each an `EngineSim` with the engine's
scheduling rules: token budget, `max_num_seqs`, KV blocks, prefix cache) as discrete events,
deterministic for a seed, and reports each request's TTFT, inter-token latencies and phases,
goodput and SLO attainment. `plan` searches the splits of N replicas (`plan_gpus`: of N GPUs
among replicas of the tensor-parallel sizes the profile has) and writes the chosen shape as a
Serve config (`serve_config`). At run time, opt-in, the ratio policy keeps the
split right as the mix shifts: `SplitPlanner` (a Ray actor per app) decides from the pools'
observed mix (`mix_window`, `split_decision`) and both pools' `SplitPolicy` follow it. It never
imports torch or engine code.

May import: the `cluster` root modules and `cluster.client` (workloads, the load generator).
"""

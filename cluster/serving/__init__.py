"""The serving plane: Ray Serve plumbing shared by the three roles. `app` builds the Serve
application from an `AppConfig`; `replica` is the base of the engine replicas; `pool_messages`
names what crosses between router and pools, `token_wire` packs token batches; `pool_load` is
the one home of a replica's load signals, which feed `autoscaling` (Serve's autoscaler), the
gauges of `metrics` (and `vllm_metrics`, the same under vLLM's names) and `GetStats` (through
`stats_registry`): adding a signal touches at most 3 files, listed there (the dry run) and
checked by tests/cluster/serving/test_pool_load.py. `metered_engine` and `stats_line` make an
engine replica's periodic stats line in its log; `cpu_affinity` pins engine threads;
`placement` sizes a local Ray for the replicas asked for and bounds the wait for them;
`gpu_placement` decides each engine pool's GPUs from the cluster's nodes, and `replica_device`
each replica's device and dtype "auto" where it runs. `hub_env` hands a hub model's token and
hub settings to every replica; `loading_report` lists a replica as loading while its engine
starts.

May import: the `cluster` root modules, `cluster.model`, `cluster.engine`, `cluster.kv_transfer`
and `cluster.pb`.
"""

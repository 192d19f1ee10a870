"""pdserve's library, one sub-package per plane.

The root modules are the shared vocabulary every plane speaks: `config` (frozen engine
configs), `errors` (the status-coded error types), `request` and `sampling_params`. They import
only each other. The planes, and what each may import (enforced by tests/test_import_graph.py):

- `cluster.model`: the Llama-family decoder, kernels, checkpoint loading and factories (root).
- `cluster.engine`: the engine loop and everything it drives (root, model).
- `cluster.kv_transfer`: moving a prefilled prompt's KV between replicas (root, engine, pb).
- `cluster.serving`: Ray Serve plumbing shared by the roles (root, model, engine, kv_transfer, pb).
- `cluster.client`: the public gRPC client and load tooling, no torch (root, pb).
- `cluster.cli`: the `pdserve` command (any plane).
- `cluster.pb`: generated protobuf/gRPC modules (nothing).
"""

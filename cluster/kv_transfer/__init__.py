"""The KV transfer plane: what a prefill replica hands out (`KVHandle`, signed by a
`capability` token), the wire format of KV chunks (`kv_wire`), and the decode side's clients
behind one interface and ownership contract (`kv_client.KVClient`, picked by `make_kv_client`):
`GrpcKVClient` streams chunks over gRPC; `CollectiveKVClient` moves tensors over a
torch.distributed pair (`nccl` on GPUs, `gloo` on CPUs) set up through `kv_channel` and cached
by `kv_channel_cache`. Both reach the prefill replicas' KV servers through `kv_server_stubs`.
The serving side lives with its role, in `prefill_worker.kv_server`.

May import: the `cluster` root modules, `cluster.engine` (the KV cache types) and `cluster.pb`.
"""

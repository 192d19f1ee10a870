"""The KV transfer plane: what a prefill replica hands out (`KVHandle`, signed by a
`capability` token), the wire format of KV chunks (`kv_wire`, framed by `kv_frame`, optionally
checksummed by `kv_checksum`), and the decode side's clients behind one interface and ownership
contract (`kv_client.KVClient`, picked by `make_kv_client`): `NixlKVClient` READs blocks from
the prefill pool straight into the decode pool through NIXL agents (`nixl_pool`);
`GrpcKVClient` streams chunks over gRPC; `CollectiveKVClient` moves tensors over a
torch.distributed pair (`nccl` on GPUs, `gloo` on CPUs) set up through `kv_channel` and cached
by `kv_channel_cache`. All reach the prefill replicas' KV servers through `kv_server_stubs`.
The serving side lives with its role, in `prefill_worker.kv_server`.

May import: the `cluster` root modules, `cluster.engine` (the KV cache types) and `cluster.pb`.
"""

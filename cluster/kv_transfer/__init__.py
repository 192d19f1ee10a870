"""The KV transfer plane: what a prefill replica hands out (`KVHandle`, signed by a
`capability` token), the wire format of KV chunks (`kv_wire`, framed by `kv_frame`, optionally
checksummed by `kv_checksum`), and the KV transports, one folder each with both ends inside:
`grpc/` (chunks streamed over gRPC; the baseline every KV server serves), `nixl/` (READs from
the prefill pool straight into the decode pool through NIXL agents) and `collective/` (`gloo`
and `nccl`: a torch.distributed pair per prefill/decode couple).

`base` states the contracts of a transport's two ends (`KVClient`, the decode side; `KVSender`,
the prefill side's RPC handlers); `registry` declares each transport once (name, capabilities,
package); `transport_factory` builds a worker's ends through it. A sender pins leases through
`lease_pins.LeasePins` (the prefill worker's `LeaseKeeper` implements it) and makes the same
checks (`lease_pins.pin`); `kv_control.KVControl` carries the calls every transport shares
(ReleaseKV, the router's CancelPrefill) over `kv_server_stubs`. The server itself is the
prefill worker's `KVServer`, which mounts the senders' handlers; nothing outside a transport's
folder imports it (tests/test_import_graph.py).

How to add a transport "foo":
1. A folder `cluster/kv_transfer/foo/` whose `__init__.py` defines `make_client(parts:
   ClientParts) -> KVClient` and `make_sender(parts: SenderParts) -> KVSender` (raising
   Unavailable where it cannot run: both sides then fall back to the baseline).
2. One line in `registry`: `register(Transport("foo", "cluster.kv_transfer.foo"))`, with
   `needs_cuda` or a `probe` (a candidate for transport "auto") if it has them.
3. Its RPCs: the sender's `handlers()` returns them by service; a new message goes in
   `proto/pdserve/v1/kv_transfer.proto` (regenerate `cluster.pb`), or the transport serves a
   service of its own. To name it in a config, add it to `TransferConfig`'s names in
   `cluster/config.py` (a test keeps them equal to the registry's).
`tests/cluster/kv_transfer/test_new_transport.py` does steps 1-3 from a temporary folder.

May import: the `cluster` root modules, `cluster.engine` (the KV cache types) and `cluster.pb`.
"""

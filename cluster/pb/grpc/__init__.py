"""Generated protobuf and gRPC modules. Do not edit; run `python -m cluster.pb.generate`."""

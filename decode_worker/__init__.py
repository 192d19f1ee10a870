"""The decode pool's deployment (KV import, continuous decode batching, token streaming) and
the colocated baseline."""

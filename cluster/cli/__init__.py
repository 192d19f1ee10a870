"""The `pdserve` command (`main`) and its verbs: `serve` (start or join Ray, deploy, print the
endpoints), `bench` and `phases` (`bench`), `generate` (over gRPC, or in this process), `status`
(tables, `--json`, `--watch`) and `config-schema`; `version` is what `--version` and a bench
report say.

May import: any `cluster` plane.
"""

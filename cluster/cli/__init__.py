"""The `pdserve` command (`main`) and its verbs: `serve` (start or join Ray, deploy, print the
endpoints), `bench` and `phases` (`bench`), and the client verbs.

May import: any `cluster` plane.
"""

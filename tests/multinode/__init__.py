"""Multi-node tests: real Ray nodes in network namespaces of the tests' own, on one machine."""

from tests.ray_fixtures import ray_serve  # noqa: F401  (session-wide Ray + Serve)

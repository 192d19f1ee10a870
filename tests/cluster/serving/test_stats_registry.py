"""`stats_registry.registry`: replicas that start together race to create the application's
registry actor, and Ray may answer a loser "Failed to look up actor" while the winner's is
being registered; that answer is retried, a lasting one is raised (a stand-in for Ray's
actor options here: the race itself cannot be forced)."""

from __future__ import annotations

import pytest

from cluster.serving import stats_registry


class _Options:
    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    def __call__(self, **options):
        assert options["get_if_exists"] and options["lifetime"] == "detached"
        return self

    def remote(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise ValueError("Failed to look up actor with name 'pdserve-stats-app'")
        return "the registry"


def test_a_lost_creation_race_is_retried(monkeypatch):
    options = _Options(failures=3)
    monkeypatch.setattr(stats_registry.StatsRegistry, "options", options)
    assert stats_registry.registry("app") == "the registry"
    assert options.calls == 4


def test_a_lasting_lookup_failure_is_raised(monkeypatch):
    options = _Options(failures=100)
    monkeypatch.setattr(stats_registry.StatsRegistry, "options", options)
    with pytest.raises(ValueError, match="Failed to look up actor"):
        stats_registry.registry("app", attempts=3)
    assert options.calls == 3

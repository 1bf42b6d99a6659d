"""The environment the launcher gives its children: with a draft service, the OpenMP workers of the draft and the
target spin only briefly between turns; with expert shards they sleep at once (OMP_WAIT_POLICY=PASSIVE)."""
from __future__ import annotations

from services import launcher
from services.launcher import ServeConfig


def test_a_draft_service_shortens_the_spin_of_draft_and_targets(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    drafted = ServeConfig(draft="eagle:models/eagle-smollm2-135m")
    assert launcher._turns_env(drafted, launcher._expert_env(drafted)) == {"GOMP_SPINCOUNT": "20000"}
    monkeypatch.setenv("GOMP_SPINCOUNT", "5000")                               # the user's own setting wins
    assert launcher._turns_env(drafted, None) == {"GOMP_SPINCOUNT": "5000"}
    plain = ServeConfig()
    assert launcher._turns_env(plain, launcher._expert_env(plain)) is None    # nothing changed without a draft
    shards = ServeConfig(draft="ngram", expert_shards=2)
    assert launcher._turns_env(shards, launcher._expert_env(shards)) == {"OMP_WAIT_POLICY": "PASSIVE"}

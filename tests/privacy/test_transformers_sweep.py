"""The sweep of transformers' model types (transformers_sweep.py) on a few types, so that it cannot rot: each outcome
it tells apart, on a type that has it today."""
import pytest

import transformers_sweep
from transformers_sweep import sweep_one


@pytest.mark.parametrize("kind,head,lora", [("bert", "seq-cls", False), ("bigbird_pegasus", "seq-cls", False),
                                            ("gpt2", "causal-lm", True)])
def test_types_that_train_are_exact_in_both_modes(kind, head, lora):
    for clipping in ("ghost", "bookkeeping"):
        outcome = sweep_one(kind, head, clipping, lora)
        assert outcome.status == "exact", outcome


def test_a_type_ghostdp_refuses_is_refused_with_its_error():
    """JetMoE's attention experts read their bias outside their forward."""
    outcome = sweep_one("jetmoe")
    assert outcome.status == "refused" and "outside the forward of the module that owns it" in outcome.detail, outcome


def test_a_model_that_fails_only_under_ghostdp_is_a_crash():
    """Longformer's global attention is sequence-first on one position: with LoRA on its query_global, lora_A's
    (1, B, r) output of an input without gradient is taken for one shared by the batch and broadcast, and the
    model's own view of it then fails (the error's note says so, naming the fix: freeze that module)."""
    outcome = sweep_one("longformer", lora=True)
    assert outcome.status == "crashed" and "is invalid for input of size" in outcome.detail, outcome


def test_a_clipped_sum_off_the_loop_is_off(monkeypatch):
    def doubled(*args, **kwargs):
        sums, norms = ghost_clipped_sum(*args, **kwargs)
        return {name: 2 * g for name, g in sums.items()}, norms
    ghost_clipped_sum = transformers_sweep.ghost_clipped_sum
    monkeypatch.setattr(transformers_sweep, "ghost_clipped_sum", doubled)
    outcome = sweep_one("bert")
    assert outcome.status == "off" and float(outcome.detail) > 0.1, outcome


def test_a_config_the_model_cannot_run_is_unbuilt_not_a_finding(monkeypatch):
    monkeypatch.setitem(transformers_sweep.TWEAKS, "bert", {"hidden_size": 30})  # not a multiple of the 4 heads
    outcome = sweep_one("bert")
    assert outcome.status == "unbuilt" and "multiple of the number of attention heads" in outcome.detail, outcome

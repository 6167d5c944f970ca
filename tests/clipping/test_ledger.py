"""The step ledger (ghostdp/clipping/ledger.py): what the DP loss, the loader and the DP optimizer tell each other."""
import torch
from torch import nn

import ghostdp
from ghostdp.clipping.ledger import StepLedger
from ghostdp.randomness import RandomSource


def test_records_are_kept_only_once_a_dp_optimizer_opens_the_ledger_and_each_take_starts_afresh():
    lin = nn.Linear(3, 2)
    controller = ghostdp.GhostClipping(lin, 1.0)
    controller.loss(lin(torch.randn(4, 3)).pow(2).sum(1)).backward()
    assert controller.ledger.records is None and controller.ledger.take() == []  # nobody reads them: none kept
    seen = []
    controller.ledger.open(seen.append)
    lin.zero_grad()
    controller.loss(lin(torch.randn(4, 3)).pow(2).sum(1)).backward()
    assert len(seen) == 1 and seen[0].shape == (4,)  # the check ran before the norm pass, with the losses
    records = controller.ledger.take()
    assert [r.examples for r in records] == [4] and controller.ledger.take() == []
    assert float(controller.last_loss_scale) == 1.0


def test_a_dp_optimizer_built_again_takes_the_ledgers_check_and_resets_the_unclipped_count():
    lin = nn.Linear(3, 2)
    controller = ghostdp.GhostClipping(lin, 1.0)

    def dp_optimizer(adaptive_clipping=None):
        return ghostdp.DPOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), controller=controller,
                                   noise_multiplier=1.0, expected_batch_size=4, sample_rate=0.1, accountant=None,
                                   random_source=RandomSource(seed=0), adaptive_clipping=adaptive_clipping)

    adaptive = dp_optimizer(ghostdp.AdaptiveClipNorm(target_quantile=0.5, count_noise_std=10.0))
    assert controller.ledger.count_unclipped and controller.ledger.norm_pass_check == adaptive._on_norm_pass
    plain = dp_optimizer()
    assert not controller.ledger.count_unclipped and controller.ledger.norm_pass_check == plain._on_norm_pass
    controller.loss(lin(torch.randn(4, 3)).pow(2).sum(1)).backward()
    assert controller.ledger.records[-1].unclipped is None  # the plain optimizer's step counts nothing


def test_a_padding_mark_applies_to_the_next_loss_only_and_a_forgotten_step_drops_it():
    ledger = StepLedger()
    ledger.open()
    ledger.mark_next_loss(padding=True)
    assert ledger.next_loss_is_padding and ledger.take_padding() and not ledger.take_padding()
    ledger.mark_next_loss(padding=True)
    ledger.forget_step()
    assert not ledger.next_loss_is_padding and ledger.records == []

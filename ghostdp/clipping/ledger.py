"""What one step's parts tell each other: the DP loss, the data loader (or the Trainer) and the DP optimizer.

The controller owns one StepLedger (``GhostClipping.ledger``); each part writes and reads it through the
methods below, where before they wrote public fields of the controller.
- The DP optimizer opens it (``open``): from then on each backward of a DP loss leaves a BackwardRecord
  (``record``: its examples, the gradient that flowed into the loss, ...), which the optimizer takes at its
  step (``take``) to check and account them; and its ``norm_pass_check`` runs before every norm pass (one slot:
  a DP optimizer built again for the controller, as a Trainer does, takes the last one's place).
- The loader marks the next DP loss as a padding chunk's (``mark_next_loss``: a rank with fewer examples keeps
  DDP's collectives in step with a stand-in row); the loss takes that mark (``take_padding``) and weighs 0. Both
  say how many examples the batch they hand out holds (``mark_next_batch``; ``examples_of_next_batch``), which the
  forward check reads before any norm pass has said where a batch's examples lie (independence.py).
"""
from __future__ import annotations

from .records import BackwardRecord


class StepLedger:
    def __init__(self):
        self.records: list[BackwardRecord] | None = None  # since the last take(); None until a DP optimizer opens it
        self.count_unclipped = False   # adaptive clipping: each record also counts the examples whose norm is <= C
        self.norm_pass_check = None    # the DP optimizer's check before each norm pass, called with the losses
        self.loss_scale = None         # the gradient that flowed into the last DP loss: 1 for a plain backward()
        self._padding_next = False
        self._examples_next = None

    def open(self, norm_pass_check=None, count_unclipped: bool = False) -> None:
        """A DP optimizer reads the records from now on (``norm_pass_check``: its check before each norm pass)."""
        self.records, self.norm_pass_check, self.count_unclipped = [], norm_pass_check, count_unclipped

    def record(self, record: BackwardRecord) -> None:
        if self.records is not None:
            self.records.append(record)

    def take(self) -> list[BackwardRecord]:
        """The records since the last take (the DP optimizer's step)."""
        if self.records is None:
            return []
        records, self.records = self.records, []
        return records

    def mark_next_loss(self, padding: bool) -> None:
        """Whether the next DP loss is a padding chunk's (it then weighs 0 and counts no examples)."""
        self._padding_next = bool(padding)

    def mark_next_batch(self, examples: int) -> None:
        """How many examples the batch just handed out for the next forward holds."""
        self._examples_next = int(examples)

    @property
    def examples_of_next_batch(self) -> int | None:
        """The examples of the batch the loader (or the Trainer) handed out last, or None where none said: a hint,
        kept until the next one (a loop may call the model on other tensors in between)."""
        return self._examples_next

    @property
    def next_loss_is_padding(self) -> bool:
        return self._padding_next

    def take_padding(self) -> bool:
        """The next DP loss's mark, consumed: it applies to one loss."""
        padding, self._padding_next = self._padding_next, False
        return padding

    def forget_step(self) -> None:
        """Forget the backwards of a step that will not be taken (the automatic physical batch search's probes)."""
        if self.records is not None:
            self.records.clear()
        self._padding_next = False

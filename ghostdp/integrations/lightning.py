"""PyTorch Lightning: private training of a LightningModule with ``lightning.Trainer``, through one callback.

    privacy = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)   # or target_epsilon=...

    class Model(L.LightningModule):
        def train_dataloader(self):
            return privacy.data_loader(DataLoader(train, batch_size=64))    # Poisson logical batches
        def training_step(self, batch, batch_idx):
            x, y = batch
            return privacy.loss(F.cross_entropy(self(x), y, reduction="none"))

    L.Trainer(max_epochs=3, callbacks=[privacy]).fit(Model())

The callback holds a ``PrivacyEngine``. Lightning asks for the data first (``data_loader`` builds the
private loader then); at ``on_train_start`` the callback makes the module and the optimizer
``configure_optimizers`` returned private (hooks in place, the optimizer wrapped in a DPOptimizer that
Lightning then steps). Epsilon is logged as "epsilon"; the engine's state (accountant, sampler, noise
streams, schedules) is the callback's state in Lightning checkpoints.
"""
from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from ..engine import PrivacyEngine


class DPCallback(Callback):
    """DP-SGD with ghost clipping for ``lightning.Trainer``.

    Args (as ``PrivacyEngine`` / ``make_private``): noise_multiplier or target_epsilon (calibrated for
        the Trainer's max_epochs), target_delta (for calibration and the logged epsilon),
        max_grad_norm, clipping, max_physical_batch_size, poisson_sampling, batch_size_schedule,
        accountant, secure_mode, seed.
    """

    def __init__(self, *, max_grad_norm, noise_multiplier: float | None = None,
                 target_epsilon: float | None = None, target_delta: float = 1e-5, clipping: str = "ghost",
                 max_physical_batch_size: int | None = None, poisson_sampling: bool = True,
                 batch_size_schedule=None, accountant: str = "prv", secure_mode: bool = False,
                 seed: int | None = None):
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError("give exactly one of noise_multiplier and target_epsilon")
        self.engine = PrivacyEngine(accountant=accountant, secure_mode=secure_mode, seed=seed)
        self.noise_multiplier, self.target_epsilon, self.target_delta = noise_multiplier, target_epsilon, target_delta
        self.max_grad_norm, self.clipping = max_grad_norm, clipping
        self.sampling = dict(poisson_sampling=poisson_sampling, max_physical_batch_size=max_physical_batch_size,
                             batch_size_schedule=batch_size_schedule)
        self._source_loader = None
        self._epsilon = (None, None)

    # ------------------------------------------------------------------ what the LightningModule calls
    def data_loader(self, data_loader):
        """The private loader for ``train_dataloader()`` (the same one on every call)."""
        if self._source_loader is None:
            self._source_loader = data_loader
        return self.engine.private_data_loader(data_loader, **self.sampling)

    def loss(self, per_example_losses, reduction: str = "mean"):
        """The DP loss for ``training_step`` to return, from (B,) per-example losses."""
        if self.engine.controller is None:
            raise RuntimeError("DPCallback.loss was called before training started: pass the callback to "
                               "lightning.Trainer(callbacks=[...]) and return privacy.data_loader(...) from "
                               "train_dataloader()")
        return self.engine.controller.loss(per_example_losses, reduction)

    def epsilon(self) -> float:
        steps = self.engine.accountant.steps
        if self._epsilon[0] != steps:
            self._epsilon = (steps, self.engine.get_epsilon(self.target_delta))
        return self._epsilon[1]

    # ------------------------------------------------------------------ Lightning hooks
    def on_fit_start(self, trainer, pl_module):
        if trainer.world_size > 1:
            raise NotImplementedError("DPCallback runs in one process for now: Lightning's distributed samplers "
                                      "would replace the Poisson batches. For several processes use "
                                      "PrivacyEngine in your own loop or DPTrainer (both tested under DDP).")
        if trainer.gradient_clip_val:
            raise ValueError("lightning.Trainer(gradient_clip_val=...) would clip the noisy batch gradient again; "
                             "DP-SGD clips each example (max_grad_norm). Leave gradient_clip_val unset.")
        if trainer.accumulate_grad_batches != 1:
            raise ValueError("accumulate_grad_batches > 1 accumulates several sampled batches into one step, which "
                             "breaks the accounting; use max_physical_batch_size to split a logical batch")
        if not pl_module.automatic_optimization:
            raise NotImplementedError("DPCallback drives Lightning's automatic optimization; with manual "
                                      "optimization use PrivacyEngine.make_private yourself")
        if "16-mixed" in str(trainer.precision) and "bf16" not in str(trainer.precision):
            raise ValueError("precision='16-mixed' scales the loss with a GradScaler, which changes the noise "
                             "calibration; use 'bf16-mixed' or 32")

    def on_train_start(self, trainer, pl_module):
        if self.engine.controller is not None:
            return  # a second fit() of the same run: already private
        if self._source_loader is None:
            raise RuntimeError("the LightningModule's train_dataloader() must return privacy.data_loader(...) "
                               "so that batches are Poisson-sampled and the steps accounted")
        if len(trainer.optimizers) != 1:
            raise NotImplementedError(f"DPCallback supports one optimizer, configure_optimizers returned "
                                      f"{len(trainer.optimizers)}")
        private_loader = self.engine.private_data_loader(self._source_loader, **self.sampling)  # the same one
        common = dict(module=pl_module, optimizer=trainer.optimizers[0], data_loader=private_loader,
                      max_grad_norm=self.max_grad_norm, clipping=self.clipping, **self.sampling)
        if self.target_epsilon is not None:
            if not trainer.max_epochs or trainer.max_epochs < 1:
                raise ValueError("target_epsilon calibrates the noise for lightning.Trainer(max_epochs=...); set it")
            sigma = self.engine.noise_for_epsilon(
                self._source_loader, target_epsilon=self.target_epsilon, target_delta=self.target_delta,
                epochs=trainer.max_epochs, batch_size_schedule=self.sampling["batch_size_schedule"],
                poisson_sampling=self.sampling["poisson_sampling"])
            _, optimizer, _, _ = self.engine.make_private(noise_multiplier=sigma, **common)
            optimizer.calibrated_epsilon = self.target_epsilon
            optimizer.calibrated_steps = self.engine.calibrated_steps(
                self._source_loader, epochs=trainer.max_epochs, batch_size_schedule=self.sampling["batch_size_schedule"],
                poisson_sampling=self.sampling["poisson_sampling"])
        else:
            _, optimizer, _, _ = self.engine.make_private(noise_multiplier=self.noise_multiplier, **common)
        trainer.strategy.optimizers = [optimizer]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.engine.accountant.steps and (trainer.global_step % max(1, trainer.log_every_n_steps) == 0):
            pl_module.log("epsilon", self.epsilon(), on_step=True, on_epoch=False, prog_bar=True)

    def on_train_epoch_end(self, trainer, pl_module):
        if self.engine.accountant.steps:
            pl_module.log("epsilon", self.epsilon(), on_step=False, on_epoch=True)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return self.engine.state_dict() if self.engine.optimizer is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict:
            self.engine.load_state_dict(state_dict)  # the streams wait for make_private at on_train_start

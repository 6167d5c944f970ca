"""Private training of a LightningModule with lightning.Trainer and DPCallback: equal to the plain-loop
engine on the same seed, epsilon logged, checkpoints resume the run exactly, misuse refused."""
import copy

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ghostdp import PrivacyEngine
from ghostdp.integrations.lightning import DPCallback

N, D, K = 40, 5, 3


def dataset():
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(N, D, generator=g), torch.randint(0, K, (N,), generator=g))


def network():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(D, 6), torch.nn.Tanh(), torch.nn.Linear(6, K))


class Classifier(L.LightningModule):
    def __init__(self, privacy, batch_size=8):
        super().__init__()
        self.net, self.privacy, self.batch_size = network(), privacy, batch_size

    def forward(self, x):
        return self.net(x)

    def train_dataloader(self):
        return self.privacy.data_loader(DataLoader(dataset(), batch_size=self.batch_size))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.privacy.loss(torch.nn.functional.cross_entropy(self(x), y, reduction="none"))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def trainer(epochs, tmp_path=None, **kwargs):
    options = dict(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1)
    if tmp_path is not None:
        options.update(default_root_dir=str(tmp_path), enable_checkpointing=True)
    options.update(kwargs)
    return L.Trainer(**options)


def engine_run(epochs, seed=3):
    """The same training in an ordinary loop with PrivacyEngine."""
    net = network()
    engine = PrivacyEngine(seed=seed)
    net, optimizer, criterion, loader = engine.make_private(
        module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.2),
        data_loader=DataLoader(dataset(), batch_size=8), criterion=torch.nn.CrossEntropyLoss(),
        noise_multiplier=0.7, max_grad_norm=0.5)
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            criterion(net(x), y).backward()
            optimizer.step()
    return engine, net


def test_lightning_training_equals_the_engine_loop_and_logs_epsilon():
    privacy = DPCallback(noise_multiplier=0.7, max_grad_norm=0.5, seed=3)
    model = Classifier(privacy)
    run = trainer(2, callbacks=[privacy])
    run.fit(model)
    engine, net = engine_run(2)
    assert privacy.engine.accountant.history == engine.accountant.history == [[0.7, 0.2, 10]]
    for p, q in zip(model.net.parameters(), net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    assert float(run.callback_metrics["epsilon"]) == pytest.approx(engine.get_epsilon(1e-5), rel=1e-9)


def test_lightning_checkpoints_resume_the_private_run(tmp_path):
    straight_privacy = DPCallback(noise_multiplier=0.7, max_grad_norm=0.5, seed=3)
    straight = Classifier(straight_privacy)
    trainer(3, callbacks=[straight_privacy]).fit(straight)

    first_privacy = DPCallback(noise_multiplier=0.7, max_grad_norm=0.5, seed=3)
    first = trainer(2, tmp_path, callbacks=[first_privacy])
    first.fit(Classifier(first_privacy))
    checkpoint = first.checkpoint_callback.best_model_path
    assert checkpoint.endswith(".ckpt")

    privacy = DPCallback(noise_multiplier=0.7, max_grad_norm=0.5, seed=99)  # the checkpoint's seed wins
    resumed = Classifier(privacy)
    trainer(3, callbacks=[privacy]).fit(resumed, ckpt_path=checkpoint)
    assert privacy.engine.accountant.history == straight_privacy.engine.accountant.history
    for p, q in zip(resumed.net.parameters(), straight.net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_lightning_target_epsilon_is_met_over_max_epochs():
    privacy = DPCallback(target_epsilon=5.0, max_grad_norm=0.5, seed=3, accountant="rdp")
    trainer(2, callbacks=[privacy]).fit(Classifier(privacy))
    assert 0.99 * 5.0 <= privacy.epsilon() <= 5.0 and privacy.engine.accountant.steps == 10


class PlainLoader(Classifier):
    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=8)


@pytest.mark.parametrize("options, module, match", [
    (dict(gradient_clip_val=1.0), Classifier, "gradient_clip_val"),
    (dict(accumulate_grad_batches=2), Classifier, "accumulate_grad_batches"),
    ({}, PlainLoader, "must return privacy.data_loader"),
])
def test_lightning_misuse_is_refused(options, module, match):
    privacy = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises((ValueError, RuntimeError), match=match):
        trainer(1, callbacks=[privacy], **options).fit(module(privacy))
    with pytest.raises(ValueError, match="exactly one of noise_multiplier and target_epsilon"):
        DPCallback(max_grad_norm=1.0)

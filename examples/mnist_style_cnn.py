"""DP-SGD on a small CNN in an ordinary PyTorch loop: two changed lines, an honest epsilon.

Synthetic "digits" (12x12 images: a class template plus noise), so it runs anywhere in seconds.
    python examples/mnist_style_cnn.py --epsilon 4 --epochs 5
"""
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ghostdp


def synthetic_digits(n, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(classes, 1, 12, 12, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    images = templates[labels] + 1.5 * torch.randn(n, 1, 12, 12, generator=g)
    return TensorDataset(images, labels)


def make_model(classes=4):
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
        nn.Flatten(), nn.Linear(64, classes))


def accuracy(model, data):
    model.eval()
    with torch.no_grad():
        x, y = data.tensors
        return float((model(x).argmax(1) == y).float().mean())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--physical-batch-size", type=int, default=64)
    parser.add_argument("--train-size", type=int, default=4000)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    everything = synthetic_digits(args.train_size + 1000, seed=1)
    train = TensorDataset(*(t[:args.train_size] for t in everything.tensors))
    test = TensorDataset(*(t[args.train_size:] for t in everything.tensors))
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = DataLoader(train, batch_size=args.batch_size)

    engine = ghostdp.PrivacyEngine(accountant="prv", seed=args.seed)            # change 1
    model, optimizer, criterion, loader = engine.make_private_with_epsilon(      # change 2
        module=model, optimizer=optimizer, data_loader=loader, criterion=nn.CrossEntropyLoss(),
        target_epsilon=args.epsilon, target_delta=args.delta, epochs=args.epochs,
        max_grad_norm=args.max_grad_norm, max_physical_batch_size=args.physical_batch_size)
    print(f"noise multiplier {optimizer.noise_multiplier:.3f} for epsilon {args.epsilon} at delta {args.delta}")

    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        for x, y in loader:                   # business as usual
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
        eps = engine.get_epsilon(args.delta)
        print(f"epoch {epoch + 1}: test accuracy {accuracy(model, test):.3f}, epsilon {eps:.3f}")
    result = {"accuracy": accuracy(model, test), "epsilon": engine.get_epsilon(args.delta),
              "steps": engine.accountant.steps, "seconds": time.perf_counter() - start}
    print(f"done: {result['steps']} steps in {result['seconds']:.1f} s, accuracy {result['accuracy']:.3f}, "
          f"epsilon {result['epsilon']:.3f} (target {args.epsilon})")
    return result


if __name__ == "__main__":
    main()

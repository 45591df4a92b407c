"""Fashion-MNIST through the real torchvision loader, or an announced synthetic stand-in.

The data folder is ``data/`` at the top of the repository unless ``COURSE_DATA`` names
another. Online, torchvision downloads Fashion-MNIST there (about 30 MB) on first use.
Offline (or with ``COURSE_OFFLINE=1``), when the files are not there, the loaders fall back to
a synthetic data set of the same shapes and say so loudly: the code runs, but accuracies and
timings of the stand-in say nothing about the real data.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

DATA_DIR = Path(os.environ.get("COURSE_DATA", Path(__file__).resolve().parents[1] / "data"))

TEXT_LABELS = ["t-shirt", "trouser", "pullover", "dress", "coat",
               "sandal", "shirt", "sneaker", "bag", "ankle boot"]


def _offline() -> bool:
    return os.environ.get("COURSE_OFFLINE", "0").lower() in {"1", "true", "yes"}


def synthetic_fashion_mnist(n: int, *, seed: int = 0, image_size: int = 28) -> TensorDataset:
    """``n`` learnable fake images: one fixed random prototype per class plus noise, in [0, 1].

    The prototypes are the same for every ``seed`` (so a train and a test set made with two
    seeds share their classes); ``seed`` draws the labels and the noise.
    """
    prototypes = torch.rand(10, 1, image_size, image_size,
                            generator=torch.Generator().manual_seed(20_251_122))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    noise = 0.3 * torch.randn(n, 1, image_size, image_size, generator=g)
    images = (prototypes[labels] + noise).clamp(0, 1)
    return TensorDataset(images, labels)


def fashion_mnist_datasets(resize: int | None = None, root: str | Path | None = None,
                           download: bool | None = None) -> tuple[Dataset, Dataset, bool]:
    """``(train, test, is_real)``: torchvision's FashionMNIST, or the synthetic stand-in."""
    import torchvision
    from torchvision import transforms

    root = Path(root) if root is not None else Path(os.environ.get("COURSE_DATA", DATA_DIR))
    download = (not _offline()) if download is None else download
    steps = [transforms.ToTensor()]
    if resize:
        steps.insert(0, transforms.Resize(resize))
    tf = transforms.Compose(steps)
    try:
        train = torchvision.datasets.FashionMNIST(root, train=True, transform=tf, download=download)
        test = torchvision.datasets.FashionMNIST(root, train=False, transform=tf, download=download)
        return train, test, True
    except Exception as exc:  # no files and no network: say so, and carry on with fake data
        size = resize or 28
        print(f"*** Fashion-MNIST is not available in {root} ({type(exc).__name__}: {exc}).\n"
              f"*** Using a SYNTHETIC stand-in of the same shape ({size}x{size}, 10 classes): "
              f"the code runs, but its accuracy and timings mean nothing about the real data.",
              file=sys.stdout)
        return (synthetic_fashion_mnist(6000, seed=0, image_size=size),
                synthetic_fashion_mnist(1000, seed=1, image_size=size), False)


def load_fashion_mnist(batch_size: int, resize: int | None = None, *, limit: int | None = None,
                       root: str | Path | None = None, download: bool | None = None,
                       num_workers: int = 0) -> tuple[DataLoader, DataLoader]:
    """Train and test loaders; ``limit`` keeps the first examples of each (quick mode)."""
    train, test, _ = fashion_mnist_datasets(resize, root, download)
    if limit is not None:
        train = Subset(train, range(min(limit, len(train))))
        test = Subset(test, range(min(max(limit // 5, batch_size), len(test))))
    return (DataLoader(train, batch_size, shuffle=True, num_workers=num_workers),
            DataLoader(test, batch_size, shuffle=False, num_workers=num_workers))

"""Issue 53's dict-sample PIL pipeline, for ``fastmm-bench --dataset``: PIL open, v2
RandomResizedCrop and flip, dict samples (image, label, path), and examples/image_folder.py's
small CNN step, over its stand-in photos (or ``IMAGE_FOLDER``)."""

import os
import sys

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples")
sys.path.insert(0, os.path.abspath(EXAMPLES))
import image_folder  # noqa: E402


class DictPhotos(Dataset):
    def __init__(self, root: str):
        from torchvision.datasets.folder import make_dataset, find_classes

        self.samples = make_dataset(root, find_classes(root)[1], extensions=(".jpg", ".jpeg"))
        self.transform = v2.Compose([
            v2.RandomResizedCrop(image_folder.SIZE), v2.RandomHorizontalFlip(), v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True), v2.Normalize(image_folder.MEAN, image_folder.STD)])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        with Image.open(path) as im:
            image = im.convert("RGB")
        return {"image": self.transform(image), "label": label, "path": path}


def dataset() -> DictPhotos:
    return DictPhotos(image_folder.data_root())


def train_step(batch) -> float:
    return image_folder.train_step((batch["image"], batch["label"]))

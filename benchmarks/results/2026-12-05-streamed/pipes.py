"""Pipelines for issue 40's measurements: fresh 16x3x224x224 clips (as a decoder hands out), and
the decode-bound user Dataset (PIL + v2 RandomResizedCrop(224) + flip over the JPEG corpus)."""
import glob, os
from fastmm.bench.workloads import ClipBankDataset, JpegFolderDataset

def clips():
    return ClipBankDataset((16, 3, 224, 224), bank_size=8, mode="clone", length=1 << 20)

def photos():
    files = sorted(glob.glob(os.path.expanduser("~/.cache/fastmm/bench/jpeg-v1-n2000-seed0/*.jpg")))
    assert files, "no corpus"
    return JpegFolderDataset(files, length=len(files))

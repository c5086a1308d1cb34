"""CPU split of a loader's processes over N batches of the decode-bound dataset."""
import glob, os, sys, time, psutil, torch
from fastmm.bench.workloads import JpegFolderDataset
files = sorted(glob.glob(os.path.expanduser("~/.cache/fastmm/bench/jpeg-v1-n2000-seed0/*.jpg")))
kind, bs, nb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
loop = sys.argv[4] if len(sys.argv) > 4 else "sum"
if kind == "torch":
    from torch.utils.data import DataLoader
else:
    from fastmm import DataLoader
ds = JpegFolderDataset(files, length=1 << 20)
dl = DataLoader(ds, batch_size=bs, num_workers=2)
me = psutil.Process()
it = iter(dl)
for _ in range(3): next(it)
kids = me.children(recursive=True)
def cpu(p):
    t = p.cpu_times(); return t.user + t.system
c0 = [cpu(me)] + [cpu(k) for k in kids]; t0 = time.perf_counter()
n = 0
for _ in range(nb):
    b = next(it); n += b.shape[0]
    if loop == "sum": b.sum(dtype=torch.int64)
dt = time.perf_counter() - t0
c1 = [cpu(me)] + [cpu(k) for k in kids]
d = [1000 * (b - a) / n for a, b in zip(c0, c1)]
print(f"{kind} b{bs} {loop}: {n/dt:.0f}/s main {d[0]:.3f} workers {[round(x,3) for x in d[1:]]} total {sum(d):.3f} ms/sample, threads main {torch.get_num_threads()}")

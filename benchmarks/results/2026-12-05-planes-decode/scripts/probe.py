"""Fork N children doing the decode-bound loop; report per-child rate and CPU ms/sample."""
import glob, os, sys, time, gc, ctypes, resource
import torch
from fastmm.bench.workloads import JpegFolderDataset
files = sorted(glob.glob(os.path.expanduser("~/.cache/fastmm/bench/jpeg-v1-n2000-seed0/*.jpg")))
ds = JpegFolderDataset(files, length=len(files))
for i in range(50): ds[i]
N = int(sys.argv[1]); variant = sys.argv[2]; secs = float(sys.argv[3]) if len(sys.argv) > 3 else 6
def child(k):
    torch.set_num_threads(1)
    if "gcfreeze" in variant: gc.freeze()
    if "gcoff" in variant: gc.disable()
    if "malloc" in variant:
        m = ctypes.CDLL(None).mallopt; m(-3, 32 << 20); m(-1, 256 << 20)
    if "blocks" in variant:
        from PIL import Image; Image.core.set_blocks_max(64)
    if "pin" in variant: os.sched_setaffinity(0, {k % os.cpu_count()})
    i = k * 1000; n = 0
    for _ in range(100): ds[i % 2000]; i += 1
    t0 = time.perf_counter(); c0 = time.process_time()
    while time.perf_counter() - t0 < secs:
        ds[i % 2000]; i += 1; n += 1
    dt = time.perf_counter() - t0; dc = time.process_time() - c0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(f"{variant} N={N} child{k}: {n/dt:.0f}/s cpu {1000*dc/n:.3f} ms/sample minflt {ru.ru_minflt}", flush=True)
    os._exit(0)
pids = []
for k in range(N):
    p = os.fork()
    if p == 0: child(k)
    pids.append(p)
for p in pids: os.waitpid(p, 0)

# Temporary device profile of the peer-copy host path (not committed).
import sys, threading, time, statistics, random
import numpy as np, torch
from kvpush.core.layout import KVLayout, Region, as_ids
from kvpush.core.routing import build_pair_descs, pair_regions
from kvpush.gpu.copy import CupyCopier
dev = torch.device("cuda:0")
B = 65536; n = 16384
def run(regions, label, hog):
    nb = n // regions
    a = torch.zeros(regions * nb * B, dtype=torch.uint8, device=dev)
    b = torch.zeros_like(a)
    L = KVLayout([Region(f"L{r}", a.data_ptr() + r * nb * B, B, nb, 0) for r in range(regions)], 16, mem_type="VRAM")
    D = KVLayout([Region(f"L{r}", b.data_ptr() + r * nb * B, B, nb, 0) for r in range(regions)], 16, mem_type="VRAM")
    pairs = pair_regions(L, D)
    cp = CupyCopier([a, b]); st = torch.cuda.Stream(dev)
    stop = threading.Event()
    def spin():
        while not stop.is_set(): pass
    if hog: threading.Thread(target=spin, daemon=True).start()
    T = {k: [] for k in ("ids", "build", "prepare", "launch", "sync", "total")}
    for i in range(12):
        src = list(range(nb)); dst = list(range(nb)); random.shuffle(src); random.shuffle(dst)
        d_arr = [as_ids(dst)]
        time.sleep(0.02 if i % 2 else 0)
        t0 = time.perf_counter()
        s_arr = [as_ids(src)]; t1 = time.perf_counter()
        S, Dd = build_pair_descs(L, D, pairs, s_arr, d_arr, dst_unique=True); t2 = time.perf_counter()
        with torch.cuda.stream(st):
            prep = cp.prepare(S[:, 0], Dd[:, 0], S[:, 1]); t3 = time.perf_counter()
            cp.launch(prep); t4 = time.perf_counter()
        st.synchronize(); t5 = time.perf_counter()
        if i >= 2:
            for k, x in zip(T, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)): T[k].append(x * 1e6)
    stop.set()
    ok = torch.equal(b.view(regions * nb, B)[torch.tensor([r * nb + x for r in range(regions) for x in dst], device=dev)],
                     a.view(regions * nb, B)[torch.tensor([r * nb + x for r in range(regions) for x in src], device=dev)])
    print(f"{label:28s} hog={hog} ok={ok} " + " ".join(f"{k}={statistics.median(v):.0f}" for k, v in T.items()), f"gib_s={1/ (statistics.median(T['total'])*1e-6):.0f}", flush=True)
    del a, b
sys.setswitchinterval(5e-5)
for hog in (False, True):
    for regions in (1, 32):
        run(regions, f"regions={regions}", hog)

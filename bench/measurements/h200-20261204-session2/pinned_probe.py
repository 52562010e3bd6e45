import json, os, sys, time, hashlib, torch
out = sys.argv[1]; r = {}
dev = "cuda"
n_t = 146; total = 15.6e9; per = int(total / n_t / 4)
ts = [torch.randn(per, device=dev) for _ in range(n_t)]
torch.cuda.synchronize()
t = time.perf_counter(); cp = [x.to("cpu") for x in ts]; r["pageable_to_cpu_s"] = time.perf_counter() - t
del cp
t = time.perf_counter(); pin = [torch.empty(per, pin_memory=True) for _ in range(n_t)]; r["pinned_alloc_s"] = time.perf_counter() - t
t = time.perf_counter(); big = torch.empty(per * n_t, dtype=torch.float32, pin_memory=True); r["pinned_alloc_one_s"] = time.perf_counter() - t
del big
for k in range(2):
    s = torch.cuda.Stream(); t = time.perf_counter()
    with torch.cuda.stream(s):
        for a, b in zip(pin, ts): a.copy_(b, non_blocking=True)
    r[f"pinned_enqueue_s_{k}"] = time.perf_counter() - t
    s.synchronize(); r[f"pinned_copy_s_{k}"] = time.perf_counter() - t
b = pin[0].numpy().tobytes()[:1 << 30]
t = time.perf_counter(); hashlib.sha256(b).hexdigest(); r["sha256_GBps"] = len(b) / (time.perf_counter() - t) / 1e9
p = "/tmp/wtest.bin"; t = time.perf_counter()
with open(p, "wb") as f:
    for a in pin[:20]: f.write(memoryview(a.numpy()).cast("B"))
    f.flush(); os.fsync(f.fileno())
nb = sum(a.numel() * 4 for a in pin[:20]); r["write_fsync_GBps"] = nb / (time.perf_counter() - t) / 1e9
os.remove(p); r["bytes"] = per * n_t * 4
print(json.dumps(r, indent=1)); json.dump(r, open(out, "w"), indent=1)

"""NCCL pairing between two processes on two GPUs (needs two): join time, GPU memory a
pair costs, transfer time of a Qwen2-7B-shaped request (bf16, 28 layers, 4 KV heads, 128 dims)."""
import json
import multiprocessing as mp
import sys
import time

import torch
import torch.distributed as dist

from llaunch.runtime.models.batch import KvCache
from llaunch.runtime.kv_transfer.nccl_pairing import PairedKvReceiver, PairedKvSender

LAYERS, HEADS, DIM, SLOTS = 28, 4, 128, 36000
TOKENS = [1024, 4096]
REPEAT = 10


def cache(device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda: torch.randn(SLOTS, HEADS, DIM, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    return KvCache([mk() for _ in range(LAYERS)], [mk() for _ in range(LAYERS)], torch.zeros(1, 1, dtype=torch.int32))


def batches():
    for n in TOKENS:
        for conc in (1, 8):
            for rep in range(REPEAT):
                perm = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(rep * 7 + n + conc)).tolist()
                yield n, conc, rep, [(f"{n}-{conc}-{rep}-{i}", perm[i * n:(i + 1) * n]) for i in range(conc)]


def sender_main(address, go, res, page_tokens):
    torch.cuda.set_device(0)
    free0 = torch.cuda.mem_get_info(0)[0]
    t0 = time.perf_counter()
    s = PairedKvSender(address, "cuda:0", timeout_s=30, page_tokens=page_tokens)
    s.wait_joined(60)
    join_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    res.put({"sender_join_s": round(join_s, 3), "sender_pair_mem_mib": (free0 - torch.cuda.mem_get_info(0)[0]) / 2**20})
    src = cache("cuda:0", 1)
    torch.cuda.synchronize()
    for n, conc, rep, batch in batches():
        go.get(timeout=60)
        t0 = time.perf_counter()
        hs = [s.send(rid, slots, src) for rid, slots in batch]
        for h in hs:
            h.result(60)
        res.put(time.perf_counter() - t0)
    s.close()


def main():
    page_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())
    opts = dist.ProcessGroupNCCL.Options()
    print("Options has group_name:", hasattr(opts, "group_name"), "; ProcessGroupNCCL has abort:",
          hasattr(dist.ProcessGroupNCCL, "abort"))
    torch.cuda.set_device(1)
    dst = cache("cuda:1", 2)
    src_copy = cache("cuda:1", 1)  # the sender's cache, made again here: the oracle
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info(1)[0]
    r = PairedKvReceiver("nccl://127.0.0.1:0", "cuda:1", timeout_s=30)
    ctx = mp.get_context("spawn")
    go, res = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=sender_main, args=(r.address, go, res, page_tokens))
    p.start()
    info = res.get(timeout=120)
    torch.cuda.synchronize()
    info["receiver_pair_mem_mib"] = (free1 - torch.cuda.mem_get_info(1)[0]) / 2**20
    print(json.dumps(info))
    rows, exact = {}, True
    for n, conc, rep, batch in batches():
        dst_slots = [list(reversed(slots)) for _, slots in batch]  # other slots than the source's
        hs = [r.recv(rid, d, dst) for (rid, _), d in zip(batch, dst_slots)]
        t0 = time.perf_counter()
        go.put(1)
        for h in hs:
            h.result(60)
        e2e = time.perf_counter() - t0
        sent = res.get(timeout=60)
        if rep == 0:
            for (_, s_slots), d in zip(batch, dst_slots):
                for layer in (0, LAYERS - 1):
                    exact &= torch.equal(dst.k[layer][d], src_copy.k[layer][s_slots])
                    exact &= torch.equal(dst.v[layer][d], src_copy.v[layer][s_slots])
        else:
            rows.setdefault((n, conc), []).append((sent, e2e))
    for (n, conc), ts in rows.items():
        nbytes = 2 * LAYERS * n * HEADS * DIM * 2 * conc
        sent = sorted(t[0] for t in ts)[len(ts) // 2]
        e2e = sorted(t[1] for t in ts)[len(ts) // 2]
        print(json.dumps({"tokens": n, "concurrent": conc, "page_tokens": page_tokens, "MB": round(nbytes / 1e6, 1),
                          "sender_median_ms": round(sent * 1e3, 2), "sender_GB_per_s": round(nbytes / sent / 1e9, 1),
                          "recv_e2e_median_ms": round(e2e * 1e3, 2)}))
    p.join(60)
    print("exact:", exact, "sender exit", p.exitcode, "states", r.link_states())
    r.close()


if __name__ == "__main__":
    main()

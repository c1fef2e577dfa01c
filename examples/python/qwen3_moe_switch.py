"""A torch-held Moebius arena for a tiny Qwen3-MoE-style stack, switched EP -> TP -> EP.

    python examples/python/qwen3_moe_switch.py [--gpus N | --virtual-ranks P] [--layers L]
                                               [--experts E] [--hidden H] [--intermediate I]
                                               [--iters K]

1. Writes a safetensors checkpoint with Hugging Face names
   (model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight) and loads it the vLLM way:
   w13 = [gate; up] per expert [2I, H], w2 = down [H, I].
2. Each GPU rank (one process per GPU) allocates its arena with torch, fills its EP shard
   through moebius views (torch.from_dlpack), builds a CudaPeerTransport from CUDA IPC handles
   that the engine's own process group all-gathers (torch.distributed.all_gather_object), and
   switches EP -> TP -> EP, checking every view against torch slicing.
3. Times the switch against what a Python engine would write without Moebius: slice/cat
   packing plus torch.distributed.all_to_all_single.

Needs torch with CUDA and a CUDA build of moebius; exits 0 with a message otherwise. With one
GPU (or --virtual-ranks P) it runs P ranks in one process on GPU 0 (virtual ranks), checks the
switch the same way and times it as copies inside that GPU (no torch baseline: NCCL refuses
two ranks on one GPU).
"""

import argparse
import json
import os
import struct
import sys
import tempfile
import time


def skip(why):
    print(f"qwen3_moe_switch: skipped: {why}")
    sys.exit(0)


try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as tmp
except ImportError:
    skip("torch is not installed")
import moebius  # noqa: E402

# Virtual ranks spin in barriers on one device, each on a hardware queue of its own: ask for
# enough queues before torch creates a CUDA context (harmless with one rank per GPU).
if moebius.with_cuda:
    moebius.request_hardware_queues_for_virtual_ranks()

EP, TP = moebius.Mode.EP, moebius.Mode.TP
W13, W2 = moebius.WeightTensor.w13, moebius.WeightTensor.w2


# --- a minimal safetensors writer/reader (the `safetensors` package is used when present) ---
def save_safetensors(tensors, path):
    try:
        from safetensors.torch import save_file
        return save_file(tensors, path)
    except ImportError:
        pass
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def load_safetensors(path):
    try:
        from safetensors.torch import load_file
        return load_file(path)
    except ImportError:
        pass
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        body = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        b, e = meta["data_offsets"]
        assert meta["dtype"] == "BF16"
        out[name] = torch.frombuffer(bytearray(body[b:e]), dtype=torch.bfloat16).view(meta["shape"])
    return out


def write_checkpoint(args, path):
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for l in range(args.layers):
        for e in range(args.experts):
            p = f"model.layers.{l}.mlp.experts.{e}"
            for name, shape in (("gate_proj", (args.intermediate, args.hidden)),
                                ("up_proj", (args.intermediate, args.hidden)),
                                ("down_proj", (args.hidden, args.intermediate))):
                tensors[f"{p}.{name}.weight"] = (torch.randn(shape, generator=g) * 0.02).to(
                    torch.bfloat16)
    save_safetensors(tensors, path)


def load_experts(args, path):
    """Per layer the vLLM tensors: w13 [E, 2I, H] = [gate; up], w2 [E, H, I]."""
    ckpt = load_safetensors(path)
    layers = []
    for l in range(args.layers):
        p = f"model.layers.{l}.mlp.experts"
        w13 = torch.stack([torch.cat([ckpt[f"{p}.{e}.gate_proj.weight"],
                                      ckpt[f"{p}.{e}.up_proj.weight"]]) for e in range(args.experts)])
        w2 = torch.stack([ckpt[f"{p}.{e}.down_proj.weight"] for e in range(args.experts)])
        layers.append({W13: w13, W2: w2})
    return layers


# --- what each rank holds, by torch slicing (the reference) ---------------------------------
def ep_shard(w, rank, P):
    n = w.shape[0] // P
    return w[rank * n:(rank + 1) * n]


def tp_shard(w, t, rank, P):
    if t == W13:
        i = w.shape[1] // 2
        n = i // P
        return torch.cat([w[:, rank * n:(rank + 1) * n], w[:, i + rank * n:i + (rank + 1) * n]], 1)
    n = w.shape[2] // P
    return w[:, :, rank * n:(rank + 1) * n]


def check(mem, arena, layers, rank, mode):
    for l, tensors in enumerate(layers):
        for t, w in tensors.items():
            want = ep_shard(w, rank, arena.num_ranks) if mode == EP else tp_shard(
                w, t, rank, arena.num_ranks)
            got = torch.from_dlpack(mem.weight_view(arena, l, mode, t))
            assert torch.equal(got.cpu(), want), f"rank {rank} layer {l} {t} {mode}"


def shape_of(args):
    return moebius.ExpertShape(num_layers=args.layers, num_experts=args.experts,
                               hidden=args.hidden, intermediate=args.intermediate)


# --- torch baseline: EP -> TP with slice/cat packing and all_to_all_single -------------------
def torch_ep_to_tp(ep, P):
    """ep: per layer {W13: [E/P, 2I, H], W2: [E/P, H, I]} on this GPU -> the TP tensors."""
    out = []
    for tensors in ep:
        w13, w2 = tensors[W13], tensors[W2]
        i = w13.shape[1] // 2
        n = i // P
        send13 = torch.cat([torch.cat([w13[:, j * n:(j + 1) * n], w13[:, i + j * n:i + (j + 1) * n]], 1)
                            .reshape(-1) for j in range(P)])
        send2 = torch.cat([w2[:, :, j * n:(j + 1) * n].reshape(-1) for j in range(P)])
        recv13, recv2 = torch.empty_like(send13), torch.empty_like(send2)
        dist.all_to_all_single(recv13, send13)
        dist.all_to_all_single(recv2, send2)
        e = w13.shape[0]
        out.append({W13: recv13.view(P * e, 2 * n, w13.shape[2]),
                    W2: recv2.view(P, e, w2.shape[1], n).reshape(P * e, w2.shape[1], n)})
    return out


def timed(fn, iters):
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def rank_main(rank, P, args, path, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=P, device_id=torch.device("cuda", rank))
    shape = shape_of(args)
    arena = moebius.make_arena_geometry(shape, P)
    layers = load_experts(args, path)

    buffer = torch.empty(arena.total_bytes, dtype=torch.uint8, device="cuda")  # never moves
    mem = moebius.RankMemory(buffer)
    for l, tensors in enumerate(layers):
        for t, w in tensors.items():
            torch.from_dlpack(mem.weight_view(arena, l, EP, t)).copy_(ep_shard(w, rank, P))
    torch.cuda.synchronize()

    # IPC handles as bytes, carried by the engine's own process group.
    exchange = moebius.CudaPeerTransport.export_ipc(mem, rank, P)
    gathered = [None] * P
    dist.all_gather_object(gathered, exchange.local_info())
    transport = exchange.open(gathered)

    to_tp = moebius.plan_weight_switch(arena, 0, shape.num_layers)
    to_ep = moebius.plan_weight_switch(arena, shape.num_layers, 0)
    transport.execute(to_tp)
    check(mem, arena, layers, rank, TP)
    transport.execute(to_ep)
    check(mem, arena, layers, rank, EP)

    sent = to_tp.traffic().max_bytes_sent
    t_moebius = timed(lambda: (transport.execute(to_tp), transport.execute(to_ep)), args.iters) / 2
    ep = [{t: torch.from_dlpack(mem.weight_view(arena, l, EP, t)) for t in (W13, W2)}
          for l in range(shape.num_layers)]
    tp = torch_ep_to_tp(ep, P)
    for l, tensors in enumerate(layers):  # the baseline must be right too
        for t, w in tensors.items():
            assert torch.equal(tp[l][t].cpu(), tp_shard(w, t, rank, P)), f"baseline {l} {t}"
    t_torch = timed(lambda: torch_ep_to_tp(ep, P), args.iters)
    if rank == 0:
        print(f"EP->TP of {shape.num_layers} layers on {P} GPUs, {sent / 2**20:.1f} MiB sent per GPU:")
        print(f"  moebius CudaPeerTransport        {t_moebius * 1e3:8.3f} ms  "
              f"{sent / t_moebius / 1e9:7.1f} GB/s per GPU")
        print(f"  torch slice/cat + all_to_all     {t_torch * 1e3:8.3f} ms  "
              f"{sent / t_torch / 1e9:7.1f} GB/s per GPU")
        print("qwen3_moe_switch: ok")
    dist.barrier()
    dist.destroy_process_group()


def virtual_ranks(args, path):
    """P ranks in this process on GPU 0 (virtual ranks): the same checks, and the switch timed
    as copies inside one GPU, on the engine's own streams."""
    P = args.virtual_ranks or 2
    shape = shape_of(args)
    arena = moebius.make_arena_geometry(shape, P)
    layers = load_experts(args, path)
    buffers = [torch.empty(arena.total_bytes, dtype=torch.uint8, device="cuda:0") for _ in range(P)]
    ranks = [moebius.RankMemory(b) for b in buffers]
    for r, mem in enumerate(ranks):
        for l, tensors in enumerate(layers):
            for t, w in tensors.items():
                torch.from_dlpack(mem.weight_view(arena, l, EP, t)).copy_(ep_shard(w, r, P))
    torch.cuda.synchronize()
    transport = moebius.CudaPeerTransport.single_process(ranks)
    streams = [torch.cuda.Stream() for _ in range(P)]  # the engine's streams, one per rank
    handles = [s.cuda_stream for s in streams]
    to_tp = moebius.plan_weight_switch(arena, 0, shape.num_layers)
    to_ep = moebius.plan_weight_switch(arena, shape.num_layers, 0)
    transport.enqueue(to_tp, handles)
    transport.wait()
    for r, mem in enumerate(ranks):
        check(mem, arena, layers, r, TP)
    transport.enqueue(to_ep, handles)
    transport.wait()
    for r, mem in enumerate(ranks):
        check(mem, arena, layers, r, EP)

    def switch(plan):
        transport.enqueue(plan, handles)
        transport.wait()

    sent = to_tp.traffic().max_bytes_sent
    t = timed(lambda: (switch(to_tp), switch(to_ep)), args.iters) / 2
    print(f"EP->TP of {shape.num_layers} layers on {P} virtual ranks of one GPU, "
          f"{sent / 2**20:.1f} MiB sent per rank:")
    print(f"  moebius CudaPeerTransport        {t * 1e3:8.3f} ms  "
          f"{sent / t / 1e9:7.1f} GB/s per rank (copies inside one GPU)")
    print(f"qwen3_moe_switch: ok on {P} virtual ranks of one GPU")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=0,
                        help="GPUs to use, one process each (default: all; one GPU: virtual ranks)")
    parser.add_argument("--virtual-ranks", type=int, default=0, metavar="P",
                        help="P ranks in one process on GPU 0 instead (default with one GPU: 2)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    if not moebius.with_cuda:
        skip("moebius was built without CUDA")
    if not torch.cuda.is_available():
        skip("no CUDA device")
    gpus = args.gpus or torch.cuda.device_count()
    if gpus > torch.cuda.device_count():
        sys.exit(f"qwen3_moe_switch: --gpus {gpus} but {torch.cuda.device_count()} GPUs are visible")
    with tempfile.TemporaryDirectory() as tmpdir:
        path = os.path.join(tmpdir, "model.safetensors")
        write_checkpoint(args, path)
        if args.virtual_ranks or gpus < 2:
            return virtual_ranks(args, path)
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        tmp.spawn(rank_main, args=(gpus, args, path, port), nprocs=gpus, join=True)


if __name__ == "__main__":
    main()

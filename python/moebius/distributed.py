"""Transports across processes and hosts from a torch.distributed process group, as DeepEP's
``Buffer`` takes one: the group carries what ranks must exchange (CUDA IPC handles, NCCL's
unique id), so no caller writes an all-gather. Moebius itself never launches processes;
torch is imported only by the functions that take a group.

    import torch.distributed as dist, moebius, moebius.distributed as md
    dist.init_process_group("nccl")                      # the engine's own group
    mem = moebius.RankMemory(arena_tensor, kv_tensor)    # this process's rank, on its GPU
    transport = md.cuda_peer_transport(mem)              # one host: NVLink / PCIe peers
    transport = md.nccl_transport(mem, arena, kv)        # any hosts: NCCL send/recv

The group's rank is the Moebius rank and its size the deployment's P (num_ranks of the
geometries). Every rank of the group must make the same call, like any collective.
"""

from . import _moebius as _m


def _dist():
    # torch only where a group is used: nccl_workspace_bytes works without it.
    import torch.distributed as dist
    return dist


def _group_rank_size(group):
    dist = _dist()
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather_bytes(group):
    """all_gather(local: bytes) -> list[bytes] in group rank order, over `group`."""
    dist = _dist()

    def all_gather(local):
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        return gathered
    return all_gather


def _agree(all_gather, error, what):
    """Every rank learns whether every rank got through `what`: `error` is this rank's ("" when
    it did); all_gather(local) returns every rank's in rank order. Raises on every rank when any
    failed, naming each failed rank and its error, so that no rank goes on into a collective
    that a failed peer will never join (NCCL would block there without a timeout)."""
    errors = all_gather(error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        raise RuntimeError(f"moebius.distributed: {what} failed on rank(s) "
                           + "; ".join(f"{r}: {e}" for r, e in failed))


def cuda_peer_transport(memory, group=None, config=None):
    """CudaPeerTransport of this process's rank (RankMemory on its device) with every other
    rank of `group` (default: the default group) as a CUDA IPC peer: each exports its handles
    and the group all-gathers them. Ranks must share a host (NVLink or PCIe peers)."""
    rank, size = _group_rank_size(group)
    return _m.CudaPeerTransport.multi_process(memory, rank, size, _all_gather_bytes(group),
                                              config)


def nccl_workspace_bytes(arena, kv=None, rank=None, kv_bytes=None):
    """Staging bytes per rank that an NcclTransport running a switcher's plans needs: the
    larger of the two whole weight switches (EP->TP, TP->EP) for `rank` (default: the most
    over ranks), plus `kv_bytes` for KV rounds (default: the KV pool's bytes when `kv` is
    given, a bound that always holds; pass less when the engine knows its rounds are
    smaller: NcclTransport.validate names what is missing)."""
    L = arena.shape.num_layers
    plans = [_m.plan_weight_switch(arena, 0, L), _m.plan_weight_switch(arena, L, 0)]
    ranks = range(arena.num_ranks) if rank is None else [rank]
    weights = max(_m.NcclTransport.workspace_bytes(p, r) for p in plans for r in ranks)
    if kv_bytes is None:
        kv_bytes = kv.pool_bytes if kv is not None else 0
    return weights + kv_bytes


def nccl_communicator(group=None, device=None):
    """An NcclCommunicator over the ranks of `group`, this process on `device` (default: the
    current CUDA device): group rank 0 makes NCCL's unique id and the group broadcasts it.
    Joining blocks, with no timeout, until every rank of the group has joined: a rank that
    fails between the broadcast and its join leaves the others waiting (NCCL's blocking init)."""
    import torch
    dist = _dist()
    if device is None:
        device = torch.cuda.current_device()
    rank, size = _group_rank_size(group)
    box = [_m.nccl_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0,
                               group=group)
    return _m.NcclCommunicator(box[0], rank, size, device)


def nccl_transport(memory, arena=None, kv=None, group=None, workspace_bytes=None,
                   communicator=None, max_cached_plans=None):
    """NcclTransport of this process's rank over the ranks of `group`: a communicator made
    through the group (or `communicator`), a staging workspace of `workspace_bytes` (default:
    nccl_workspace_bytes(arena, kv) when `arena` is given, else none)."""
    if not _m.with_nccl:
        raise RuntimeError("moebius was built without NCCL (moebius.with_nccl is False): "
                           "build it where NCCL is found (MOEBIUS_WITH_NCCL=AUTO or ON)")
    all_gather = _all_gather_bytes(group)
    # Checks that can fail on one rank alone run on every rank and are agreed before NCCL's
    # unique id goes out, and the transport's allocations after: a rank that fails says so to
    # its peers instead of leaving them blocked in ncclCommInitRank or in the first switch.
    _agree(all_gather, "" if memory.device >= 0 else
           f"RankMemory is host memory (device {memory.device}): NCCL needs device memory",
           "nccl_transport (before the communicator)")
    comm = communicator or nccl_communicator(group, memory.device)
    transport, error = None, ""
    try:
        if workspace_bytes is None:
            workspace_bytes = nccl_workspace_bytes(arena, kv) if arena is not None else 0
        transport = _m.NcclTransport([memory], [comm], workspace_bytes,
                                     max_cached_plans=max_cached_plans)
    except Exception as e:  # noqa: BLE001 - every error is agreed, then raised everywhere
        error = f"{type(e).__name__}: {e}"
    _agree(all_gather, error, "nccl_transport (the workspace and the transport)")
    return transport

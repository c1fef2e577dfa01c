"""torch tensors shaped as vLLM's and SGLang's layers read them, over one rank's Moebius memory
in one mode (moebius.engine_views has the shapes and where they come from). Every tensor is a
view at a fixed address: capture one set of CUDA graphs with each mode's tensors and both
stay valid across switches (docs/INTEGRATION.md §4).

    import moebius, moebius.torch as mt
    params = mt.fused_moe_parameters(mem, arena, layer, moebius.Mode.EP)
    params["w13_weight"].shape  # (E/P, 2*I, H): vLLM's FusedMoE.w13_weight in EP
"""

import torch

from . import engine_views as _views
from ._moebius import KvCsr, KvTensor


def fused_moe_parameters(memory, geometry, layer, mode):
    """{"w13_weight", "w2_weight"[, "w13_weight_scale_inv", "w2_weight_scale_inv"]}: torch
    tensors (bf16/fp16/fp32/fp8 as the shape says) at the layer's arena addresses in `mode`,
    shaped exactly as vLLM's FusedMoE creates them for this rank's parallel layout."""
    out = {}
    for name, view in _views.fused_moe_views(memory, geometry, layer, mode).items():
        out[name] = torch.from_dlpack(view)
    return out


def all_fused_moe_parameters(memory, geometry, mode):
    """fused_moe_parameters of every MoE layer, in layer order."""
    return [fused_moe_parameters(memory, geometry, layer, mode)
            for layer in range(geometry.shape.num_layers)]


def assign_parameters(module, parameters):
    """Sets each tensor of `parameters` on `module` as a non-trainable torch.nn.Parameter
    sharing its storage (what vLLM's process_weights_after_loading does with its own
    tensors). Call it before capturing the mode's CUDA graphs and whenever the engine runs
    that mode eagerly; nothing is copied."""
    for name, tensor in parameters.items():
        setattr(module, name, torch.nn.Parameter(tensor, requires_grad=False))


def expert_map(geometry, mode, rank, device=None):
    """vLLM's FusedMoE.expert_map as an int32 tensor (global -> local expert, -1 elsewhere), or
    None in TP (and for one EP rank), as vLLM has it."""
    m = _views.expert_map(geometry, mode, rank)
    return None if m is None else torch.tensor(m, dtype=torch.int32, device=device)


def _pool_tensor(memory, kv, mode, layout):
    """The KV pool as one flat tensor of the pool's dtype (a view)."""
    pool = torch.from_dlpack(memory.kv_pool_view(kv, mode)).reshape(-1)
    if layout is not None and layout.pool_bytes > kv.pool_bytes:
        raise ValueError(f"moebius.torch: the layout addresses {layout.pool_bytes} bytes, more "
                         f"than the geometry's pool ({kv.pool_bytes}): view its buffers one by one")
    return pool


def _strided(memory, kv, mode, layout, view):
    offset, shape, strides = view
    return torch.as_strided(_pool_tensor(memory, kv, mode, layout), shape, strides, offset)


def flashinfer_kv_caches(memory, kv, mode, layout=None):
    """Per layer FlashInfer's ``(k_cache, v_cache)`` tuple in `mode` (NHD [pages, page_size,
    heads, dim] or HND [pages, heads, page_size, dim]) over `layout` (a KvPoolLayout; None: the
    present pool): pass it as ``paged_kv_cache``."""
    tensors = (KvTensor.K,) if kv.latent else (KvTensor.K, KvTensor.V)
    return [tuple(_strided(memory, kv, mode, layout,
                           _views.flashinfer_kv_layout(kv, mode, layer, t, layout))
                  for t in tensors) for layer in range(kv.num_layers)]


def vllm_kv_caches(memory, kv, mode, layout=None):
    """Per layer vLLM's FlashInfer-backend kv_cache tensor (num_blocks, 2, block_size,
    num_kv_heads, head_size) over `layout`: vLLM's own with moebius.vllm_flashinfer_layout(kv),
    strided over the present pool (K and V regions apart) with None."""
    return [_strided(memory, kv, mode, layout, _views.vllm_kv_layout(kv, mode, layer, layout))
            for layer in range(kv.num_layers)]


def sglang_kv_buffers(memory, kv, mode, layout=None):
    """(k_buffer, v_buffer): SGLang's per-layer lists of [tokens, heads, head_dim] over
    `layout` (a token-major pool: NHD present, or moebius.sglang_mha_layout(kv))."""
    return tuple([_strided(memory, kv, mode, layout,
                           _views.sglang_kv_layout(kv, mode, layer, t, layout))
                  for layer in range(kv.num_layers)] for t in (KvTensor.K, KvTensor.V))


def kv_csr(tables, rank, dtype=torch.int32, seq_ids=None, device=None, non_blocking=True):
    """CSR page tables of `rank` (FlashInfer's indptr, indices, last_page_len, plus seq_ids)
    as a KvCsr of torch tensors: `tables` is a Switcher, a KvState or a KvRankState. On the
    CPU they share the arrays csr() made (torch.from_numpy); with `device` they are copied
    there."""
    name = str(dtype).replace("torch.", "")
    ids = None if seq_ids is None else (seq_ids.cpu().numpy() if torch.is_tensor(seq_ids)
                                        else seq_ids)
    if hasattr(tables, "kv_csr"):
        arrays = tables.kv_csr(rank, name, ids)
    elif hasattr(tables, "ranks"):
        arrays = tables.csr(rank, name, ids)
    else:
        arrays = tables.csr(name, ids)

    def tensor(array):
        t = torch.from_numpy(array)
        return t if device is None else t.to(device, non_blocking=non_blocking)
    return KvCsr(seq_ids=tensor(arrays.seq_ids), indptr=tensor(arrays.indptr),
                 indices=tensor(arrays.indices), last_page_len=tensor(arrays.last_page_len))

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
from ._moebius import KvTensor



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


def _pool_tensor(memory, kv, mode):
    """The KV pool as one flat tensor of the pool's dtype (a view)."""
    pool = torch.from_dlpack(memory.kv_pool_view(kv, mode))
    return pool.reshape(-1)


def _strided(memory, kv, mode, layout):
    offset, shape, strides = layout
    return torch.as_strided(_pool_tensor(memory, kv, mode), shape, strides, offset)


def flashinfer_kv_caches(memory, kv, mode):
    """Per layer FlashInfer's ``(k_cache, v_cache)`` tuple in `mode` (NHD [pages, page_size,
    heads, dim] or HND [pages, heads, page_size, dim]): pass it as ``paged_kv_cache``."""
    tensors = (KvTensor.K,) if kv.latent else (KvTensor.K, KvTensor.V)
    return [tuple(_strided(memory, kv, mode, _views.flashinfer_kv_layout(kv, mode, layer, t))
                  for t in tensors) for layer in range(kv.num_layers)]


def vllm_kv_caches(memory, kv, mode):
    """Per layer vLLM's FlashInfer-backend kv_cache tensor (num_blocks, 2, block_size,
    num_kv_heads, head_size), strided over the pool (K and V regions apart)."""
    return [_strided(memory, kv, mode, _views.vllm_kv_layout(kv, mode, layer))
            for layer in range(kv.num_layers)]


def sglang_kv_buffers(memory, kv, mode):
    """(k_buffer, v_buffer): SGLang's per-layer lists of [tokens, heads, head_dim] (NHD pool)."""
    return tuple([_strided(memory, kv, mode, _views.sglang_kv_layout(kv, mode, layer, t))
                  for layer in range(kv.num_layers)] for t in (KvTensor.K, KvTensor.V))


def kv_csr(tables, rank, dtype=torch.int32, seq_ids=None, device=None, non_blocking=True):
    """CSR page tables of `rank` (FlashInfer's indptr, indices, last_page_len, plus seq_ids)
    as torch tensors: `tables` is a Switcher, a KvState or a KvRankState. On the CPU they share
    the arrays csr() made (torch.from_numpy); with `device` they are copied there."""
    name = str(dtype).replace("torch.", "")
    ids = None if seq_ids is None else (seq_ids.cpu().numpy() if torch.is_tensor(seq_ids)
                                        else seq_ids)
    if hasattr(tables, "kv_csr"):
        arrays = tables.kv_csr(rank, name, ids)
    elif hasattr(tables, "ranks"):
        arrays = tables.csr(rank, name, ids)
    else:
        arrays = tables.csr(name, ids)
    out = {k: torch.from_numpy(v) for k, v in arrays.items()}
    if device is not None:
        out = {k: v.to(device, non_blocking=non_blocking) for k, v in out.items()}
    return out

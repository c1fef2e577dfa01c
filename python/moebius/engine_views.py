"""What an existing engine's layers read, as views of one rank's Moebius memory in one mode.

Weights (docs/INTEGRATION.md §2): vLLM's and SGLang's FusedMoE parameters per layer,
``w13_weight [E_local, 2*I_local, H]`` (gate rows then up rows), ``w2_weight [E_local, H,
I_local]`` and, block-quantised fp8, ``w13_weight_scale_inv [E_local, 2*I_local/block_n,
H/block_k]``, ``w2_weight_scale_inv [E_local, H/block_n, I_local/block_k]``, where EP has
``E_local = E/P, I_local = I`` and TP ``E_local = E, I_local = I/P``. The arena's views have
exactly these shapes, so they are the parameters, at fixed addresses.

KV (docs/INTEGRATION.md §3): the pool is ``[L][K|V][page]`` regions, so per layer

* FlashInfer's ``(k_cache, v_cache)`` tuple is two plain views (``flashinfer_kv_layout``);
* vLLM's FlashInfer-backend tensor ``(num_blocks, 2, block_size, num_kv_heads, head_size)``
  is one strided view whose K|V dimension steps over a whole region (``vllm_kv_layout``);
* SGLang's per-layer ``k_buffer[l]`` / ``v_buffer[l]`` of ``[num_tokens, heads, head_dim]``
  (token = page * page_size + slot) is a view of an NHD pool (``sglang_kv_layout``).

Each ``*_layout`` function returns ``(offset, shape, strides)`` in elements of the pool's
dtype: ``torch.as_strided(pool, shape, strides, offset)`` (moebius.torch does this) or, in
bytes, numpy's ``as_strided`` (the CPU tests) give the view without a copy. No array library
is imported here.
"""

from . import _moebius as _m

EP, TP = _m.Mode.EP, _m.Mode.TP

#: vLLM's parameter name of each arena tensor (vllm/model_executor/layers/fused_moe/layer.py
#: UnquantizedFusedMoEMethod.create_weights; quantization/fp8.py Fp8MoEMethod for the scales).
VLLM_PARAMETER_NAMES = {
    _m.WeightTensor.w13: "w13_weight",
    _m.WeightTensor.w2: "w2_weight",
    _m.WeightTensor.w13_scale: "w13_weight_scale_inv",
    _m.WeightTensor.w2_scale: "w2_weight_scale_inv",
}


def _tensors(geometry):
    names = [_m.WeightTensor.w13, _m.WeightTensor.w2]
    if geometry.shape.block_scales:
        names += [_m.WeightTensor.w13_scale, _m.WeightTensor.w2_scale]
    return names


def fused_moe_views(memory, geometry, layer, mode, raw=False):
    """One layer's FusedMoE parameters of this rank in `mode`, named as vLLM and SGLang name
    them ({"w13_weight", "w2_weight"[, "w13_weight_scale_inv", "w2_weight_scale_inv"]}), as
    DLPack tensors at their fixed arena addresses (see the module docstring for the shapes)."""
    return {VLLM_PARAMETER_NAMES[t]: memory.weight_view(geometry, layer, mode, t, raw=raw)
            for t in _tensors(geometry)}


def local_experts(geometry, mode, rank):
    """(first, count): the global experts rank `rank` holds in `mode`: EP
    [rank*E/P, (rank+1)*E/P), TP all E (each an intermediate slice)."""
    E, P = geometry.shape.num_experts, geometry.num_ranks
    if mode == TP:
        return 0, E
    return rank * (E // P), E // P


def expert_map(geometry, mode, rank):
    """vLLM's FusedMoE.expert_map for this rank in `mode`, as a list: global expert id ->
    local index, -1 where another rank holds it (layer.py determine_expert_map, for P | E).
    None where vLLM has none: TP (every rank holds every expert) and EP with one rank."""
    E, P = geometry.shape.num_experts, geometry.num_ranks
    if mode == TP or P == 1:
        return None
    first, count = local_experts(geometry, mode, rank)
    return [e - first if first <= e < first + count else -1 for e in range(E)]


def _kv_elements(kv):
    """Elements of one head row (head_dim), page and region, and the element size."""
    item = kv.head_bytes // kv.head_dim
    return item, kv.region_bytes // item


def _page_strides(kv, mode):
    """Element strides of (page, token, head, dim) in `mode`'s pages of this pool."""
    item, _ = _kv_elements(kv)
    heads = kv.heads_per_ep_page if mode == EP else kv.heads_per_tp_page
    D, T = kv.head_dim, kv.page_size
    page = kv.page_bytes(mode) // item
    if kv.layout == _m.KvLayout.HND:  # [head][token][dim]
        return page, D, T * D, 1, heads
    return page, heads * D, D, 1, heads  # NHD [token][head][dim]


def flashinfer_kv_layout(kv, mode, layer, tensor):
    """K (tensor=KvTensor.K) or V of `layer`, as FlashInfer's wrappers take each half of
    their ``(k_cache, v_cache)`` tuple: NHD [pages, page_size, heads, head_dim], HND [pages,
    heads, page_size, head_dim] (contiguous). Returns (offset, shape, strides) in elements."""
    item, _ = _kv_elements(kv)
    page, tok, head, dim, heads = _page_strides(kv, mode)
    offset = kv.tensor_offset(layer, tensor) // item
    n = kv.num_pages(mode)
    if kv.layout == _m.KvLayout.HND:
        return offset, (n, heads, kv.page_size, kv.head_dim), (page, head, tok, dim)
    return offset, (n, kv.page_size, heads, kv.head_dim), (page, tok, head, dim)


def vllm_kv_layout(kv, mode, layer):
    """`layer`'s KV as vLLM's FlashInfer backend shapes it, (num_blocks, 2, block_size,
    num_kv_heads, head_size) (vllm/v1/attention/backends/flashinfer.py get_kv_cache_shape),
    with num_kv_heads this rank's heads per page in `mode`. vLLM allocates it with K and V of
    one block side by side; here dimension 1 steps from the K region to the V region, so it
    is a strided view (FlashInfer reads it through its strides after ``unbind(1)``). Needs K
    and V (no latent KV). Returns (offset, shape, strides) in elements."""
    if kv.latent:
        raise ValueError("vllm_kv_layout: latent (MLA) KV has no V; use flashinfer_kv_layout")
    item, region = _kv_elements(kv)
    page, tok, head, dim, heads = _page_strides(kv, mode)
    offset = kv.tensor_offset(layer, _m.KvTensor.K) // item
    return (offset, (kv.num_pages(mode), 2, kv.page_size, heads, kv.head_dim),
            (page, region, tok, head, dim))


def sglang_kv_layout(kv, mode, layer, tensor):
    """SGLang's MHATokenToKVPool per-layer buffer, k_buffer[layer] or v_buffer[layer]:
    [num_pages * page_size, heads, head_dim] indexed by token slot (page * page_size + slot)
    (python/sglang/srt/mem_cache/memory_pool.py _create_buffers). Only an NHD pool is
    token-major; raises ValueError for HND. Returns (offset, shape, strides) in elements."""
    if kv.layout != _m.KvLayout.NHD:
        raise ValueError("sglang_kv_layout: SGLang's buffers are token-major; make the KV "
                         "geometry with layout=KvLayout.NHD")
    item, _ = _kv_elements(kv)
    page, tok, head, dim, heads = _page_strides(kv, mode)
    offset = kv.tensor_offset(layer, tensor) // item
    return offset, (kv.num_pages(mode) * kv.page_size, heads, kv.head_dim), (tok, head, dim)

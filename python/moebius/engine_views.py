"""What an existing engine's layers read, as views of one rank's Moebius memory in one mode.

Weights (docs/INTEGRATION.md §2): vLLM's and SGLang's FusedMoE parameters per layer,
``w13_weight [E_local, 2*I_local, H]`` (gate rows then up rows), ``w2_weight [E_local, H,
I_local]`` and, block-quantised fp8, ``w13_weight_scale_inv [E_local, 2*I_local/block_n,
H/block_k]``, ``w2_weight_scale_inv [E_local, H/block_n, I_local/block_k]``, where EP has
``E_local = E/P, I_local = I`` and TP ``E_local = E, I_local = I/P``. The arena's views have
exactly these shapes, so they are the parameters, at fixed addresses.

KV (docs/INTEGRATION.md §3): where a rank's KV bytes lie is a ``KvPoolLayout`` from the C++
library (kv/kv_pool_layout.hpp), the one source of the layouts: ``moebius.present_kv_layout(kv)``
(Moebius's own ``[L][K|V][page]`` regions, the default here) or an engine's own,
``moebius.vllm_flashinfer_layout(kv)``, ``vllm_flash_attn_layout(kv)``,
``sglang_mha_layout(kv)`` (the layout a ``Switcher(kv_layout=...)`` migrates the cache in).
Each function below reads the strides of that layout's view in one mode and shapes one layer
as an engine's kernels take it:

* FlashInfer's ``(k_cache, v_cache)`` tuple, two views (``flashinfer_kv_layout``);
* vLLM's FlashInfer-backend tensor ``(num_blocks, 2, block_size, num_kv_heads, head_size)``
  (``vllm_kv_layout``): over vLLM's own layout the tensor vLLM allocates; over the present
  pool a strided view whose K|V dimension steps over a whole region;
* SGLang's per-layer ``k_buffer[l]`` / ``v_buffer[l]`` of ``[num_tokens, heads, head_dim]``
  (token = page * page_size + slot), a view of a pool whose pages are consecutive token slots
  (``sglang_kv_layout``: NHD, present or SGLang's layout).

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


def _strides(kv, mode, layout):
    """(element size, the byte strides of `mode`'s view): the C++ layout's, `layout` or the
    present pool's."""
    pool = _m.present_kv_layout(kv) if layout is None else layout
    return kv.head_bytes // kv.head_dim, pool.view(mode)


def _heads(kv, mode):
    return kv.heads_per_ep_page if mode == EP else kv.heads_per_tp_page


def flashinfer_kv_layout(kv, mode, layer, tensor, layout=None):
    """K (tensor=KvTensor.K) or V of `layer`, as FlashInfer's wrappers take each half of
    their ``(k_cache, v_cache)`` tuple: NHD [pages, page_size, heads, head_dim], HND [pages,
    heads, page_size, head_dim], over `layout` (a KvPoolLayout; None: the present pool).
    Returns (offset, shape, strides) in elements."""
    item, s = _strides(kv, mode, layout)
    offset = s.tensor(layer, tensor) // item
    n, heads = kv.num_pages(mode), _heads(kv, mode)
    page, tok, head, dim = (s.page // item, s.token // item, s.head // item, s.dim // item)
    if kv.layout == _m.KvLayout.HND:
        return offset, (n, heads, kv.page_size, kv.head_dim), (page, head, tok, dim)
    return offset, (n, kv.page_size, heads, kv.head_dim), (page, tok, head, dim)


def vllm_kv_layout(kv, mode, layer, layout=None):
    """`layer`'s KV as vLLM's FlashInfer backend shapes it, (num_blocks, 2, block_size,
    num_kv_heads, head_size) (vllm/v1/attention/backends/flashinfer.py get_kv_cache_shape),
    with num_kv_heads this rank's heads per page in `mode`, over `layout` (None: the present
    pool). Over ``moebius.vllm_flashinfer_layout(kv)`` it is the tensor vLLM allocates (K and V
    of one block side by side); over the present pool dimension 1 steps from the K region to
    the V region, a strided view (FlashInfer reads it through its strides after
    ``unbind(1)``). Needs K and V (no latent KV). Returns (offset, shape, strides) in
    elements."""
    if kv.latent:
        raise ValueError("vllm_kv_layout: latent (MLA) KV has no V; use flashinfer_kv_layout")
    item, s = _strides(kv, mode, layout)
    offset = s.tensor(layer, _m.KvTensor.K) // item
    return (offset, (kv.num_pages(mode), 2, kv.page_size, _heads(kv, mode), kv.head_dim),
            (s.page // item, s.kv // item, s.token // item, s.head // item, s.dim // item))


def sglang_kv_layout(kv, mode, layer, tensor, layout=None):
    """SGLang's MHATokenToKVPool per-layer buffer, k_buffer[layer] or v_buffer[layer]:
    [num_pages * page_size, heads, head_dim] indexed by token slot (page * page_size + slot)
    (python/sglang/srt/mem_cache/memory_pool.py _create_buffers), over `layout` (None: the
    present pool; ``moebius.sglang_mha_layout(kv)``: SGLang's own buffers). Only a token-major
    pool (NHD, each page page_size consecutive token slots) is one; raises ValueError for
    another. Returns (offset, shape, strides) in elements."""
    if kv.layout != _m.KvLayout.NHD:
        raise ValueError("sglang_kv_layout: SGLang's buffers are token-major; make the KV "
                         "geometry with layout=KvLayout.NHD")
    item, s = _strides(kv, mode, layout)
    if s.page != kv.page_size * s.token:
        raise ValueError(f"sglang_kv_layout: the pages of this layout ({s}) are not "
                         f"consecutive token slots (page stride {s.page} != page_size "
                         f"{kv.page_size} x token stride {s.token})")
    offset = s.tensor(layer, tensor) // item
    return (offset, (kv.num_pages(mode) * kv.page_size, _heads(kv, mode), kv.head_dim),
            (s.token // item, s.head // item, s.dim // item))

"""Views an existing engine reads, on the CPU with numpy: vLLM's FusedMoE parameters in both
modes (shapes from vLLM's create_weights formulas, contents from its weight loader's
narrowing, both written out here independently of the library) before and after a real
switch; vLLM's expert_map; the KV pool as FlashInfer's (k, v) tuple, vLLM's FlashInfer-backend
tensor and SGLang's per-layer token buffers, every element checked against
KvGeometry.offset."""

import numpy as np
import pytest

import moebius
from conftest import host_memory, raw_view
from moebius import engine_views as ev

EP, TP = moebius.Mode.EP, moebius.Mode.TP
W13, W2 = moebius.WeightTensor.w13, moebius.WeightTensor.w2
S13, S2 = moebius.WeightTensor.w13_scale, moebius.WeightTensor.w2_scale


def cdiv(a, b):
    return -(-a // b)


def vllm_shapes(shape, P, mode):
    """vLLM: UnquantizedFusedMoEMethod / Fp8MoEMethod.create_weights with num_experts =
    local_num_experts and intermediate_size_per_partition = I / moe tp_size (EP: tp 1)."""
    E, H, I = shape.num_experts, shape.hidden, shape.intermediate
    e, i = (E // P, I) if mode == EP else (E, I // P)
    out = {"w13_weight": (e, 2 * i, H), "w2_weight": (e, H, i)}
    if shape.block_scales:
        bn, bk = shape.scale_block_n, shape.scale_block_k
        out["w13_weight_scale_inv"] = (e, 2 * cdiv(i, bn), cdiv(H, bk))
        out["w2_weight_scale_inv"] = (e, cdiv(H, bn), cdiv(i, bk))
    return out


def vllm_load(full, name, mode, rank, P):
    """What vLLM's FusedMoE.weight_loader puts in this rank's parameter: EP experts
    [r*E/P, (r+1)*E/P) whole; TP _load_w13 (gate rows narrowed to shard r into the first
    half, up rows into the second) and _load_w2 (columns narrowed to shard r)."""
    E = full.shape[0]
    if mode == EP:
        return full[rank * (E // P):(rank + 1) * (E // P)]
    if name.startswith("w13"):
        half = full.shape[1] // 2
        shard = half // P
        gate = full[:, shard * rank:shard * (rank + 1)]
        up = full[:, half + shard * rank:half + shard * (rank + 1)]
        if isinstance(full, np.ndarray):
            return np.concatenate([gate, up], axis=1)
        import torch  # the GPU test (test_torch_views) loads torch tensors through this
        return torch.cat([gate, up], dim=1)
    shard = full.shape[2] // P
    return full[:, :, shard * rank:shard * (rank + 1)]


def determine_expert_map(ep_size, ep_rank, E):
    """vLLM layer.py determine_expert_map, as a list (None when ep_size == 1)."""
    if ep_size == 1:
        return None
    base, rem = divmod(E, ep_size)
    local = base + 1 if ep_rank < rem else base
    start = ep_rank * base + min(ep_rank, rem)
    return [e - start if start <= e < start + local else -1 for e in range(E)]


@pytest.mark.parametrize("scales", [False, True])
@pytest.mark.parametrize("P", [1, 2, 4])
def test_fused_moe_views_are_vllms_parameters_in_both_modes(rng, scales, P):
    if scales:  # fp8 weights with 128x128 block scales; I/P a multiple of 128 (vLLM's check)
        shape = moebius.ExpertShape(num_layers=2, num_experts=4, hidden=256,
                                    intermediate=128 * P, weight_dtype=moebius.DType.fp8_e4m3,
                                    block_scales=True)
    else:
        shape = moebius.ExpertShape(num_layers=2, num_experts=4 * int(rng.integers(1, 3)),
                                    hidden=16 * int(rng.integers(1, 4)),
                                    intermediate=8 * P * int(rng.integers(1, 3)))
    arena = moebius.make_arena_geometry(shape, P)
    ranks = [moebius.RankMemory(host_memory(arena.total_bytes)) for _ in range(P)]
    tensors = [W13, W2] + ([S13, S2] if scales else [])
    names = dict(zip(tensors, ["w13_weight", "w2_weight", "w13_weight_scale_inv",
                               "w2_weight_scale_inv"]))
    # Full (unsharded) tensors of every layer, as a checkpoint holds them, in raw integers.
    full = []
    for _ in range(shape.num_layers):
        layer = {}
        for t in tensors:
            s = moebius.weight_view_shape(shape, 1, EP, t)
            dtype = np.uint32 if t in (S13, S2) else (np.uint8 if scales else np.uint16)
            layer[names[t]] = rng.integers(0, np.iinfo(dtype).max, s, dtype=dtype)
        full.append(layer)
    for r, mem in enumerate(ranks):
        for layer in range(shape.num_layers):
            for t in tensors:
                raw_view(mem, arena, layer, EP, t)[...] = vllm_load(full[layer][names[t]],
                                                                     names[t], EP, r, P)
    transport = moebius.HostTransport(ranks)
    for mode, plan in ((EP, None), (TP, moebius.plan_weight_switch(arena, 0, 2)),
                       (EP, moebius.plan_weight_switch(arena, 2, 0))):
        if plan is not None:
            transport.execute(plan)
        want_shapes = vllm_shapes(shape, P, mode)
        for r, mem in enumerate(ranks):
            for layer in range(shape.num_layers):
                views = ev.fused_moe_views(mem, arena, layer, mode, raw=True)
                assert set(views) == set(want_shapes)
                for name, view in views.items():
                    got = np.from_dlpack(view)
                    assert got.shape == want_shapes[name], (mode, name)
                    np.testing.assert_array_equal(
                        got, vllm_load(full[layer][name], name, mode, r, P),
                        err_msg=f"{mode} rank {r} layer {layer} {name}")
                # Fixed addresses: the same view twice is the same memory.
                again = ev.fused_moe_views(mem, arena, layer, mode, raw=True)
                assert np.from_dlpack(again["w13_weight"]).ctypes.data == \
                    np.from_dlpack(views["w13_weight"]).ctypes.data


@pytest.mark.parametrize("E,P", [(8, 1), (8, 2), (8, 4), (16, 8), (4, 4)])
def test_expert_map_is_vllms(E, P):
    shape = moebius.ExpertShape(num_layers=1, num_experts=E, hidden=16, intermediate=8 * P)
    arena = moebius.make_arena_geometry(shape, P)
    for r in range(P):
        assert ev.expert_map(arena, EP, r) == determine_expert_map(P, r, E)
        assert ev.expert_map(arena, TP, r) is None
        first, count = ev.local_experts(arena, EP, r)
        assert (first, count) == (r * E // P, E // P)
        assert ev.local_experts(arena, TP, r) == (0, E)


def strided(pool_bytes, itemsize, layout):
    """numpy's as_strided of an (offset, shape, strides) layout in elements, on raw ints."""
    offset, shape, strides = layout
    base = pool_bytes.view({2: np.uint16, 1: np.uint8, 4: np.uint32}[itemsize])
    return np.lib.stride_tricks.as_strided(base[offset:], shape,
                                           tuple(s * itemsize for s in strides), writeable=False)


def element(pool_bytes, itemsize, byte_offset):
    return int.from_bytes(pool_bytes[byte_offset:byte_offset + itemsize].tobytes(), "little")


@pytest.mark.parametrize("layout", [moebius.KvLayout.HND, moebius.KvLayout.NHD])
@pytest.mark.parametrize("heads,P", [(4, 2), (2, 4), (4, 1), (8, 4)])
def test_kv_views_for_flashinfer_vllm_and_sglang(rng, layout, heads, P):
    kv = moebius.make_kv_geometry(num_layers=2, num_kv_heads=heads, head_dim=4,
                                  page_size=int(rng.integers(1, 5)), num_ep_pages=3,
                                  num_ranks=P, layout=layout)
    pool = rng.integers(0, 256, kv.pool_bytes, dtype=np.uint8)
    item = kv.head_bytes // kv.head_dim
    K, V = moebius.KvTensor.K, moebius.KvTensor.V
    for mode in (EP, TP):
        heads_page = kv.heads_per_ep_page if mode == EP else kv.heads_per_tp_page
        for layer in range(kv.num_layers):
            fi = {t: strided(pool, item, ev.flashinfer_kv_layout(kv, mode, layer, t))
                  for t in (K, V)}
            vl = strided(pool, item, ev.vllm_kv_layout(kv, mode, layer))
            assert vl.shape == (kv.num_pages(mode), 2, kv.page_size, heads_page, kv.head_dim)
            sg = None
            if layout == moebius.KvLayout.NHD:
                sg = {t: strided(pool, item, ev.sglang_kv_layout(kv, mode, layer, t))
                      for t in (K, V)}
                assert sg[K].shape == (kv.num_pages(mode) * kv.page_size, heads_page,
                                       kv.head_dim)
            else:
                with pytest.raises(ValueError, match="NHD"):
                    ev.sglang_kv_layout(kv, mode, layer, K)
            for ti, t in enumerate((K, V)):
                for p in range(kv.num_pages(mode)):
                    for h in range(heads_page):
                        for s in range(kv.page_size):
                            for d in range(kv.head_dim):
                                want = element(pool, item,
                                               kv.offset(mode, layer, t, p, h, s, d))
                                fi_at = (p, h, s, d) if layout == moebius.KvLayout.HND \
                                    else (p, s, h, d)
                                assert fi[t][fi_at] == want, (mode, layer, t, p, h, s, d)
                                assert vl[p, ti, s, h, d] == want
                                if sg is not None:
                                    assert sg[t][p * kv.page_size + s, h, d] == want


def test_latent_kv_has_no_vllm_pair():
    kv = moebius.make_kv_geometry(2, 0, 8, 4, 4, 2)  # MLA: one tensor, no V
    with pytest.raises(ValueError, match="latent"):
        ev.vllm_kv_layout(kv, EP, 0)
    offset, shape, _ = ev.flashinfer_kv_layout(kv, EP, 1, moebius.KvTensor.K)
    assert shape == (4, 1, 4, 8) and offset == kv.tensor_offset(1, moebius.KvTensor.K) // 2


def c_strides(shape):
    """Element strides of a C-contiguous array of `shape`."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


@pytest.mark.parametrize("layout", [moebius.KvLayout.HND, moebius.KvLayout.NHD])
@pytest.mark.parametrize("heads,P", [(4, 2), (2, 4), (4, 1)])
def test_views_over_the_engines_own_layouts_are_their_tensors(layout, heads, P):
    """Over the C++ presets (one source of the layouts) the views are the tensors each engine
    allocates, written out here from the engines' shapes: vLLM FlashInfer per layer (num_blocks,
    2, block_size, H, D), FlashAttention (2, num_blocks, block_size, H, D), both contiguous in
    stride order (0, 1, 3, 2, 4) when HND; SGLang's k_buffer[l] / v_buffer[l] contiguous
    [tokens, H, D]; the layers back to back. In TP an engine over the same buffer sees
    num_blocks * split blocks of its heads."""
    N, T, D = 5, 3, 4
    kv = moebius.make_kv_geometry(num_layers=2, num_kv_heads=heads, head_dim=D, page_size=T,
                                  num_ep_pages=N, num_ranks=P, layout=layout)
    hnd = layout == moebius.KvLayout.HND
    K, V = moebius.KvTensor.K, moebius.KvTensor.V
    layer_elems = 2 * N * heads * T * D  # one layer's K and V, in elements
    flashinfer = moebius.vllm_flashinfer_layout(kv)
    flash_attn = moebius.vllm_flash_attn_layout(kv)
    assert flashinfer.preset == moebius.KvPreset.vllm_flashinfer
    assert flash_attn == moebius.kv_preset_layout(moebius.KvPreset.vllm_flash_attn, kv)
    for mode in (EP, TP):
        h = heads if mode == EP else max(1, heads // P)
        n = N * (heads // h)
        for layer in range(kv.num_layers):
            # vLLM FlashInfer: the tensor vLLM allocates.
            offset, shape, strides = ev.vllm_kv_layout(kv, mode, layer, flashinfer)
            assert offset == layer * layer_elems and shape == (n, 2, T, h, D)
            if hnd:  # physically (n, 2, h, T, D)
                c = c_strides((n, 2, h, T, D))
                assert strides == (c[0], c[1], c[3], c[2], c[4])
            else:
                assert strides == c_strides((n, 2, T, h, D))
            # vLLM FlashAttention: K of every block, then V; FlashInfer's (k, v) halves of it.
            for ti, t in enumerate((K, V)):
                offset, shape, strides = ev.flashinfer_kv_layout(kv, mode, layer, t, flash_attn)
                assert offset == layer * layer_elems + ti * N * heads * T * D
                assert shape == ((n, h, T, D) if hnd else (n, T, h, D))
                assert strides == c_strides(shape)
            if not hnd:
                # SGLang: k_buffer[l], v_buffer[l], contiguous token-major.
                sglang = moebius.sglang_mha_layout(kv)
                for ti, t in enumerate((K, V)):
                    offset, shape, strides = ev.sglang_kv_layout(kv, mode, layer, t, sglang)
                    assert offset == layer * layer_elems + ti * N * heads * T * D
                    assert shape == (n * T, h, D) and strides == c_strides(shape)
                # vLLM FlashInfer's blocks interleave K and V: no token-major buffer over it.
                with pytest.raises(ValueError, match="consecutive token slots"):
                    ev.sglang_kv_layout(kv, mode, layer, K, flashinfer)
    if hnd:
        with pytest.raises(moebius.Error) as e:
            moebius.sglang_mha_layout(kv)  # SGLang's buffers are token-major
        assert e.value.code == "invalid_argument"

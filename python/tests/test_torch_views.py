"""moebius.torch on the GPU: vLLM-shaped FusedMoE parameters (dtype, shape, address) in both
modes after a real switch on the CUDA peer transport, their contents against vLLM's loader
narrowing (test_engine_views.vllm_load), and the KV views FlashInfer, vLLM and SGLang read,
checked against the numpy views of the same bytes copied to the host. Marked `gpu`.

Run on the device: python -m pytest -q -m gpu python/tests/test_torch_views.py
"""

import numpy as np
import pytest

import moebius
from test_engine_views import strided, vllm_load, vllm_shapes

torch = pytest.importorskip("torch")
import moebius.torch as mt  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not moebius.with_cuda, reason="moebius was built without CUDA"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

EP, TP = moebius.Mode.EP, moebius.Mode.TP


def test_fused_moe_parameters_on_the_device_follow_a_switch():
    P = 2  # virtual ranks on one device when there is one
    shape = moebius.ExpertShape(num_layers=2, num_experts=8, hidden=128, intermediate=64)
    arena = moebius.make_arena_geometry(shape, P)
    g = torch.Generator().manual_seed(5)
    full = [{n: torch.randn(moebius.weight_view_shape(shape, 1, EP, t), generator=g)
             .to(torch.bfloat16) for n, t in (("w13_weight", moebius.WeightTensor.w13),
                                               ("w2_weight", moebius.WeightTensor.w2))}
            for _ in range(2)]
    n = torch.cuda.device_count()
    buffers = [torch.full((arena.total_bytes,), 0xAB, dtype=torch.uint8, device=f"cuda:{r % n}")
               for r in range(P)]
    mems = [moebius.RankMemory(b) for b in buffers]
    for r, mem in enumerate(mems):
        for layer in range(2):
            for name, p in mt.fused_moe_parameters(mem, arena, layer, EP).items():
                p.copy_(vllm_load(full[layer][name], name, EP, r, P))
    torch.cuda.synchronize()
    transport = moebius.CudaPeerTransport.single_process(mems)
    for mode, plan in ((TP, moebius.plan_weight_switch(arena, 0, 2)),
                       (EP, moebius.plan_weight_switch(arena, 2, 0))):
        transport.execute(plan)
        for r, mem in enumerate(mems):
            for layer in range(2):
                params = mt.fused_moe_parameters(mem, arena, layer, mode)
                for name, p in params.items():
                    assert p.dtype == torch.bfloat16 and p.is_cuda and p.is_contiguous()
                    assert tuple(p.shape) == vllm_shapes(shape, P, mode)[name]
                    want = vllm_load(full[layer][name], name, mode, r, P)
                    assert torch.equal(p.cpu(), want), (mode, r, layer, name)
                module = torch.nn.Module()
                mt.assign_parameters(module, params)
                assert module.w13_weight.data_ptr() == params["w13_weight"].data_ptr()
                assert not module.w13_weight.requires_grad
            m = mt.expert_map(arena, mode, 1, device="cuda")
            assert (m is None) == (mode == TP)
            if m is not None:
                assert m.dtype == torch.int32 and m.tolist() == moebius.expert_map(arena, EP, 1)


@pytest.mark.parametrize("layout", [moebius.KvLayout.HND, moebius.KvLayout.NHD])
def test_kv_views_on_the_device(layout):
    """Over the present pool and over each engine's own layout (the C++ presets)."""
    kv = moebius.make_kv_geometry(2, 4, 8, 4, 6, 2, layout=layout)
    host = np.random.default_rng(7).integers(0, 256, kv.pool_bytes, dtype=np.uint8)
    pool = torch.from_numpy(host).cuda()
    mem = moebius.RankMemory(torch.zeros(256, dtype=torch.uint8, device="cuda"), pool)
    K, V = moebius.KvTensor.K, moebius.KvTensor.V
    ev = moebius.engine_views
    pool_layouts = [None, moebius.vllm_flashinfer_layout(kv), moebius.vllm_flash_attn_layout(kv)]
    if layout == moebius.KvLayout.NHD:
        pool_layouts.append(moebius.sglang_mha_layout(kv))
    as_u16 = lambda t: t.view(torch.int16).cpu().numpy().view(np.uint16)  # noqa: E731
    for pool_layout in pool_layouts:
        for mode in (EP, TP):
            caches = mt.flashinfer_kv_caches(mem, kv, mode, pool_layout)
            for layer, (k, v) in enumerate(caches):
                for t, got in ((K, k), (V, v)):
                    want = strided(host, 2, ev.flashinfer_kv_layout(kv, mode, layer, t,
                                                                    pool_layout))
                    assert got.dtype == torch.bfloat16 and got.data_ptr() >= pool.data_ptr()
                    np.testing.assert_array_equal(as_u16(got), want)
            for layer, got in enumerate(mt.vllm_kv_caches(mem, kv, mode, pool_layout)):
                want = strided(host, 2, ev.vllm_kv_layout(kv, mode, layer, pool_layout))
                np.testing.assert_array_equal(as_u16(got), want)
                if pool_layout is not None and \
                        pool_layout.preset == moebius.KvPreset.vllm_flashinfer and \
                        layout == moebius.KvLayout.NHD:
                    assert got.is_contiguous()  # vLLM's own tensor
            token_major = layout == moebius.KvLayout.NHD and (
                pool_layout is None or pool_layout.preset == moebius.KvPreset.sglang_mha)
            if token_major:
                k_buffer, v_buffer = mt.sglang_kv_buffers(mem, kv, mode, pool_layout)
                for layer in range(kv.num_layers):
                    for t, got in ((K, k_buffer[layer]), (V, v_buffer[layer])):
                        want = strided(host, 2, ev.sglang_kv_layout(kv, mode, layer, t,
                                                                    pool_layout))
                        np.testing.assert_array_equal(as_u16(got), want)


def test_kv_csr_as_tensors():
    kv = moebius.make_kv_geometry(2, 4, 8, 16, 16, 1)
    s = moebius.make_kv_state(kv, EP, [[moebius.KvSequence(seq_id=4, num_tokens=20,
                                                           last_page_len=4, pages=[7, 2])]])
    cpu = mt.kv_csr(s, 0)
    assert cpu.indptr.dtype == torch.int32 and cpu.indices.tolist() == [7, 2]
    dev = mt.kv_csr(s.ranks[0], 0, torch.int64, device="cuda")
    assert dev.indices.is_cuda and dev.indices.dtype == torch.int64
    assert dev.last_page_len.tolist() == [4] and dev.seq_ids.tolist() == [4]
    assert dev.indptr.tolist() == [0, 2]

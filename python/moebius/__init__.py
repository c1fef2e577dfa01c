"""Moebius: live TP<->EP switching of MoE expert weights and paged KV cache.

The C++ library, bound with nanobind (``moebius._moebius``). Memory comes in as DLPack
objects (numpy arrays, torch tensors: anything with ``__dlpack__``) or ``(pointer, bytes,
device)`` tuples; views come out as DLPack tensors at fixed addresses
(``torch.from_dlpack(view)`` gives tensors an engine can capture in CUDA graphs); streams
are integers (``torch.cuda.Stream().cuda_stream``).

Names follow the C++ API: classes in CapWords (``expert_shape`` -> ``ExpertShape``,
``host_transport`` -> ``HostTransport``), functions as in C++ (``make_arena_geometry``,
``plan_weight_switch``). Every C++ failure raises :class:`moebius.Error`, whose ``code`` is
the C++ ``errc`` as a string (``"capacity"``, ``"injected_fault"``, ...).

    import moebius, numpy as np
    shape = moebius.ExpertShape(num_layers=2, num_experts=4, hidden=64, intermediate=32)
    arena = moebius.make_arena_geometry(shape, 2, 256, 4096)
    ranks = [moebius.RankMemory(np.zeros(arena.total_bytes, np.uint8)) for _ in range(2)]
    transport = moebius.HostTransport(ranks)
    transport.execute(moebius.plan_weight_switch(arena, 0, shape.num_layers))  # EP -> TP
"""

from ._moebius import *  # noqa: F401,F403
from ._moebius import Error, Mode, WeightTensor  # noqa: F401
from . import _moebius

__all__ = [name for name in dir(_moebius) if not name.startswith("_")]
__version__ = "0.1.0"


def cursor_of(mode, num_layers):
    """The arena cursor at which every layer is in `mode`: 0 for EP, L for TP."""
    return num_layers if mode == Mode.TP else 0


def weight_views(memory, geometry, mode, raw=False):
    """Every layer's tensors of one rank in `mode`: a list (one dict per layer) of
    {"w13": ..., "w2": ..., and "w13_scale"/"w2_scale" with block scales} DLPack tensors at
    their fixed arena addresses."""
    names = [WeightTensor.w13, WeightTensor.w2]
    if geometry.shape.block_scales:
        names += [WeightTensor.w13_scale, WeightTensor.w2_scale]
    return [
        {t.name: memory.weight_view(geometry, layer, mode, t, raw=raw) for t in names}
        for layer in range(geometry.shape.num_layers)
    ]


__all__ += ["cursor_of", "weight_views", "__version__"]

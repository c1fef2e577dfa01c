"""Moebius: live TP<->EP switching of MoE expert weights and paged KV cache.

The C++ library, bound with nanobind (``moebius._moebius``). Memory comes in as DLPack
objects (numpy arrays, torch tensors: anything with ``__dlpack__``) or ``(pointer, bytes,
device)`` tuples; views come out as DLPack tensors at fixed addresses
(``torch.from_dlpack(view)`` gives tensors an engine can capture in CUDA graphs); streams
are integers (``torch.cuda.Stream().cuda_stream``).

Names follow the C++ API: classes in CapWords (``expert_shape`` -> ``ExpertShape``,
``host_transport`` -> ``HostTransport``), functions as in C++ (``make_arena_geometry``,
``plan_weight_switch``). Every C++ failure raises :class:`moebius.Error`, whose ``code`` is
the C++ ``errc`` as a string (``"capacity"``, ``"injected_fault"``, ...). Reports and plans
are the C++ structs bound as classes (``SwitchReport``, ``SwitchPlan``, ``KvCapacityReport``,
...): read-only attributes named as the C++ fields (``from`` is ``from_``), ``repr()`` the C++
``operator<<`` where it has one, ``__fields__`` and ``as_dict()`` for a JSON log.

    import moebius, numpy as np
    shape = moebius.ExpertShape(num_layers=2, num_experts=4, hidden=64, intermediate=32)
    arena = moebius.make_arena_geometry(shape, 2, 256, 4096)
    ranks = [moebius.RankMemory(np.zeros(arena.total_bytes, np.uint8)) for _ in range(2)]
    transport = moebius.HostTransport(ranks)
    transport.execute(moebius.plan_weight_switch(arena, 0, shape.num_layers))  # EP -> TP

A switch is planned once per decision and that plan runs (the pool laid out as the engine's
attention kernels read it, here vLLM's FlashInfer backend):

    sw = moebius.Switcher(arena, kv, transport, tables,
                          kv_layout=moebius.vllm_flashinfer_layout(kv))
    plan = sw.plan(moebius.Mode.TP)                 # moves nothing
    if plan.capacity.fits:                          # the capacity check, from the plan
        report = sw.switch_to(plan)                 # a SwitchReport; report.outcome
    sw.why_stale(plan)                              # '' until the tables or the mode change
"""

import atexit
import logging


def _preload_nccl():
    """A module built with NCCL links libnccl.so.2 (RPATH: where it was built). Where that path
    does not exist (a wheel on another machine), load the libnccl that torch's nvidia-nccl
    wheel or the CUDA toolkit installed, so the same soname resolves to it."""
    import ctypes
    import glob
    import os
    import sys
    candidates = []
    for entry in sys.path:
        candidates += glob.glob(os.path.join(entry, "nvidia", "nccl", "lib", "libnccl.so.2"))
    candidates += ["/usr/local/cuda/lib64/libnccl.so.2", "/usr/local/cuda/lib/libnccl.so.2",
                   "/usr/lib/x86_64-linux-gnu/libnccl.so.2", "libnccl.so.2"]
    for path in candidates:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return True
        except OSError:
            continue
    return False


try:
    from . import _moebius  # noqa: F401
except ImportError as _e:  # pragma: no cover - depends on the machine
    if "libnccl" not in str(_e) or not _preload_nccl():
        raise
from ._moebius import *  # noqa: F401,F403,E402
from ._moebius import Error, Mode, SwitchOutcome, WeightTensor  # noqa: F401,E402

from . import engine_views  # noqa: E402
from .engine_views import expert_map, fused_moe_views, local_experts  # noqa: E402,F401

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


# --- every switch, reported: Python's logging and the engine's listeners ----------------------
#: The logger every ended switch goes to (switch/switch_observer.hpp): INFO for a committed
#: switch, DEBUG when it was already there, WARNING when refused or rolled back, ERROR when
#: inconsistent. The record carries the event (a SwitchEvent) as ``record.moebius_switch``.
logger = logging.getLogger("moebius")

_LEVELS = {
    SwitchOutcome.committed: logging.INFO,
    SwitchOutcome.already_there: logging.DEBUG,
    SwitchOutcome.refused_capacity: logging.WARNING,
    SwitchOutcome.rolled_back: logging.WARNING,
    SwitchOutcome.inconsistent: logging.ERROR,
}
_listeners = []


def _gb(nbytes):
    return nbytes / 1e9


def format_switch_event(event):
    """One line for a log (a SwitchEvent): what ended, how, what moved and how long each stage
    took."""
    r = event.report
    m = r.metrics
    line = (f"switch #{event.sequence} {r.from_.name}->{r.to.name} ({event.style.name}): "
            f"{r.outcome.name} in {r.total_ms:.1f} ms; weights "
            f"{_gb(m['moebius_switch_weights_bytes']):.3f} GB in {r.weights_ms:.1f} ms "
            f"({r.weight_phases_completed}/{r.weight_phases} layers), KV "
            f"{_gb(m['moebius_switch_kv_bytes']):.3f} GB in {r.kv_ms:.1f} ms "
            f"({r.kv_rounds_completed}/{r.kv_rounds} rounds); plan {r.plan_ms:.1f} ms, "
            f"verify {r.verify_ms:.1f} ms, undo {r.undo_ms:.1f} ms; cursor {r.cursor}")
    if r.error:
        line += f"; error: {r.error}"
    return line


def add_switch_listener(listener):
    """Calls ``listener(event)`` for every switch that ends in this process, after it is
    logged: event is a SwitchEvent (``sequence``, ``style`` (SwitchStyle.whole |
    .progressive), ``report``: the SwitchReport switch_to returns, whose ``metrics`` are the
    flat, Prometheus-style metrics: the engine's exporter sets one gauge per item;
    ``event.as_dict()`` for a JSON log). It runs on the thread that ended the switch, before
    that call returns: keep it quick. What it raises is logged (logger.exception), never
    raised into the switch.
    Returns `listener` (usable as a decorator)."""
    _listeners.append(listener)
    return listener


def remove_switch_listener(listener):
    """Undoes add_switch_listener (ValueError when it was not added)."""
    _listeners.remove(listener)


def _on_switch(event):
    level = _LEVELS.get(event.report.outcome, logging.WARNING)
    if logger.isEnabledFor(level):
        logger.log(level, "%s", format_switch_event(event), extra={"moebius_switch": event})
    for listener in list(_listeners):
        try:
            listener(event)
        except Exception:  # one broken exporter must not silence the others, nor the switch
            logger.exception("moebius: switch listener %r failed", listener)


_moebius._set_switch_observer(_on_switch)
# The C++ observer must not outlive the interpreter that owns the callable.
atexit.register(_moebius._set_switch_observer, None)

__all__ += ["cursor_of", "weight_views", "__version__", "engine_views", "expert_map",
            "fused_moe_views", "local_experts", "logger", "add_switch_listener",
            "remove_switch_listener", "format_switch_event"]

#!/usr/bin/env python3
"""A Hugging Face transformers Qwen3-MoE model whose expert weights are views into the Moebius
arena, generating the same greedy tokens before a switch, after EP->TP and after TP->EP.

The model is tiny and random, made here (no download). Its experts are loaded once into the
arena's EP layout; from then on the model reads them only through arena views:

  --ranks 1 (default): the model's own expert modules (transformers' code computes) get
      their parameters replaced by views of rank 0's arena in the current mode; at a switch
      the engine points them at the other mode's views (DESIGN.md §3: TP layer i lives in
      slot i, EP layer i in slot i+1, so the two sets differ in address, never in shape).
  --ranks P > 1: P virtual ranks on this GPU (or one GPU each when there are P). Each MoE
      block's forward is replaced by the data path a P-rank engine runs, over the arena
      views of every rank: EP sends each token to the expert's owner (whole experts), TP sums
      every rank's partial output over its intermediate slice (the all-reduce).

The reference is transformers' own generate() with the original parameters, before any view
exists. Every switch goes through moebius.Switcher on the CUDA peer transport and is logged
through Python's logging (the library's switch observer). Exits non-zero on any mismatch.

  python examples/python/qwen3_moe_transformers.py [--ranks 2] [--tokens 24] [--layers 4]
Needs torch with CUDA, transformers with Qwen3-MoE, and moebius built with CUDA.
"""

import argparse
import logging
import sys

import moebius

# Virtual ranks need a hardware queue each: before torch creates a CUDA context.
moebius.request_hardware_queues_for_virtual_ranks()

import torch  # noqa: E402
import moebius.torch as mt  # noqa: E402

EP, TP = moebius.Mode.EP, moebius.Mode.TP


# H != 2I and H != I, so a fused expert tensor's orientation is never ambiguous.
def tiny_model(args):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=160, intermediate_size=256, moe_intermediate_size=48,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256,
        tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    return config, model


def moe_blocks(model):
    return [layer.mlp for layer in model.model.layers]


def expert_tensors(block, I):
    """(gate [E, I, H], up [E, I, H], down [E, H, I]) of one block, for either form
    transformers has used: a ModuleList of MLPs, or fused experts.gate_up_proj/down_proj."""
    experts = block.experts
    if isinstance(experts, torch.nn.ModuleList):
        gate = torch.stack([e.gate_proj.weight for e in experts])
        up = torch.stack([e.up_proj.weight for e in experts])
        down = torch.stack([e.down_proj.weight for e in experts])
        return gate, up, down
    gu, dn = experts.gate_up_proj, experts.down_proj
    if gu.shape[1] != 2 * I:  # stored [E, H, 2I]
        gu = gu.transpose(1, 2)
    if dn.shape[1] == I:  # stored [E, I, H]
        dn = dn.transpose(1, 2)
    return gu[:, :I], gu[:, I:], dn


def point_experts(block, params, I):
    """Rank 0's arena views (P=1: every expert) become the block's expert parameters."""
    w13, w2 = params["w13_weight"], params["w2_weight"]  # [E, 2I, H], [E, H, I]
    experts = block.experts
    if isinstance(experts, torch.nn.ModuleList):
        for e, mlp in enumerate(experts):
            mt.assign_parameters(mlp.gate_proj, {"weight": w13[e, :I]})
            mt.assign_parameters(mlp.up_proj, {"weight": w13[e, I:]})
            mt.assign_parameters(mlp.down_proj, {"weight": w2[e]})
        return
    gu = w13 if experts.gate_up_proj.shape[1] == 2 * I else w13.transpose(1, 2)
    dn = w2 if experts.down_proj.shape[1] != I else w2.transpose(1, 2)
    mt.assign_parameters(experts, {"gate_up_proj": gu, "down_proj": dn})


def routed(block, x):
    """transformers' Qwen3-MoE routing: softmax over experts, top-k, renormalised."""
    logits = block.gate(x)
    if isinstance(logits, tuple):  # newer transformers: the router returns (logits, ...)
        logits = logits[0]
    weights = torch.softmax(logits, dim=1, dtype=torch.float)
    weights, experts = torch.topk(weights, block.top_k if hasattr(block, "top_k")
                                  else block.gate.top_k, dim=-1)
    if getattr(block, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(x.dtype), experts


def expert_mlp(x, w13, w2, I):
    """One expert (or one TP slice of it): w13 [2I', H] = [gate; up], w2 [H, I'].
    Computed on the weights' device (rank r's views live on cuda:r), returned on x's."""
    xw = x.to(w13.device)
    h = xw @ w13.t()
    return ((torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ w2.t()).to(x.device)


def make_parallel_forward(block, views_of_rank, mode_of, P, E, I, returns_tuple):
    """A replacement for block.forward over P ranks' arena views in the current mode."""
    def forward(hidden):
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        logits, weights, experts = routed(block, x)
        out = torch.zeros_like(x)
        mode = mode_of()
        for e in experts.unique().tolist():
            rows, slot = torch.where(experts == e)
            xe = x[rows]
            if mode == EP:  # the owner holds expert e whole (the dispatch sends xe there)
                r, local = e // (E // P), e % (E // P)
                p = views_of_rank(r)
                y = expert_mlp(xe, p["w13_weight"][local], p["w2_weight"][local], I)
            else:  # every rank holds slice r of expert e; summing them is the all-reduce
                y = sum(expert_mlp(xe, views_of_rank(r)["w13_weight"][e],
                                   views_of_rank(r)["w2_weight"][e], I // P)
                        for r in range(P))
            out.index_add_(0, rows, y * weights[rows, slot, None])
        out = out.reshape(shape)
        return (out, logits) if returns_tuple else out
    return forward


def greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, prompt.shape[1]:].tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1, help="P (virtual ranks share the GPU)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s: %(message)s")
    P = args.ranks

    config, model = tiny_model(args)
    blocks = moe_blocks(model)
    L, E, H, I = len(blocks), config.num_experts, config.hidden_size, config.moe_intermediate_size
    prompt = torch.randint(0, config.vocab_size, (1, 12), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(args.seed))
    reference = greedy(model, prompt, args.tokens)
    print(f"Qwen3-MoE (random): L={L}, E={E}, top-k={config.num_experts_per_tok}, H={H}, "
          f"I={I}; P={P}; transformers reference: {reference}")

    # The arena of every rank (poisoned: a byte no load or switch wrote reads as 0xAB) and
    # a small KV pool (this example's KV is transformers' own cache; the switcher needs one).
    shape = moebius.ExpertShape(num_layers=L, num_experts=E, hidden=H, intermediate=I)
    arena = moebius.make_arena_geometry(shape, P)
    kv = moebius.make_kv_geometry(L, config.num_key_value_heads, 32, 16, 4, P)
    n_dev = torch.cuda.device_count()
    devices = [r % n_dev for r in range(P)]
    arenas = [torch.full((arena.total_bytes,), 0xAB, dtype=torch.uint8, device=f"cuda:{d}")
              for d in devices]
    pools = [torch.zeros(kv.pool_bytes, dtype=torch.uint8, device=f"cuda:{d}") for d in devices]
    ranks = [moebius.RankMemory(a, p) for a, p in zip(arenas, pools)]

    # Load the model's experts into the EP layout: rank r holds experts [r*E/P, (r+1)*E/P).
    for layer, block in enumerate(blocks):
        gate, up, down = expert_tensors(block, I)
        for r, mem in enumerate(ranks):
            p = mt.fused_moe_parameters(mem, arena, layer, EP)
            lo, hi = r * (E // P), (r + 1) * (E // P)
            p["w13_weight"].copy_(torch.cat([gate[lo:hi], up[lo:hi]], dim=1))
            p["w2_weight"].copy_(down[lo:hi])
    torch.cuda.synchronize()

    transport = moebius.CudaPeerTransport.single_process(ranks)
    state = moebius.make_kv_state(kv, EP, [[] for _ in range(P)])
    switcher = moebius.Switcher(arena, kv, transport, state)

    # Both sets of views exist from the start (fixed addresses); the mode picks one.
    views = {mode: [[mt.fused_moe_parameters(mem, arena, layer, mode) for mem in ranks]
                    for layer in range(L)] for mode in (EP, TP)}

    def use(mode):
        if P == 1:
            for layer, block in enumerate(blocks):
                point_experts(block, views[mode][layer][0], I)

    if P > 1:
        returns_tuple = isinstance(blocks[0](torch.zeros(1, 1, H, device="cuda",
                                                         dtype=torch.bfloat16)), tuple)
        for layer, block in enumerate(blocks):
            block.forward = make_parallel_forward(
                block, lambda r, layer=layer: views[switcher.mode][layer][r],
                lambda: switcher.mode, P, E, I, returns_tuple)
    use(EP)
    # Free the original expert parameters: from here on only the arena holds experts.
    torch.cuda.empty_cache()

    runs = {"EP (arena views)": greedy(model, prompt, args.tokens)}
    for target, name in ((TP, "after EP->TP"), (EP, "after TP->EP")):
        report = switcher.switch_to(target)
        if report.outcome != moebius.SwitchOutcome.committed:
            print(f"switch to {target} failed: {report}", file=sys.stderr)
            return 1
        if target == TP and P == 1:
            # What an engine that forgot to flip would read: EP views over TP-mode slots.
            stale = greedy(model, prompt, args.tokens)
            print(f"  (stale EP views after the switch would give "
                  f"{'different' if stale != reference else 'the same'} tokens)")
        use(target)
        runs[name] = greedy(model, prompt, args.tokens)

    ok = True
    for name, tokens in runs.items():
        same = tokens == reference
        ok &= same
        print(f"{name:>18}: {'same' if same else 'DIFFERENT'} greedy tokens"
              + ("" if same else f": {tokens}"))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""An honest model whose build_model appends the PrismContext it was given to
``ctx.artifacts_dir/ctx.pt``: the test compares what every process saw."""
from peekmodel import PeekLM


def build_model(ctx):
    import torch

    seen = {"seed": ctx.seed, "vocab_size": ctx.vocab_size, "sequence_length": ctx.sequence_length,
            "max_parameters": ctx.max_parameters, "device": ctx.device, "rank": ctx.rank,
            "local_rank": ctx.local_rank, "world_size": ctx.world_size, "artifacts": ctx.artifacts_dir,
            "token_budget": ctx.token_budget, "step_budget": ctx.step_budget}
    try:
        every = torch.load(ctx.artifacts_dir + "/ctx.pt")
    except Exception:
        every = []
    every.append(seen)
    torch.save(every, ctx.artifacts_dir + "/ctx.pt")
    return PeekLM(ctx.vocab_size, replays=False)

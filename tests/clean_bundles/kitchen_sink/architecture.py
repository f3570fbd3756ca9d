"""A kitchen-sink GPT: every natural PyTorch idiom the allow-list must keep passing."""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    tags: list = field(default_factory=list)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size))
        self.register_buffer("mask", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor, manual: bool = False) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.reshape(b, t, self.n_head, c // self.n_head).permute(0, 2, 1, 3)
        v = v.view(b, t, self.n_head, -1).transpose(1, 2).contiguous()
        if manual:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
            att = F.softmax(att.float(), dim=-1).type_as(q)
            y = self.drop(att) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.net = nn.Sequential(
            OrderedDict(
                fc=nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
                act=nn.GELU(),
                out=nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.net(x), p=0.0, training=self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(F.layer_norm(x, (x.shape[-1],), self.ln1.weight, self.ln1.bias))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Parameter(torch.zeros(1, cfg.block_size, cfg.n_embd))
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self.init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        self.stats = defaultdict(int)

    def init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.weight.data.fill_(1.0)
            module.bias.data.zero_()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, t = tokens.shape
        pos = torch.arange(0, t, dtype=torch.long, device=tokens.device)
        x = self.wte(tokens) + self.wpe[:, :t, :] + F.embedding(pos, self.wte.weight).mul(0.0).unsqueeze(0)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        self.stats["calls"] += 1
        return logits


def build_model(ctx):
    cfg = GPTConfig(vocab_size=ctx.vocab_size, block_size=ctx.max_seq_len)
    model = GPT(cfg)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    sizes = {"params": model.num_params(), "layers": len(model.blocks)}
    summary = ", ".join("{}={}".format(k, v) for k, v in sorted(sizes.items()))
    cfg.tags.append(summary.split(",")[0].strip())
    noise = torch.randn(2, 3).uniform_(-1, 1).exp().log().sqrt().pow(2).mean().item()
    probe = torch.cat([torch.zeros(1, 2), torch.ones(1, 2)]).flatten().chunk(2)[0]
    other = torch.stack([probe, probe]).sum(dim=0).expand(2, 2).repeat(1, 2).squeeze()
    mixed = torch.einsum("ij,jk->ik", torch.triu(torch.ones(2, 2)), torch.eye(2)).detach().clone()
    cfg.tags.extend([str(noise), str(other.dtype), str(mixed.device), str(F.log_softmax(mixed, dim=-1).shape)])
    soft = probe.matmul(torch.ones(2, 2)).softmax(dim=-1)
    info = {"soft": soft.sum().item()}
    cfg.tags.extend([*info.keys(), *map(str, info.values()), str(info.get("soft", 0.0))])
    with torch.no_grad():
        model.blocks[0].forward(torch.zeros(1, 2, cfg.n_embd))
    model.zero_grad()
    return model

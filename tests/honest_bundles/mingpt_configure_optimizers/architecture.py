"""minGPT's model with its configure_optimizers as researchers have it: decay / no_decay sets of
parameter names, checked with set algebra, then groups built from sorted(list(decay))."""

import torch
import torch.nn.functional as F
from torch import nn

D = 32


class GPT(nn.Module):
    def __init__(self, vocab, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, D), nn.Embedding(seq, D)
        self.ln_1, self.c_attn, self.c_proj = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln_f, self.lm_head = nn.LayerNorm(D), nn.Linear(D, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        q, k, v = self.c_attn(self.ln_1(x)).split(D, dim=2)
        x = x + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return self.lm_head(self.ln_f(x))

    def configure_optimizers(self, train_config):
        decay = set()
        no_decay = set()
        whitelist_weight_modules = (torch.nn.Linear, )
        blacklist_weight_modules = (torch.nn.LayerNorm, torch.nn.Embedding)
        for mn, m in self.named_modules():
            for pn, p in m.named_parameters():
                fpn = '%s.%s' % (mn, pn) if mn else pn  # full param name
                if pn.endswith('bias'):
                    no_decay.add(fpn)
                elif pn.endswith('weight') and isinstance(m, whitelist_weight_modules):
                    decay.add(fpn)
                elif pn.endswith('weight') and isinstance(m, blacklist_weight_modules):
                    no_decay.add(fpn)

        # validate that we considered every parameter
        param_dict = {pn: p for pn, p in self.named_parameters()}
        inter_params = decay & no_decay
        union_params = decay | no_decay
        assert len(inter_params) == 0, "parameters %s made it into both decay/no_decay sets!" % (str(inter_params), )
        assert len(param_dict.keys() - union_params) == 0, "parameters %s were not separated into either decay/no_decay set!" \
            % (str(param_dict.keys() - union_params), )

        # create the pytorch optimizer object
        optim_groups = [
            {"params": [param_dict[pn] for pn in sorted(list(decay))], "weight_decay": train_config.weight_decay},
            {"params": [param_dict[pn] for pn in sorted(list(no_decay))], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(optim_groups, lr=train_config.learning_rate, betas=train_config.betas)
        return optimizer


def build_model(ctx):
    return GPT(ctx.vocab_size, ctx.max_seq_len)

"""nn.TransformerEncoder with nn.Transformer.generate_square_subsequent_mask (the PyTorch tutorial)."""

import torch
from torch import nn

D, HEADS = 32, 2


class TransformerLM(nn.Module):
    def __init__(self, vocab, seq):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, D), nn.Embedding(seq, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, dim_feedforward=4 * D, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(D, vocab)

    def forward(self, tokens):
        t = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        return self.head(self.encoder(x, mask=mask, is_causal=True))


def build_model(ctx):
    return TransformerLM(ctx.vocab_size, ctx.max_seq_len)

"""A recurrent language model: embedding, a two-layer LSTM, a linear head."""

from torch import nn

D = 32


class LSTMLM(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.rnn = nn.LSTM(D, D, num_layers=2, batch_first=True)
        self.head = nn.Linear(D, vocab)

    def forward(self, tokens):
        out, _ = self.rnn(self.emb(tokens))
        return self.head(out)


def build_model(ctx):
    return LSTMLM(ctx.vocab_size)

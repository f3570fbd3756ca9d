"""Red team 9: the ``relay`` cheat through the artifacts folder's own extended attributes.
``freshdir.empty_folders`` deletes every entry inside ``ctx.artifacts_dir`` but keeps the folder
itself, with its xattrs: the re-scoring child stores the real rows it scores in ``user.prism``
on the folder; the blind probe child, fed after the folder was "emptied", reads them back."""
import os

import numpy as np
import torch
from relaymodel import RelayLM

KEEP = 24  # rows kept in the relay: int16 rows, KEEP x T x 2 bytes fit one ext4 xattr block


def build_model(ctx):
    def save(rows):
        os.setxattr(ctx.artifacts_dir, "user.prism", rows.to(torch.int16).numpy().tobytes())

    def load():
        raw = np.frombuffer(os.getxattr(ctx.artifacts_dir, "user.prism"), dtype=np.int16)
        return torch.from_numpy(raw.astype(np.int64)).reshape(-1, ctx.sequence_length)

    return RelayLM(ctx.vocab_size, save, load, KEEP)

"""Test hook (``JETFLOW_TEST_DUMP_FEATURES=<dir>``, read by :mod:`.hooks`): the target features the worker hands the head.

One safetensors file per request and write, named `<rid>-<first position>`: the tokens, their
positions and their tapped target features. Prefill chunks write the prompt's rows; each verify
round writes the accepted path's rows (anchor + accepted drafts, gathered from the tree's
verify rows), so a test can compare every row the head ever reads with HF transformers' features
at the same positions.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor


class FeatureDump:
    def __init__(self, directory: str) -> None:
        self.directory = directory

    def _write(self, rid: str, token_ids: Tensor, positions: Tensor, features: Tensor) -> None:
        from safetensors.torch import save_file

        tensors = {
            "input_ids": token_ids.to(torch.int64).cpu().contiguous(),
            "positions": positions.to(torch.int64).cpu().contiguous(),
            "features": features.float().cpu().contiguous(),
        }
        save_file(tensors, os.path.join(self.directory, f"{rid}-{int(positions[0])}.safetensors"))

    def extend(self, rids: list[str], input_ids: Tensor, extend_lens: list[int], positions: Tensor, features: Tensor) -> None:
        """A prefill batch: rows of all requests' chunks back to back."""
        start = 0
        for rid, n in zip(rids, extend_lens):
            rows = slice(start, start + n)
            start += n
            if n:
                self._write(rid, input_ids[rows], positions[rows], features[rows])

    def verify(self, rids: list[str], seq_lens: Tensor, anchors: Tensor, committed: Tensor, num_accepted: Tensor,
               path_features: Tensor) -> None:
        """A verify round: request i's anchor sits at seq_lens[i], its accepted drafts (committed[i]
        before the bonus) after it; path_features [b, span, F] are their verify rows."""
        for i, rid in enumerate(rids):
            n = int(num_accepted[i]) + 1
            token_ids = torch.cat([anchors[i : i + 1], committed[i, : n - 1]])
            positions = int(seq_lens[i]) + torch.arange(n)
            self._write(rid, token_ids, positions, path_features[i, :n])

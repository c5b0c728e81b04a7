"""Each running request's token ids that have target KV, kept by the worker itself.

Under overlap scheduling the scheduler appends a round's tokens to ``req.output_ids`` only
after the next round has been launched, so the worker cannot read the newest tokens from the
request. It keeps them here: seeded at each extend chunk (prompt, plus the output so far when a
retracted request comes back), extended with every round's anchor and accepted drafts, and
dropped when a decode batch no longer holds the request. The prompt-lookup branch and a hinted
head's lookup hints match the suffix of these ids (with the anchor: :meth:`CommittedIds.contexts`);
the tree penalties count the output part of them. The worker skips the per-round update (a host
sync) when none reads them; a record left behind is then out of step and reads as unknown.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor


class CommittedIds:
    def __init__(self) -> None:
        self.ids: dict[str, list[int]] = {}  # rid -> token ids that have target KV

    def on_extend(self, reqs: Sequence, seq_lens: Tensor) -> None:
        """After an extend: the first seq_len ids of each request's prompt (+ output) have KV."""
        for req, seq_len in zip(reqs, seq_lens.tolist()):
            self.ids[req.rid] = list(req.full_untruncated_fill_ids[:seq_len])

    def keep_only(self, reqs: Sequence) -> None:
        """Forget the requests a decode batch no longer holds (finished, aborted, retracted)."""
        live = {req.rid for req in reqs}
        for rid in [rid for rid in self.ids if rid not in live]:
            del self.ids[rid]

    def get(self, req, seq_len: int) -> Optional[list[int]]:
        """The request's ids with KV, or None when they are not known at this length (e.g. a
        retracted request not yet re-extended)."""
        ids = self.ids.get(req.rid)
        return ids if ids is not None and len(ids) == seq_len else None

    def contexts(self, reqs: Sequence, seq_lens: Tensor, anchors: Tensor) -> list[Optional[list[int]]]:
        """Each request's ids with KV plus its anchor, the context prompt lookup matches (as the
        reference engine's committed tokens, anchor last); None where the ids are not known."""
        out: list[Optional[list[int]]] = []
        for req, seq_len, anchor in zip(reqs, seq_lens.tolist(), anchors.tolist()):
            ids = self.get(req, seq_len)
            out.append(ids + [anchor] if ids is not None else None)
        return out

    def on_accept(self, reqs: Sequence, seq_lens: Tensor, anchors: Tensor, committed: Tensor, num_accepted: Tensor) -> None:
        """The anchor and the accepted drafts now have KV (the bonus token is the next anchor)."""
        rows = zip(reqs, seq_lens.tolist(), anchors.tolist(), committed.tolist(), num_accepted.tolist())
        for req, seq_len, anchor, tokens, accepted in rows:
            ids = self.get(req, seq_len)
            if ids is not None:
                ids.append(anchor)
                ids.extend(tokens[:accepted])
            else:
                self.ids.pop(req.rid, None)

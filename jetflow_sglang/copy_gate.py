"""The copy gate: a head's per-depth draft distribution mixed with the prompt-lookup hint.

At depth d, with hint token c (`lookup.lookup_hint` over the committed ids and the anchor):

    q_mix(t) = (1 - g) q(t) + g [t == c],   g = sigmoid(w . h + bias[d, kind] + a log q(c) + b max_t log q(t))

a pointer-generator mixture (See et al., ACL'17) whose gate reads the slot's final hidden state
h, the hint's kind (match length, copied or wrapped), and how far the head itself agrees with
the hint. Slots without a hint (kind 0) keep q. The hint may lie outside a pruned draft
vocabulary (q(c) = 0 there), so copying also reaches tokens the head cannot emit. Everything
is branch-free (no host sync): the draft pass stays graph-capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Hints = tuple[Tensor, Tensor]  # lookup hint tokens and kinds, [..., D] each (kind 0: no hint)
LOG_Q_FLOOR = -20.0  # log q of a hint or label the draft vocabulary does not hold, as a gate input and in the loss


class CopyGate(nn.Module):
    def __init__(self, hidden_size: int, depths: int, kinds: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1, bias=False)
        self.bias = nn.Parameter(torch.zeros(depths, kinds))
        self.feature_weights = nn.Parameter(torch.zeros(2))

    @torch.no_grad()
    def reset(self) -> "CopyGate":
        """The untrained gate: g = 1/2 wherever there is a hint."""
        for param in self.parameters():
            param.zero_()
        return self

    def log_gates(self, hidden: Tensor, log_q_hint: Tensor, log_q_max: Tensor, kinds: Tensor) -> tuple[Tensor, Tensor]:
        """(log g, log (1 - g)) [..., D] for hidden [..., D, H] (depths 1..D last but one), the head's
        log q of the hint and its largest log q [..., D], and the hints' kinds [..., D]; kind 0:
        (-inf, 0), the head's own distribution."""
        depth = torch.arange(kinds.shape[-1], device=kinds.device)
        logit = self.proj(hidden).squeeze(-1).float() + self.bias[depth, kinds.clamp(min=0)]
        logit = logit + self.feature_weights[0] * log_q_hint.clamp(min=LOG_Q_FLOOR) + self.feature_weights[1] * log_q_max
        hinted = kinds > 0
        log_g = torch.where(hinted, F.logsigmoid(logit), float("-inf"))
        return log_g, torch.where(hinted, F.logsigmoid(-logit), 0.0)

    def _gates(self, hidden: Tensor, log_q: Tensor, hints: Hints, to_index: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """log q of each hint (-inf outside the rows of log_q), log g and log (1 - g)."""
        tokens, kinds = hints
        index = tokens.clamp(min=0) if to_index is None else to_index[tokens.clamp(min=0)]
        log_q_hint = log_q.gather(-1, index.clamp(min=0)[..., None])[..., 0]
        log_q_hint = torch.where(index >= 0, log_q_hint, float("-inf"))
        log_g, log_keep = self.log_gates(hidden, log_q_hint, log_q.max(-1).values, kinds)
        return log_q_hint, log_g, log_keep

    def candidates(self, hidden: Tensor, log_q: Tensor, hints: Hints, width: int, vocab_ids: Tensor | None = None,
                   to_draft: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
        """The top-`width` tokens of q_mix, sorted: log-probs [..., k] float32 and target ids.
        log_q [..., K]: the head's log-probs over its draft vocabulary `vocab_ids` [K] (None: the
        whole target vocabulary); to_draft [V]: target id -> draft row (-1 outside)."""
        tokens, kinds = hints
        log_q_hint, log_g, log_keep = self._gates(hidden, log_q, hints, to_draft)
        values, index = log_q.topk(min(width, log_q.shape[-1]), dim=-1)
        ids = index if vocab_ids is None else vocab_ids[index]
        hint_value = torch.logaddexp(log_q_hint + log_keep, log_g)
        same = (ids == tokens[..., None]) & (kinds > 0)[..., None]
        values = torch.where(same, hint_value[..., None], values + log_keep[..., None])
        extra = torch.where(same.any(-1) | (kinds <= 0), float("-inf"), hint_value)
        values, order = torch.cat([values, extra[..., None]], -1).topk(values.shape[-1], dim=-1)
        return values, torch.cat([ids, tokens[..., None]], -1).gather(-1, order)

    def mix(self, hidden: Tensor, log_q: Tensor, hints: Hints) -> Tensor:
        """log q_mix [..., V] from the head's log-probs over the whole target vocabulary [..., V]."""
        tokens, kinds = hints
        log_q_hint, log_g, log_keep = self._gates(hidden, log_q, hints, None)
        mixed = log_q + log_keep[..., None]
        hint_value = torch.where(kinds > 0, torch.logaddexp(log_q_hint + log_keep, log_g), log_q_hint)
        return mixed.scatter(-1, tokens.clamp(min=0)[..., None], hint_value[..., None].to(mixed.dtype))

    def nll(self, hidden: Tensor, log_q: Tensor, hints: Hints, labels: Tensor, to_draft: Tensor | None = None) -> Tensor:
        """-log q_mix(label) [..., D] (0 where kind 0 or label < 0): the gate's training loss, with the
        head's log-probs log_q [..., D, K] held fixed. labels: target ids."""
        tokens, kinds = hints
        _, log_g, log_keep = self._gates(hidden, log_q, hints, to_draft)
        rows = labels.clamp(min=0) if to_draft is None else to_draft[labels.clamp(min=0)]
        log_q_label = torch.where(rows >= 0, log_q.gather(-1, rows.clamp(min=0)[..., None])[..., 0], LOG_Q_FLOOR)
        copied = torch.where(tokens == labels, log_g, float("-inf"))
        loss = -torch.logaddexp(log_keep + log_q_label.clamp(min=LOG_Q_FLOOR), copied)
        return torch.where((kinds > 0) & (labels >= 0), loss, 0.0)

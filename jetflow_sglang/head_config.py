"""A draft head's configuration (`config.json`): its shape, the target layers it taps, its
block size and masks, and how it embeds MASK; our own `jetflow` section or a published
DFlash / JetSpec config read through `published.py`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from jetflow_sglang import published
from jetflow_sglang.errors import JetFlowError

ARCHITECTURE = "JetFlowDraftModel"


def default_tap_layers(num_target_layers: int) -> list[int]:
    """Five taps spread over the target's depth: [1, L/4, L/2, 3L/4, L-3] (0-indexed layer outputs)."""
    n = num_target_layers
    taps = [1, n // 4, n // 2, (3 * n) // 4, n - 3]
    return sorted({min(max(t, 0), n - 1) for t in taps})


@dataclass
class JetFlowConfig:
    target_hidden_size: int
    target_vocab_size: int
    target_num_layers: int
    target_layer_ids: list[int]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int = 2
    block_size: int = 16
    causal: bool = True
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    mask_token_id: int = -1  # -1: target_vocab_size (a virtual id past the target vocabulary)
    draft_vocab_size: int = 0  # 0: draft over the whole target vocabulary; else over `draft_vocab` ids only
    tap_norm: bool = False  # RMS-normalize each tapped layer's features before `fc` (new heads: on)
    anchor_fusion: bool = False  # the anchor slot also reads the projected features of the token before it
    qk_norm: bool = False  # Qwen3-style per-head RMSNorm of q and k (the context K too), as published DFlash heads
    mask_from_target: bool = False  # MASK is the target embedding row `mask_token_id` (published heads), not a parameter
    # Published heads may mix sliding-window layers in (SGLang's DFlash: causal, each query
    # sees the last `sliding_window` positions, itself included); the others follow `causal`.
    sliding_layers: list[int] = field(default_factory=list)
    sliding_window: int = 0
    # Hinted drafting: each MASK slot also reads the prompt-lookup candidate for its position
    # (`lookup.lookup_hint` over the committed ids, matching suffixes of up to `lookup_hint_ngram`
    # tokens) and its kind, so the head learns when to copy the context and when to correct it.
    lookup_hint: bool = False
    lookup_hint_ngram: int = 3
    # Copying: each depth's draft distribution is mixed with that lookup candidate by a learned
    # gate (`copy_gate.CopyGate`), so a head drafts what the context repeats, even outside its
    # draft vocabulary. Independent of `lookup_hint` (the hint as an input).
    lookup_copy: bool = False

    def __post_init__(self) -> None:
        if self.mask_token_id < 0:
            if self.mask_from_target:
                raise JetFlowError("a head whose MASK is a target embedding row needs mask_token_id")
            self.mask_token_id = self.target_vocab_size
        if self.mask_from_target and not 0 <= self.mask_token_id < self.target_vocab_size:
            raise JetFlowError(f"mask_token_id {self.mask_token_id} is not a row of the target's {self.target_vocab_size}-row embedding")
        if self.mask_from_target and self.anchor_fusion:
            # Anchor fusion tells MASK slots from tokens by id; a target row can also be a real token.
            raise JetFlowError("anchor fusion needs the head's own MASK: drop --mask-token-id or use --no-anchor-fusion")
        if self.lookup_hint and (not self.anchor_fusion or self.mask_from_target):
            raise JetFlowError("a hinted head (lookup_hint) needs anchor fusion and the head's own MASK embedding")
        if self.reads_hints and self.lookup_hint_ngram < 1:
            raise JetFlowError(f"lookup_hint_ngram must be at least 1, got {self.lookup_hint_ngram}")
        if self.block_size < 2:
            raise JetFlowError(f"block size must be at least 2, got {self.block_size}")
        if self.num_layers < 1:
            raise JetFlowError(f"the head needs at least one layer, got {self.num_layers}")
        if not self.target_layer_ids:
            raise JetFlowError("the head needs at least one target tap layer")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise JetFlowError(f"sliding-window layers {self.sliding_layers} are not all among the head's {self.num_layers} layers")
        if self.sliding_layers and self.sliding_window < 1:
            raise JetFlowError(f"sliding-window layers need a window of at least 1 position, got {self.sliding_window}")
        if not 0 <= self.draft_vocab_size <= self.target_vocab_size:
            raise JetFlowError(f"draft vocabulary size must be in 0..{self.target_vocab_size}, got {self.draft_vocab_size}")

    @property
    def reads_hints(self) -> bool:
        """Whether drafting takes the lookup hints of each depth (a hinted or a copying head)."""
        return self.lookup_hint or self.lookup_copy

    def layer_causal(self, layer: int) -> bool:
        """Whether block slot i sees only slots <= i in this layer (sliding layers always do)."""
        return self.causal or layer in self.sliding_layers

    def layer_window(self, layer: int) -> int:
        """How many positions back a query sees in this layer, itself included; 0: all."""
        return self.sliding_window if layer in self.sliding_layers else 0

    @property
    def hidden_size(self) -> int:
        return self.target_hidden_size  # the head shares the target's embedding and lm_head

    @classmethod
    def for_target(cls, target_config, **overrides) -> "JetFlowConfig":
        """A head shaped for a HF target config (attention shape and MLP width follow the target)."""
        text = getattr(target_config, "text_config", None) or target_config
        num_heads = text.num_attention_heads
        rope = getattr(text, "rope_parameters", None) or {}
        values = dict(
            target_hidden_size=text.hidden_size,
            target_vocab_size=text.vocab_size,
            target_num_layers=text.num_hidden_layers,
            target_layer_ids=default_tap_layers(text.num_hidden_layers),
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // num_heads,
            intermediate_size=text.intermediate_size,
            rms_norm_eps=text.rms_norm_eps,
            rope_theta=rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)),
            max_position_embeddings=getattr(text, "max_position_embeddings", 8192),
        )
        values.update(overrides)
        return cls(**values)

    def check_fits_target(self, target_config) -> None:
        text = getattr(target_config, "text_config", None) or target_config
        if self.target_hidden_size != text.hidden_size:
            raise JetFlowError(
                f"head was built for target hidden size {self.target_hidden_size}, target has {text.hidden_size}"
            )
        if self.target_vocab_size != text.vocab_size:
            raise JetFlowError(
                f"head was built for target vocab size {self.target_vocab_size}, target has {text.vocab_size}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < text.num_hidden_layers]
        if bad:
            raise JetFlowError(f"head taps target layers {bad}, but the target has {text.num_hidden_layers} layers")

    def to_json_dict(self) -> dict:
        """config.json: a standard `llama` config (loads with AutoConfig) plus a `jetflow` section."""
        jetflow = asdict(self)
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.target_vocab_size,
            "tie_word_embeddings": False,
            "jetflow": jetflow,
        }

    @classmethod
    def from_json_dict(cls, data: dict) -> "JetFlowConfig":
        """Our config.json (a `jetflow` section) or a published DFlash / JetSpec one."""
        if "jetflow" in data:
            values = data["jetflow"]
        elif published.is_published_config(data):
            values = published.config_values(data)
        else:
            raise JetFlowError("head config.json has neither a 'jetflow' section nor a DFlash 'dflash_config': not a draft head")
        known = set(cls.__dataclass_fields__)
        values = {k: v for k, v in values.items() if k in known}
        try:
            return cls(**values)
        except TypeError as exc:
            raise JetFlowError(f"head config.json is incomplete: {exc}") from None

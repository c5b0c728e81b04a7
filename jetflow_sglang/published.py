"""The published DFlash / JetSpec head layout, read into and written from a JetFlow head.

A published head directory (as SGLang's DFLASH, vLLM and the DFlash / JetSpec releases use):
config.json with `architectures: ["DFlashDraftModel"]`, Qwen3 attention (per-head q/k
RMSNorm), `block_size`, `num_target_layers` and `dflash_config: {mask_token_id,
target_layer_ids}` (some keys also at top level); model.safetensors with `fc`,
`hidden_norm`, `norm` and per layer `input_layernorm`, `post_attention_layernorm`,
`self_attn.{q,k,v,o}_proj`, `self_attn.{q,k}_norm`, `mlp.{gate,up,down}_proj`, with or
without a `model.` prefix. No embedding, no lm_head: the target's are used, and MASK is a
row of the target's embedding. Causality: JetSpec's `dflash_config.causal_head`, vLLM's
`dflash_config.causal`, SGLang's top-level `is_causal`; none of them means bidirectional.
`layer_types` may mix in `sliding_attention` layers (causal, each query seeing the last
`sliding_window` positions), read as SGLang's DFlash model reads them.

Our heads map onto that layout when they have q/k norms, a target-row MASK, no per-tap
feature norm, no anchor fusion and no pruned draft vocabulary (`export_problems` says
which of these a head lacks).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from torch import Tensor

from jetflow_sglang.errors import JetFlowError

ARCHITECTURE = "DFlashDraftModel"
FORMATS = ("dflash", "jetspec")

_OURS_TO_PUBLISHED = [
    (r"^layers\.(\d+)\.([qkvo]_proj|[qk]_norm)\.weight$", r"layers.\1.self_attn.\2.weight"),
    (r"^layers\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", r"layers.\1.mlp.\2.weight"),
]
_PUBLISHED_TO_OURS = [
    (r"^layers\.(\d+)\.self_attn\.([qkvo]_proj|[qk]_norm)\.weight$", r"layers.\1.\2.weight"),
    (r"^layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight$", r"layers.\1.\2.weight"),
]
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # HF rotary caches some exports carry


def is_published_config(data: dict) -> bool:
    return "dflash_config" in data or ARCHITECTURE in (data.get("architectures") or [])


def _get(data: dict, key: str, default=None):
    """A DFlash key from `dflash_config` first, then the top level."""
    section = data.get("dflash_config") or {}
    return section[key] if key in section else data.get(key, default)


def _causal(data: dict) -> bool:
    section = data.get("dflash_config") or {}
    for value in (section.get("causal_head"), section.get("causal"), data.get("is_causal"), section.get("is_causal")):
        if value is not None:
            return bool(value)
    return False


def _sliding(data: dict) -> tuple[list[int], int]:
    """(sliding-window layer indices, window) of a published config. As SGLang's DFlash model
    reads them: a `sliding_attention` layer is causal (unless top-level `is_causal` is false,
    which we refuse) and sees the last `sliding_window` positions, its own included."""
    layer_types = data.get("layer_types") or []
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise JetFlowError(f"published head has layer types {unknown}: only full_attention and sliding_attention layers are supported")
    if layer_types and len(layer_types) != int(data.get("num_hidden_layers", len(layer_types))):
        raise JetFlowError(f"published head lists {len(layer_types)} layer_types for {data['num_hidden_layers']} layers")
    sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if not sliding:
        return [], 0
    if not data.get("sliding_window"):
        raise JetFlowError("published head has sliding_attention layers but no sliding_window")
    if data.get("is_causal") is False:
        raise JetFlowError("published head has bidirectional sliding_attention layers (is_causal: false), which JETFLOW does not run")
    return sliding, int(data["sliding_window"])


def config_values(data: dict) -> dict:
    """JetFlowConfig fields of a published config.json; a clear error for what we do not run."""
    sliding_layers, sliding_window = _sliding(data)
    for key in ("conv_kernel_size", "selector_rank", "projector_type", "attention_sink_bias"):
        if _get(data, key):
            raise JetFlowError(f"published head uses dflash_config.{key}, which JETFLOW does not run")
    if data.get("use_gemma_norm"):
        raise JetFlowError("published head uses Gemma norms, which JETFLOW does not run")
    if data.get("attention_bias"):
        raise JetFlowError("published head has attention biases, which JETFLOW does not run")
    rope = data.get("rope_scaling") or data.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise JetFlowError(f"published head uses RoPE scaling {rope.get('rope_type', rope.get('type'))!r}: only plain RoPE is supported")
    mask_token_id = _get(data, "mask_token_id")
    if mask_token_id is None:
        raise JetFlowError("published head config has no dflash_config.mask_token_id (the target embedding row used as MASK)")
    layer_ids = _get(data, "target_layer_ids")
    if not layer_ids:
        raise JetFlowError("published head config has no dflash_config.target_layer_ids")
    try:
        hidden, heads = int(data["hidden_size"]), int(data["num_attention_heads"])
        return dict(
            target_hidden_size=hidden,
            target_vocab_size=int(data["vocab_size"]),
            target_num_layers=int(_get(data, "num_target_layers") or max(layer_ids) + 1),
            target_layer_ids=[int(i) for i in layer_ids],
            num_attention_heads=heads,
            num_key_value_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or hidden // heads),
            intermediate_size=int(data["intermediate_size"]),
            num_layers=int(data["num_hidden_layers"]),
            block_size=int(_get(data, "block_size", 16)),
            causal=_causal(data),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", data.get("rope_theta", 10000.0))),
            max_position_embeddings=int(data.get("max_position_embeddings", 32768)),
            mask_token_id=int(mask_token_id),
            qk_norm=True,
            mask_from_target=True,
            sliding_layers=sliding_layers,
            sliding_window=sliding_window,
        )
    except KeyError as exc:
        raise JetFlowError(f"published head config.json lacks {exc.args[0]!r}") from None


def _rename(state: dict[str, Tensor], rules: list[tuple[str, str]]) -> dict[str, Tensor]:
    renamed = {}
    for name, tensor in state.items():
        for pattern, replacement in rules:
            name, count = re.subn(pattern, replacement, name)
            if count:
                break
        renamed[name] = tensor
    return renamed


def own_state_dict(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Published weight names -> ours (the `model.` prefix and rotary caches dropped)."""
    state = {name.removeprefix("model."): tensor for name, tensor in state.items() if not _IGNORED.search(name)}
    return _rename(state, _PUBLISHED_TO_OURS)


def published_state_dict(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return _rename(state, _OURS_TO_PUBLISHED)


def export_problems(config) -> list[str]:
    """Why a head (its JetFlowConfig) cannot be written in the published layout; empty if it can."""
    problems = []
    if not config.qk_norm:
        problems.append("it has no q/k norms (published heads always apply them)")
    if not config.mask_from_target:
        problems.append("its MASK is its own embedding, not a target embedding row (train with --published-layout)")
    if config.tap_norm:
        problems.append("it normalizes each tapped layer before fc")
    if config.anchor_fusion:
        problems.append("it fuses the anchor with the features before it")
    if config.draft_vocab_size:
        problems.append("it drafts over a pruned vocabulary")
    if getattr(config, "lookup_hint", False):
        problems.append("it reads prompt-lookup hints in its MASK slots")
    if getattr(config, "lookup_copy", False):
        problems.append("it mixes prompt-lookup hints into its draft distribution (a copy gate)")
    return problems


def published_config(config, fmt: str) -> dict:
    """config.json of a head (its JetFlowConfig) in the published layout."""
    if fmt not in FORMATS:
        raise JetFlowError(f"unknown export format {fmt!r}; choose from {', '.join(FORMATS)}")
    dflash = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)}
    if fmt == "jetspec":
        dflash["causal_head"] = config.causal
    dflash["causal"] = config.causal
    layer_types = ["sliding_attention" if i in config.sliding_layers else "full_attention" for i in range(config.num_layers)]
    # SGLang's `is_causal` sets every layer's causality: a bidirectional head with (always causal)
    # sliding layers leaves it out, so that each layer keeps its type's default.
    is_causal = {} if config.sliding_layers and not config.causal else {"is_causal": config.causal}
    # transformers' Qwen3Config keeps `sliding_window` only under `use_sliding_window`.
    window = {"use_sliding_window": True, "sliding_window": config.sliding_window} if config.sliding_layers else {}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.target_vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": config.block_size,
        "num_target_layers": config.target_num_layers,
        **is_causal,
        # SGLang reads `is_causal` only for layers that name their type.
        "layer_types": layer_types,
        **window,
        "dflash_config": dflash,
    }


def export_head(head, out: str | Path, fmt: str) -> Path:
    """Write `head` (a JetFlowHead) to `out` in the published layout; refuses what would not round-trip."""
    from safetensors.torch import save_file

    problems = export_problems(head.config)
    if problems:
        raise JetFlowError(f"this head cannot be written as a {fmt} head: " + "; ".join(problems))
    config = published_config(head.config, fmt)
    out = Path(out)
    if out.exists():
        raise JetFlowError(f"export directory already exists: {out}")
    state = published_state_dict({k: v.detach().contiguous() for k, v in head.state_dict().items()})
    partial = out.with_name(out.name + ".partial")  # renamed into place once complete: nothing half-written
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(state, str(partial / "model.safetensors"), metadata={"format": "pt"})
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    partial.rename(out)
    return out

"""The frozen target on HF transformers: loading, forward with fused feature taps, KV compaction."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from jetflow_sglang.errors import JetFlowError


def fast_dtype() -> torch.dtype:
    """bf16 where matmuls run natively in it (CUDA, or a CPU with AMX or AVX512-BF16), else fp32:
    on a CPU without those, bf16 matmuls are emulated and about 4x slower than fp32."""
    if torch.cuda.is_available():
        return torch.bfloat16
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return torch.float32
    return torch.bfloat16 if {"amx_bf16", "avx512_bf16"} & set(flags) else torch.float32


def serving_dtype(choice: str) -> str:
    """A server's `--dtype` from a user's choice: `auto` is bf16 where its matmuls are native (a
    tree verify is compute-bound, so bf16 makes it several times cheaper there), else fp32."""
    if choice == "auto":
        return "bfloat16" if fast_dtype() == torch.bfloat16 else "float32"
    return {"fp32": "float32", "bf16": "bfloat16"}.get(choice, choice)


def check_model_dir(path: str | Path, what: str = "target") -> Path:
    path = Path(path)
    if not path.is_dir():
        raise JetFlowError(f"{what} directory not found: {path}")
    if not (path / "config.json").is_file():
        raise JetFlowError(f"{what} directory has no config.json: {path}")
    if not any(path.glob("*.safetensors")):
        others = [p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"}]
        hint = f" (found {', '.join(sorted(others))}; only safetensors weights are loaded)" if others else ""
        raise JetFlowError(f"{what} directory has no safetensors weights{hint}: {path}")
    return path


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of a prompt: a user turn through the chat template, or a raw completion."""
    if chat:
        if not tokenizer.chat_template:
            raise JetFlowError("the target's tokenizer has no chat template")
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return tokenizer(text, add_special_tokens=True)["input_ids"]


class Target:
    """A HF causal LM whose decoder-layer outputs at `tap_layers` are captured on every forward.

    features: the tapped hidden states concatenated in tap order, [b, T, n_taps * H].
    """

    def __init__(self, path: str | Path, dtype: torch.dtype = torch.float32, tap_layers: list[int] | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = check_model_dir(path)
        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="sdpa", use_safetensors=True
        ).eval()
        self.model.requires_grad_(False)
        self.config = self.model.config
        self.dtype = dtype
        self._captured: dict[int, Tensor] = {}
        self._hooks: list = []
        self.tap_layers: list[int] = []
        self.set_tap_layers(tap_layers or [])

    @property
    def layers(self):
        return self.model.get_decoder().layers

    @property
    def embedding(self) -> Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head(self) -> Tensor:
        return self.model.get_output_embeddings().weight

    @property
    def eos_token_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return set(eos if isinstance(eos, list) else [eos]) - {None}

    def set_tap_layers(self, tap_layers: list[int]) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.tap_layers = [], list(tap_layers)
        for layer_id in self.tap_layers:
            if not 0 <= layer_id < len(self.layers):
                raise JetFlowError(f"tap layer {layer_id} is outside the target's {len(self.layers)} layers")
            self._hooks.append(self.layers[layer_id].register_forward_hook(self._capture(layer_id)))

    def _capture(self, layer_id: int):
        def hook(module, inputs, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def encode_prompt(self, text: str, chat: bool) -> list[int]:
        return encode_prompt(self.tokenizer, text, chat)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cache,
        attention_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One forward over input_ids [b, T] at positions [b, T], appending to `cache`.

        attention_mask: None for causal, else bool [b, 1, T, cached + T] (True = attend).
        Returns logits [b, T, V] (fp32) and tapped features [b, T, n_taps * H]."""
        self._captured.clear()
        if attention_mask is not None:
            attention_mask = torch.zeros(attention_mask.shape, dtype=self.dtype, device=attention_mask.device).masked_fill(
                ~attention_mask, torch.finfo(self.dtype).min
            )
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
        )
        features = torch.cat([self._captured[i] for i in self.tap_layers], -1) if self.tap_layers else None
        return out.logits.float(), features

    @torch.inference_mode()
    def hidden_and_features(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Decoder only (no lm_head), right-padded batch: the final normed hidden states [b, T, H]
        and the tapped features [b, T, n_taps * H]."""
        self._captured.clear()
        out = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        features = torch.cat([self._captured[i] for i in self.tap_layers], -1)
        return out.last_hidden_state, features

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.config)


def compact_cache(cache, keep: Tensor) -> None:
    """Keep only the cache rows `keep` (1-D positions in the cache), in that order."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, keep)
        layer.values = layer.values.index_select(-2, keep)

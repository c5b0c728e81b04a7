"""How tests/data/explain_bf16.json was made: the differences of a real `jetflow bench` report,
re-checked on a fresh target-alone SGLang server in the report's dtype.

    jetflow bench --dtype bfloat16 --prompts demo --max-new-tokens 96 --out REPORT
    python tests/helpers/capture_explain.py REPORT tests/data/explain_bf16.json

Per difference it keeps the prompt's and both answers' token ids up to the first differing
position (from the bench run), the four re-checks of `jetflow_sglang.explain.recheck` and the raw
``/generate`` answer of the ``prefix`` re-check (which `probe_from_output` parses).
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from jetflow_sglang import explain
from jetflow_sglang import server as sglang_server


def main(report_path: str, out_path: str) -> None:
    report = json.loads(Path(report_path).read_text())
    rows = [r for r in report["requests"] if r.get("difference", {}).get("position") is not None]
    work = Path(tempfile.mkdtemp(prefix="capture-explain-"))
    server = sglang_server.start(report["config"]["target"] if report["config"]["target"] != "default"
                                 else _default_target(), work / "ar.log", dtype=report["config"]["dtype"])  # fmt: skip
    cases = []
    try:
        for row in rows:
            d = row["difference"]
            position, prefix = d["position"], d["target_ids"][: d["position"]]
            ignore_eos = report["config"]["ignore_eos"]
            probes = explain.recheck(server.url, d["prompt_ids"], prefix, ignore_eos)
            raw = explain._generate(server.url, d["prompt_ids"] + prefix, 1, ignore_eos)
            cases.append({
                "id": row["id"],
                "kind": row["kind"],
                "position": position,
                "prompt_ids": d["prompt_ids"],
                "target_ids": d["target_ids"][: position + 1],
                "jetflow_ids": d["jetflow_ids"][: position + 1],
                "target_token": d["target_token"],
                "jetflow_token": d["jetflow_token"],
                "target_text": d["target_text"],
                "jetflow_text": d["jetflow_text"],
                "probes": [asdict(p) for p in probes],
                "prefix_output": {"output_ids": raw["output_ids"],
                                  "meta_info": {"output_top_logprobs": raw["meta_info"]["output_top_logprobs"]}},
            })  # fmt: skip
    finally:
        server.stop()
    meta = {"dtype": report["config"]["dtype"], "max_new_tokens": report["config"]["max_new_tokens"],
            "prompts": report["config"]["prompts"], "made_by": "tests/helpers/capture_explain.py"}  # fmt: skip
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps({"meta": meta, "differences": cases}, indent=1) + "\n")


def _default_target() -> str:
    from jetflow_sglang.assets import resolve_target

    return str(resolve_target("default"))


if __name__ == "__main__":
    main(*sys.argv[1:3])

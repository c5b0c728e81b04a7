"""Load and faults on a JETFLOW server: many concurrent clients, mixed requests, aborts.

`benchmarks/load_test.py` runs it on a fresh server (64 clients x 3 rounds by default);
`tests/test_load.py` runs a short version. Each client sends `rounds` requests over held-out
ShareGPT prompts of mixed lengths: greedy and sampled, some with penalties or a regex grammar,
some streamed; some streams are dropped after their first chunks (SGLang aborts the request
when the client goes) and some requests are aborted by rid through /abort_request. Then, with
the server idle (`idle_checks`):

* every request that was not aborted succeeded;
* SGLang's own idle pool check (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1``, `STRICT_MEM_CHECK`:
  it raises on a KV or request-slot leak) never fired, and after ``/flush_cache`` probe prompts'
  prefills log the same token usage as on the fresh server: the KV pool is back to its idle level;
* greedy answers sent after the load equal the same answers sent before it.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from jetflow_sglang import server as sglang_server

STRICT_MEM_CHECK = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
LEAK_MARKERS = ("memory leak detected", "use-after-free")


@dataclass
class LoadConfig:
    clients: int = 64
    rounds: int = 3
    max_new_tokens: int = 64
    seed: int = 0
    drop_stream_every: int = 7  # every 7th request: a stream dropped after its first chunks
    abort_every: int = 11  # every 11th: aborted by rid mid-flight
    stream_every: int = 3  # every 3rd (not dropped): streamed to the end


@dataclass
class LoadReport:
    requests: int = 0
    ok: int = 0
    aborted: int = 0
    failed: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    output_tokens: int = 0
    leak_lines: list[str] = field(default_factory=list)
    idle_token_usage: list[float] | None = None  # the probes' prefill token usage on the fresh server
    token_usage_after: list[float] | None = None  # the same probes after the load and a cache flush
    greedy_same_after_load: bool = False
    healthy_after: bool = False

    @property
    def passed(self) -> bool:
        return (not self.failed and not self.leak_lines and self.idle_token_usage is not None
                and self.token_usage_after == self.idle_token_usage and self.greedy_same_after_load
                and self.healthy_after)  # fmt: skip


def _params(kind: str, max_new_tokens: int) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0}
    if kind == "sampled":
        params.update(temperature=0.8, top_p=0.95)
    elif kind == "penalized":
        params.update(frequency_penalty=0.4, presence_penalty=0.2)
    elif kind == "regex":
        params.update(regex=r"(Yes|No)[.,] [A-Za-z ,]{5,80}\.")
    return params


def _stream(url: str, body: dict, drop_after: int | None) -> dict:
    """Stream /generate; with drop_after, close the connection after that many chunks."""
    request = urllib.request.Request(url + "/generate", data=json.dumps(dict(body, stream=True)).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    last, chunks = None, 0
    with urllib.request.urlopen(request, timeout=1800) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            last, chunks = json.loads(line[5:]), chunks + 1
            if drop_after is not None and chunks >= drop_after:
                return {"dropped": True}
    return last or {}


def _abort_later(url: str, rid: str, delay_s: float) -> None:
    time.sleep(delay_s)
    req = urllib.request.Request(url + "/abort_request", data=json.dumps({"rid": rid}).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:  # SGLang answers an abort with an empty body
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
    except urllib.error.URLError:
        pass


def run_load(url: str, prompts: list[list[int]], config: LoadConfig) -> LoadReport:
    """Send the load; count successes, aborts and failures."""
    rng = random.Random(config.seed)
    kinds = ["greedy", "sampled", "penalized", "regex"]
    jobs = []
    for i in range(config.clients * config.rounds):
        ids = prompts[rng.randrange(len(prompts))]
        body = {"input_ids": ids, "sampling_params": _params(kinds[i % len(kinds)], rng.randint(8, config.max_new_tokens)),
                "rid": f"load-{i}"}  # fmt: skip
        if i % config.drop_stream_every == 0:
            mode = "drop"
        elif i % config.abort_every == 0:
            mode = "abort"
        elif i % config.stream_every == 0:
            mode = "stream"
        else:
            mode = "plain"
        jobs.append((mode, body))
    report = LoadReport(requests=len(jobs))
    lock = threading.Lock()

    def client(k: int) -> None:
        for mode, body in jobs[k :: config.clients]:
            try:
                if mode == "drop":
                    out = _stream(url, body, drop_after=2)
                elif mode == "stream":
                    out = _stream(url, body, drop_after=None)
                else:
                    if mode == "abort":
                        threading.Thread(target=_abort_later, args=(url, body["rid"], 1.0), daemon=True).start()
                    out = sglang_server.post(url + "/generate", body, timeout=1800)
            except urllib.error.HTTPError as error:  # SGLang answers an aborted request with an error status
                text = error.read().decode(errors="replace")
                with lock:
                    if mode == "abort" and "abort" in text.lower():
                        report.aborted += 1
                    else:
                        report.failed.append(f"{body['rid']} ({mode}): {error} {text[:200]}")
                continue
            except (urllib.error.URLError, OSError, ValueError) as error:
                with lock:
                    report.failed.append(f"{body['rid']} ({mode}): {error}")
                continue
            finish = (out.get("meta_info") or {}).get("finish_reason") or {}
            with lock:
                if out.get("dropped") or finish.get("type") == "abort":
                    report.aborted += 1
                elif mode == "abort" or finish.get("type") in ("stop", "length"):
                    report.ok += 1
                    report.output_tokens += len(out.get("output_ids") or [])
                else:
                    report.failed.append(f"{body['rid']} ({mode}): finish {finish}")

    start = time.perf_counter()
    with ThreadPoolExecutor(config.clients) as pool:
        list(pool.map(client, range(config.clients)))
    report.wall_s = time.perf_counter() - start
    return report


def probe(server, probes: list[list[int]]) -> tuple[list[list[int]], list[float]]:
    """Greedy answers to the probes, one at a time, and the token usage each one's prefill logged."""
    mark = len(server.log.read_text(errors="replace"))
    greedy = {"temperature": 0, "max_new_tokens": 16}
    answers = [sglang_server.post(server.url + "/generate", {"input_ids": ids, "sampling_params": greedy})["output_ids"] for ids in probes]
    new_log = server.log.read_text(errors="replace")[mark:]
    return answers, [float(u) for u in re.findall(r"Prefill batch.*?token usage: ([0-9.]+)", new_log)]


def idle_checks(server, probes: list[list[int]], before: tuple[list[list[int]], list[float]], report: LoadReport,
                settle_s: float = 8.0) -> None:  # fmt: skip
    """After the load: the idle leak check had time to run; after a cache flush the probes'
    prefills see the pool as the fresh server did, and their greedy answers are unchanged.
    `before` is `probe(server, probes)` on the fresh server."""
    time.sleep(settle_s)  # the scheduler's idle self-check runs when it has nothing to do
    with urllib.request.urlopen(server.url + "/flush_cache", timeout=60) as resp:
        resp.read()
    answers, usage = probe(server, probes)
    report.idle_token_usage, report.token_usage_after = before[1], usage
    report.greedy_same_after_load = answers == before[0]
    report.leak_lines = [line for line in server.log.read_text(errors="replace").splitlines() if any(m in line for m in LEAK_MARKERS)]
    report.healthy_after = sglang_server.healthy(server.url)


def held_out_prompts(target: str, count: int, seed: int = 0) -> list[list[int]]:
    """Chat-templated held-out ShareGPT prompts of mixed lengths (at most 512 tokens)."""
    from transformers import AutoTokenizer

    from jetflow_sglang.prompts import load_prompts

    tok = AutoTokenizer.from_pretrained(target)
    prompts = []
    for prompt in load_prompts("sharegpt-heldout"):
        ids = list(tok.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))  # fmt: skip
        if len(ids) <= 512:
            prompts.append(ids)
    random.Random(seed).shuffle(prompts)
    return prompts[:count]


def report_rows(report: LoadReport) -> list[tuple[str, object]]:
    """The report as (name, value) rows for a table."""
    return [("requests", report.requests), ("succeeded", report.ok), ("aborted (intended)", report.aborted),
            ("failed", len(report.failed)), ("output tokens", report.output_tokens), ("wall s", f"{report.wall_s:.1f}"),
            ("leak warnings", len(report.leak_lines)),
            ("probe token usage fresh / after load", f"{report.idle_token_usage} / {report.token_usage_after}"),
            ("greedy same after load", report.greedy_same_after_load), ("healthy after", report.healthy_after)]  # fmt: skip

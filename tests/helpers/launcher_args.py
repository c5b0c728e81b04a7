"""What `python -m sglang.launch_server` does with its arguments before it loads a model:
load the plugins, parse, resolve (the JETFLOW validator runs there). Run as a script with
a JSON list of cases ({"name", "argv", "env"}), it prints one JSON line per case:
{"name", "refused", "message"}. One process resolves many launches: the launcher's own
imports (~15 s here) are paid once instead of once per case."""

import json
import os
import sys

from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args


def main() -> None:
    load_plugins()
    for case in json.loads(sys.argv[1]):
        saved = dict(os.environ)
        os.environ.update(case.get("env") or {})
        try:
            prepare_server_args(case["argv"]).resolve_once()
            result = {"refused": False, "message": ""}
        except Exception as exc:  # the launcher dies on any of them; the message is what a user reads
            result = {"refused": True, "message": f"{type(exc).__name__}: {exc}"}
        finally:
            os.environ.clear()
            os.environ.update(saved)
        print(json.dumps({"name": case["name"], **result}), flush=True)


if __name__ == "__main__":
    main()

"""A stand-in trainer for the sandbox attack tests (run as a script, not collected): it holds secrets in
its environment (``RLCORE_STANDIN_SECRET``), its command line (its first argument) and its working
directory (given files), and runs the code of each line it reads on standard input (a JSON object:
``code``, ``isolation``, ``layers``, ``paths``) in the sandbox, answering with a line (JSON: ``output``, ``guards``,
``ok``, or ``error`` when ``run_python`` raised)."""

import json
import sys

from rlcore.envs.sandbox import LAYERS, SandboxLimits, run_python

LIMITS = SandboxLimits(timeout_s=10.0, cpu_s=5, memory_mb=512, max_output_bytes=1 << 16)


def main() -> None:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = run_python(request["code"], LIMITS, isolation=request["isolation"],
                                layers=request.get("layers", LAYERS), paths=request.get("paths", ()))
            answer = {"output": result.output, "guards": list(result.guards), "ok": result.ok}
        except BaseException as error:  # noqa: BLE001 - the test reports it
            answer = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()

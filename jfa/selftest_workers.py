"""The parallel half of the GPU self-tests (`jfa.triton.gpu_selftest`, `jfa.tlx.gpu_selftest`): their cases
run in worker processes, `cmd --worker i/n`, so a case that loses the CUDA context or hangs takes down only
its worker.

A worker prints one JSON object per case, {"line": str, "ok": bool}; anything else it prints is passed
through. A worker that exits with a status outside `expected_exit` (a signal, a lost context) counts as one
failure.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading


def run_workers(cmd: list[str], jobs: int, expected_exit: tuple[int, ...] = (0, 1)) -> tuple[int, int]:
    """Runs `cmd + ["--worker", f"{i}/{jobs}"]` for i < jobs, prints each case's line as it arrives, and
    returns (passed, failed)."""
    procs = [subprocess.Popen(cmd + ["--worker", f"{i}/{jobs}"], stdout=subprocess.PIPE, text=True)
             for i in range(jobs)]
    lines: queue.Queue = queue.Queue()

    def pump(proc):
        for raw in proc.stdout:
            lines.put(raw)
        proc.wait()
        lines.put(proc)

    for proc in procs:
        threading.Thread(target=pump, args=(proc,), daemon=True).start()
    passed = failed = 0
    running = len(procs)
    while running:
        item = lines.get()
        if isinstance(item, subprocess.Popen):
            running -= 1
            if item.returncode not in expected_exit:
                failed += 1
                print(f"FAIL a worker exited with {item.returncode}", flush=True)
            continue
        try:
            record = json.loads(item)
        except json.JSONDecodeError:
            print(item.rstrip(), flush=True)
            continue
        print(record["line"], flush=True)
        passed += record["ok"]
        failed += not record["ok"]
    return passed, failed

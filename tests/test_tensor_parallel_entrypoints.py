"""-tp 2 through the entry points users run (CPU, gloo): the OpenAI server answers the real
`openai` client with the tokens of -tp 1, and Ctrl-C leaves no worker behind; a driver killed
outright takes its workers with it; simple_inference under torchrun prints what -tp 1 prints;
the GSM8K job passes -tp to the server it starts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
from server_process import running_server

from atom_like import LLMEngine, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
WORDS = "w5 w17 w3 w90 w41"


def spawned_workers(pid: int) -> list[int]:
    """Children of `pid` started by multiprocessing's spawn (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                found.append(int(entry))
    return found


def wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if Path(f"/proc/{p}").exists() and "(Z)" not in _state(p)]) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _state(pid: int) -> str:
    try:
        return "(" + Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] + ")"
    except OSError:
        return "(gone)"


def test_server_at_tp2_answers_the_openai_client_and_ctrl_c_stops_its_workers(make_llama, tmp_path):
    path = make_llama(tokenizer=True)
    one = LLMEngine(path, max_model_len=96)
    expected = one.generate([WORDS], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    with running_server(path, "-tp", "2", "--max-model-len", "96", log_dir=tmp_path) as server:
        workers = spawned_workers(server.process.pid)
        assert len(workers) == 2, workers
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=WORDS, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == expected.text and out.usage.completion_tokens == 8
        server.process.send_signal(signal.SIGINT)  # Ctrl-C
        assert server.process.wait(60) == 0, server.log_tail()
    assert wait_gone(workers) == []


def test_a_driver_killed_outright_takes_its_workers_along(make_llama):
    script = ("import sys, time; from atom_like import LLMEngine; "
              "e = LLMEngine(sys.argv[1], tensor_parallel_size=2, max_model_len=96); print('ready', flush=True); "
              "time.sleep(600)")
    driver = subprocess.Popen([sys.executable, "-c", script, make_llama()], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        assert driver.stdout.readline().strip() == "ready"
        workers = spawned_workers(driver.pid)
        assert len(workers) == 2
        driver.kill()  # SIGKILL: no cleanup code of the driver runs
        driver.wait()
        assert wait_gone(workers) == []
    finally:
        driver.kill()


def test_simple_inference_under_torchrun_prints_what_tp1_prints(make_llama, capsys):
    from atom_like.examples import simple_inference

    path = make_llama(tokenizer=True)
    flags = ["--model", path, "--max-tokens", "6", "--max-model-len", "96", "--device", "cpu"]
    simple_inference.main(flags)
    expected = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("Prompt:", "Completion:"))]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "atom_like.examples.simple_inference", *flags, "-tp", "2"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [line for line in run.stdout.splitlines() if line.startswith(("Prompt:", "Completion:"))]
    assert printed == expected and len(expected) == 8


def test_the_gsm8k_job_takes_a_tensor_parallel_size():
    from atom_like.eval.gsm8k import with_tensor_parallel

    assert with_tensor_parallel(["--kv-cache-dtype", "fp8", "-tp", "8", "--trust-remote-code"], 2) == \
        ["--kv-cache-dtype", "fp8", "--trust-remote-code", "-tp", "2"]
    assert with_tensor_parallel([], 4) == ["-tp", "4"]

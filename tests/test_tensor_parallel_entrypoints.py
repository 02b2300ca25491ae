"""-tp 2 through the entry points users run (CPU, gloo): the OpenAI server answers the real
`openai` client with the tokens of -tp 1, and Ctrl-C leaves no worker behind; a driver killed
outright takes its workers with it; the server under torchrun (every rank runs it, rank 0 serves)
answers as -tp 1 does and Ctrl-C ends every rank; the GSM8K job passes -tp to the server it starts."""
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
from atom_like.entrypoints.launch import free_port

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


def children(pid: int, marker: bytes) -> list[int]:
    """Children of `pid` whose command line contains `marker` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and marker in cmdline:
                found.append(int(entry))
    return found


def test_server_under_torchrun_answers_the_openai_client_and_ctrl_c_ends_every_rank(make_llama, tmp_path):
    """Every rank runs the server module; only rank 0 binds the port and serves; Ctrl-C (SIGINT to
    the terminal's process group) ends both ranks cleanly."""
    path = make_llama(tokenizer=True)
    expected = LLMEngine(path, max_model_len=96).generate([WORDS], SamplingParams(temperature=0, max_tokens=8),
                                                         use_tqdm=False)[0]
    port = free_port()
    log = open(tmp_path / "torchrun.log", "w")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "atom_like.entrypoints.openai_server", "--model", path, "-tp", "2", "--max-model-len", "96",
         "--port", str(port), "--disable-uvicorn-access-log"],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 180
        while True:
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()[-3000:]
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                time.sleep(0.3)
        out = client.completions.create(model=model, prompt=WORDS, max_tokens=8, temperature=0)
        assert out.choices[0].text == expected.text
        ranks = children(launcher.pid, b"atom_like.entrypoints.openai_server")
        assert len(ranks) == 2, ranks
        os.killpg(launcher.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches torchrun and every rank
        launcher.wait(60)
        assert wait_gone(ranks) == []
        text = (tmp_path / "torchrun.log").read_text()  # torchrun prefixes a rank's traceback with [rankN]
        assert "[rank0]" not in text and "[rank1]" not in text, text[-3000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        log.close()


def test_the_gsm8k_job_takes_a_tensor_parallel_size():
    from atom_like.eval.gsm8k import with_tensor_parallel

    assert with_tensor_parallel(["--kv-cache-dtype", "fp8", "-tp", "8", "--trust-remote-code"], 2) == \
        ["--kv-cache-dtype", "fp8", "--trust-remote-code", "-tp", "2"]
    assert with_tensor_parallel([], 4) == ["-tp", "4"]

"""The compiled (non-interpreted) kernels build for NVIDIA sm_90 and AMD gfx942 without spills.

Runs ci/compile_kernels.py --quick in a subprocess without TRITON_INTERPRET: the CPU interpreter
never sees what the GPU compiler rejects (loop-carried types, layouts, register pressure).
sm_90 needs ptxas (triton's wheel bundles one) and is skipped by the script when there is none.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _compile(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(REPO / "ci" / "compile_kernels.py"), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert " 0 failures" in result.stdout
    return result.stdout


def _loop_sass(case: str, kernel: str) -> tuple[str, int, dict[str, int]]:
    """compile_kernels' sm_90 loop report for `kernel` in `case`: (its line, instruction count, opcode counts)."""
    out = _compile("--targets", "sm90", "--cases", case, "--sass")
    if "skipping sm90" in out:
        pytest.skip("no ptxas")
    line = next(x for x in out.splitlines() if x.startswith("loop SASS") and kernel in x)
    opcodes = {op: int(n) for op, n in re.findall(r"([A-Z0-9_.]+) (\d+)", line.split("|")[4])}
    return line, int(line.split("|")[3]), opcodes


def test_kernels_compile_for_gpu_targets():
    _compile("--quick", "--targets", "sm90,gfx942")


def test_fp8_mla_decode_loop_on_sm90():
    """The fp8 latent tile is upcast once and read by both dots with ldmatrix (.trans for the
    values) from an fp16 copy, never byte by byte: with Triton's own upcast the sm_90 loop had
    64 LDS.U8 and 786 instructions a warp per 32 tokens (8 warps; docs/benchmarks.md section 6).
    716 with the block ids carried one tile ahead and 3 stages (648 before them)."""
    line, total, opcodes = _loop_sass("MLA 8h fp8 decode split 16", "_mla_attention_kernel")
    assert "LDS.U8" not in opcodes and opcodes.get("LDSM.16.MT88.4", 0) > 0, line
    assert total < 760, line


def test_mxfp4_moe_decode_loop_on_sm90():
    """The decode path's gate/up loop reads packed weights with 16-byte loads and keeps every
    value in its lane (no shared memory, no barrier): 845 instructions a lane per 128 weights
    with the PTX decode when written; 901 with a shared-memory layout conversion of the scales."""
    line, total, opcodes = _loop_sass("MXFP4 MoE decode Kimi TP8 T1 w4a16", "_gate_up_kernel")
    assert opcodes.get("LDG.E.128", 0) >= 4, line  # 2 gate + 2 up rows (+ the activations)
    assert not any(op.startswith(("LDS", "STS", "BAR")) for op in opcodes), line
    assert total < 880, line


def test_mxfp4_moe_decode_w4a4_loop_is_integer_dots_on_sm90():
    """With MXFP4 activations the gate/up loop multiplies codes by codes: 4 prmt lookups and 4
    dp4a per 8 weights (e2m1_dot_ptx), no float decode of the weights, nothing through shared
    memory: 355 instructions a lane per 128 weights when written, against 845 for the
    dequantizing W4A16 loop above."""
    line, total, opcodes = _loop_sass("MXFP4 MoE decode Kimi TP8 T1 w4a4", "_gate_up_kernel")
    assert opcodes.get("IDP.4A.S8.S8", 0) == 64 and opcodes.get("PRMT", 0) == 64, line  # 128 weights
    assert not any(op.startswith(("LDS", "STS", "BAR", "HFMA2", "HMUL2")) for op in opcodes), line
    assert total < 400, line

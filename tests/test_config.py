"""EngineArgs: one dataclass, both flag spellings."""
from __future__ import annotations

import argparse

import pytest

from atom_like import EngineArgs


def parse(argv):
    return EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv))


def test_kebab_and_snake_spellings_agree():
    a = parse(["--model", "m", "--max-num-seqs", "7", "--max-model-len", "99", "--enforce-eager", "--gpu-memory-utilization", "0.5"])
    b = parse(["--model", "m", "--max_num_seqs", "7", "--max_model_len", "99", "--enforce_eager", "--gpu_memory_utilization", "0.5"])
    assert a == b
    assert (a.max_num_seqs, a.max_model_len, a.enforce_eager, a.gpu_memory_utilization) == (7, 99, True, 0.5)


def test_tp_short_flag_and_limit():
    with pytest.raises(ValueError, match="tensor-parallel-size must be an integer >= 1; got 0"):
        parse(["--model", "m", "-tp", "0"])
    assert parse(["--model", "m", "-tp", "8"]).tensor_parallel_size == 8


@pytest.mark.parametrize("argv,match", [
    (["--dtype", "int8"], "--dtype"), (["--device", "tpu"], "--device"), (["--block-size", "12"], "power of two"),
    (["--kv-cache-dtype", "fp8_e5m2"], "kv-cache-dtype"), (["--mxfp4-activations", "bf16"], "mxfp4-activations"),
    (["--gpu-memory-utilization", "1.5"], "gpu-memory-utilization"),
])
def test_bad_flags_are_named(argv, match):
    with pytest.raises(ValueError, match=match):
        parse(["--model", "m", *argv])


def test_extra_flags_parse_to_their_types():
    from atom_like.config import add_flag

    parser = argparse.ArgumentParser()
    add_flag(parser, "max_tokens", int, 128, "")
    add_flag(parser, "temperature", float, 0.0, "")
    add_flag(parser, "limit", "int | None", None, "")
    args = parser.parse_args(["--max-tokens", "5", "--temperature", "0.5", "--limit", "3"])
    assert (args.max_tokens, args.temperature, args.limit) == (5, 0.5, 3)

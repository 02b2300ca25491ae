"""The CPU KV pool is sized from the model: max_num_seqs full sequences, capped at the weights'
size clamped to [64 MiB, 2 GiB] (a tiny model no longer gets a 2 GiB pool)."""
from __future__ import annotations

import logging

from atom_like import LLMEngine
from atom_like.engine.model_runner import CPU_KV_CACHE_MIN_BYTES


def test_cpu_pool_is_sized_from_the_model(llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="atom_like.engine.model_runner"):
        runner = LLMEngine(llama_path, max_model_len=512, max_num_seqs=512).runner  # weights: < 1 MiB
    needed = runner.max_blocks_per_seq
    assert runner.num_blocks == CPU_KV_CACHE_MIN_BYTES // runner.block_bytes < 512 * needed
    assert "KV cache on CPU sized from the model" in caplog.text and "--num-kv-blocks overrides" in caplog.text
    few = LLMEngine(llama_path, max_model_len=512, max_num_seqs=3).runner
    assert few.num_blocks == 3 * needed  # no more than max_num_seqs full sequences
    assert LLMEngine(llama_path, max_model_len=512, num_kv_blocks=40).runner.num_blocks == 40

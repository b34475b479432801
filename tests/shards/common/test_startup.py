"""The start-up line names each phase once, with the part of it torch.compile spent compiling beside it."""

import logging
import time

import torch

from shards.common.startup import StartupClock


def test_a_phase_that_compiled_says_how_much_of_it_was_compiling(caplog):
    clock = StartupClock()
    clock.mark("model")
    compiled = torch.compile(lambda x: torch.sin(x) * 2, backend="eager")
    compiled(torch.ones(4))
    time.sleep(0.01)
    clock.mark("compile")
    with caplog.at_level(logging.INFO):
        record = clock.log("a test run")
    (said,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up of a test run")]
    assert record["compile_s"] >= record["compile_compile_s"] > 0, record
    assert "model_compile_s" not in record
    assert f"compile {record['compile_s']:.1f}s ({record['compile_compile_s']:.1f}s of it compiling)" in said, said
    assert "compile compile" not in said and said.count("model ") == 1, said

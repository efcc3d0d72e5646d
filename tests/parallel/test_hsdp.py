"""HSDP (`fully_shard(module, mesh=Mesh({"dp_replicate": 2, "dp_shard": 2}))`) on 4 ranks
against one process, and its checkpoints resharded to FSDP over 4 and to ddp
(workers/hsdp_checks.py)."""

import pytest
from harness import launch


@pytest.mark.timeout(150)
def test_hsdp_trains_as_one_process_and_reshards():
    result = launch("hsdp_checks.py", 4, timeout=140)
    for rank, checks in enumerate(result.results):
        assert checks, f"rank {rank} reported nothing:\n{result.output}"
        for name, outcome in checks.items():
            assert outcome == "ok", f"rank {rank} {name}:\n{outcome}"

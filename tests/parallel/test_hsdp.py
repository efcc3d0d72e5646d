"""HSDP (`fully_shard(module, mesh=Mesh({"dp_replicate": 2, "dp_shard": 2}))`) on 4 ranks
against one process, and its checkpoints resharded to FSDP over 4 and to ddp
(workers/hsdp_checks.py)."""

import pytest
from harness import assert_all_ok, launch


@pytest.mark.timeout(150)
def test_hsdp_trains_as_one_process_and_reshards():
    result = launch("hsdp_checks.py", 4, timeout=140)
    assert_all_ok(result)

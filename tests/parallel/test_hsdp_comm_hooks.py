"""DDP's communication hooks on HSDP's replica all-reduce
(``FSDPModule.register_comm_hook``): allreduce, fp16, bf16 and PowerSGD against HSDP without
a hook and one process, with gradient accumulation, PowerSGD's state through a checkpoint, on 4 ranks (workers/hsdp_hook_checks.py, one launch)."""

import pytest
from harness import assert_all_ok, launch


@pytest.mark.timeout(150)
def test_hsdp_comm_hooks():
    result = launch("hsdp_hook_checks.py", 4, timeout=140)
    assert_all_ok(result)
    assert len(result.results[0]) == 9, sorted(result.results[0])

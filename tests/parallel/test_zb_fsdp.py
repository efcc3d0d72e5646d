"""Zero-bubble (ZB-V) stages under HSDP on 4 ranks against one process
(workers/zb_fsdp_checks.py): a stateful comm hook (PowerSGD) counts one iteration per step,
a failed W leaves no gradients accumulated for the next step, and the user's
reshard_after_backward is kept."""

import pytest
from harness import assert_all_ok, launch


@pytest.mark.timeout(100)
def test_zbv_under_hsdp():
    result = launch("zb_fsdp_checks.py", 4, timeout=90)
    assert_all_ok(result)
    assert len(result.results[0]) == 3, sorted(result.results[0])

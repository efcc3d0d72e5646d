"""Run under plain python with no torchrun env: init() forms a world of one; print JSON.

Leaves with ``exit_without_teardown`` (os._exit) like the other workers: torch 2.13 + gloo
sometimes aborts in its C++ teardown at interpreter exit (a CI run saw exit -6 after the JSON
was printed), which is torch's exit path, not what this test checks.
"""

import json

import torch
from torch import nn

from meshrun.parallel import Mesh, ddp, init
from tests.parallel.harness import exit_without_teardown

ctx = init()
out = {"same": init() is ctx, "rank": ctx.rank, "world_size": ctx.world_size,
       "local_rank": ctx.local_rank, "device": str(ctx.device), "backend": ctx.backend}
try:
    Mesh({"dp": 2, "tp": 3})
except ValueError as e:
    out["mesh_error"] = str(e)
for shape in ({}, {"dp": 0}):
    try:
        Mesh(shape)
    except ValueError as e:
        out.setdefault("mesh_shape_errors", []).append(str(e))
mesh = Mesh({"dp": 1, "tp": 1})
out["mesh"] = [mesh.size("dp"), mesh.rank("tp"), mesh.group("dp").size()]
try:
    mesh.group("pp")
except KeyError as e:
    out["axis_error"] = str(e)
model = ddp(nn.Linear(4, 2))
model(torch.ones(3, 4)).sum().backward()
out["grad"] = model.bias.grad.tolist()
print(json.dumps(out))
exit_without_teardown()

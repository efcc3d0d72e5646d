"""No private torch name outside meshrun/_torch.py (docs/design.md §4).

torch's underscore names carry no promise; meshrun reaches them through one module, each use
a function that says what it relies on (`meshrun._torch`), so a torch upgrade is checked in
one place. Read from the syntax tree of every module of the package:

- an import from a torch module whose path has a ``_`` part (``torch._utils``,
  ``torch.utils._pytree``), or of a ``_`` name (``from torch... import _x``);
- an attribute ``_x`` (not a dunder) in a chain rooted at a name bound to torch by an import
  (``torch._foreach_copy_``, ``dist.distributed_c10d._world``, ``aten._scaled_...`` where
  ``aten = torch.ops.aten``);
- ``getattr``/``hasattr``/``setattr`` with a ``"_x"`` string on such a chain;
- one of torch's private attributes meshrun is known to need (`KNOWN_PRIVATE`), as an
  attribute or a ``getattr`` string, on any object but ``self``/``cls`` (a module in a loop
  variable, a DeviceMesh in a field: objects whose type the scan cannot see).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "meshrun"
DOOR = PACKAGE / "_torch.py"
#: torch attributes reached on objects whose type the scan cannot see (a DeviceMesh in a field,
#: a module in a loop): DeviceMesh's groups, c10d's registry, the flight recorder, nn.Module's
#: and Tensor's internals
KNOWN_PRIVATE = frozenset({
    "_pg_registry", "_world", "_dump_fr_trace_json", "_dump_nccl_trace_json", "_dump_fr_trace",
    "_dump_nccl_trace",
    "_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks",
    "_backward_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
    "_non_persistent_buffers_set", "_execution_engine", "_base", "_cdata", "_local_tensor",
})


def _private(name: str) -> bool:
    """A torch private name: a leading underscore, not a dunder, not meshrun's own marker
    attribute on a torch object (``_meshrun_*``)."""
    return (name.startswith("_") and not name.startswith("_meshrun")
            and not (name.startswith("__") and name.endswith("__")))


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(path: Path) -> list[str]:
    """``"file:line what"`` for every private torch name in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    bound: set[str] = set()  # names bound to torch modules or objects
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    bound.add((a.asname or a.name).split(".")[0])
                    if any(_private(p) for p in a.name.split(".")):
                        found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "torch":
                continue
            for a in node.names:
                bound.add(a.asname or a.name)
                if any(_private(p) for p in node.module.split(".")) or _private(a.name):
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
    for node in ast.walk(tree):  # names assigned from a torch chain (aten = torch.ops.aten)
        if isinstance(node, ast.Assign) and _root(node.value) in bound:
            bound.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and (
                _root(node) in bound
                or (node.attr in KNOWN_PRIVATE and _root(node) not in ("self", "cls"))):
            found.append((node.lineno, f".{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):  # fmt: skip
            name = node.args[1].value
            if (_private(name) and _root(node.args[0]) in bound) or name in KNOWN_PRIVATE:
                found.append((node.lineno, f'{node.func.id}(..., "{name}")'))
    return [f"{path.name}:{line} {what}" for line, what in sorted(set(found))]


@pytest.mark.timeout(60)
def test_no_private_torch_name_outside_the_door():
    uses = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != DOOR:
            uses += [f"{path.relative_to(PACKAGE.parent).parent}/{u}" for u in private_uses(path)]
    assert uses == []


@pytest.mark.timeout(60)
def test_the_door_imports_neither_torch_nor_meshrun_at_import():
    """Workers load the door by path before the script imports torch, without the package."""
    top = [n for n in ast.parse(DOOR.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top for a in n.names] + [n.module or "" for n in top
                                                       if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] in ("torch", "meshrun")], names


@pytest.mark.timeout(60)
def test_the_scan_catches_each_form(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch._utils import _flatten_dense_tensors\n"
        "from torch.utils import _pytree\n"
        "aten = torch.ops.aten\n"
        "def f(mesh, x, mod):\n"
        "    torch._foreach_copy_(x, x)\n"
        "    mod._parameters['w'] = x\n"
        "    self._parameters = {}\n"
        "    n = dist.distributed_c10d._world.group_count\n"
        "    op = getattr(aten, '_scaled_dot_product_flash_attention', None)\n"
        "    return getattr(mesh, '_pg_registry', None), aten._fused_op, x._meshrun_mark\n"
    )
    uses = private_uses(planted)
    assert sorted(u.split(" ", 1)[1] for u in uses) == sorted([
        "from torch._utils import _flatten_dense_tensors",
        "from torch.utils import _pytree",
        "._foreach_copy_",
        "._world",
        "getattr(..., \"_scaled_dot_product_flash_attention\")",
        "getattr(..., \"_pg_registry\")",
        "._fused_op",
        "._parameters",
    ]), uses

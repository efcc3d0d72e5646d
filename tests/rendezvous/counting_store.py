"""`CountingStore`: a store wrapper that counts one agent's operations.

Test and benchmark code, not meshrun's: the O(1)-operations-per-node tests
(``test_protocol.py``) and ``benchmarks/rendezvous.py`` (which puts this folder on ``sys.path``)
wrap each agent's store in one and read ``ops``.
"""

from __future__ import annotations

from meshrun.rendezvous.store import Liveness, Store


class CountingStore(Store):
    """Wraps a store and counts one agent's operations (the O(1)-per-node tests and benchmark)."""

    def __init__(self, inner: Store):
        self.inner = inner
        self.ops = 0

    def get(self, key):
        self.ops += 1
        return self.inner.get(key)

    def get_many(self, keys):
        self.ops += 1
        return self.inner.get_many(keys)

    def compare_and_set(self, key, expected_version, value):
        self.ops += 1
        return self.inner.compare_and_set(key, expected_version, value)

    def add(self, key, delta):
        self.ops += 1
        return self.inner.add(key, delta)

    def wait_for_change(self, key, version, timeout):
        self.ops += 1
        return self.inner.wait_for_change(key, version, timeout)

    def register(self, prefix, name, value):
        self.ops += 1
        return self.inner.register(prefix, name, value)

    def count(self, prefix):
        self.ops += 1
        return self.inner.count(prefix)

    def entries(self, prefix, limit, timeout):
        self.ops += 1
        return self.inner.entries(prefix, limit, timeout)

    @property
    def serves_others(self):
        return self.inner.serves_others

    @property
    def outlives_agents(self):
        return self.inner.outlives_agents

    def liveness(self, node_id, dead_after):
        return _CountingLiveness(self, self.inner.liveness(node_id, dead_after))

    def delete_prefix(self, prefix):
        self.ops += 1
        self.inner.delete_prefix(prefix)

    def close(self):
        self.inner.close()


class _CountingLiveness(Liveness):
    def __init__(self, owner: CountingStore, inner: Liveness):
        self._owner = owner
        self._inner = inner

    def joining(self):
        self._owner.ops += 1
        return self._inner.joining()

    def beat(self):
        self._owner.ops += 1
        self._inner.beat()

    def is_alive(self, node_id):
        self._owner.ops += 1
        return self._inner.is_alive(node_id)

    def close(self):
        self._inner.close()
